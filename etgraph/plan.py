"""The compiled plan (:class:`Plan`: what ``etgraph compile`` produces, in memory or as a
compiled directory) and the settings its ``plan.json`` hands on to ``etgraph train`` (issue #14).

A compiled directory holds::

    OUT/model.onnx          the legalised forward model (what everything else was built from)
    OUT/graph.json|.graphml|.dot   tensor-level backward graph with timings, importance, selection
    OUT/profile.json        per-tensor t_dw_us / t_dy_us, forward_us, measured_full_step_us
    OUT/memory.json         with --memory-mb: the memory model (etgraph.memory.MemoryProfile)
    OUT/plan.json           the selection: rho, budget, t_full_us, predicted step time, the
                            per-tensor table, frozen and trainable parameter lists; the
                            model's input normalisation (``preprocess``), the frozen batch-norm
                            mode (``frozen_bn``) and the data it was compiled with, reused by
                            ``etgraph train OUT``; with ``--head-lr-scale S`` the
                            head's scale (``head_lr_scale``, ``head_lr``)
    OUT/artifacts/          training_model.onnx, eval_model.onnx, optimizer_model.onnx, checkpoint
                            (the frozen parameters baked into the graphs, raw in
                            training_model.onnx.data, which both graphs reference;
                            plan.json's ``artifacts_form``, :data:`ARTIFACT_FORMS`)

With ``--head-lr-scale S`` (issue #30) ``model.onnx``, the profile, the graph and the artifacts
are of the *scaled* model (:mod:`passes.onnx.head_lr`: the head's kernel and bias stored divided
by ``S``, its output multiplied by ``S``): that is what trains the head at ``S`` times the
learning rate. ``etgraph train OUT`` trains at the plan's ``S``; the model it exports has the
scale folded back.

``etgraph compile`` records the model's input normalisation (``preprocess``,
:class:`etgraph.images.Preprocess`) and the frozen batch-norm mode (``frozen_bn``,
:mod:`etgraph.artifacts`) in ``plan.json``; ``etgraph train DIR`` reuses them.
:func:`train_settings` merges them with the command line's options: **an option given on the
command line wins** (the user asked for it), and where it differs from the plan a warning says
so, naming both; the run's ``run.json`` records what was used. A plan written before these
fields existed gives the defaults.

Kept apart from :mod:`etgraph.pipeline` so ``etgraph train`` does not import the compiler.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from passes.onnx import DEFAULT_FROZEN_BN

from . import onnx_io, timing
from .artifacts import check_frozen_bn
from .config import TrainConfig
from .errors import ConfigError, ModelError, ProfileMismatchError
from .files import (
    atomic_target,
    check_outputs,
    check_outside_folders,
    ensure_writable_dir,
    exclusive_lock,
    read_json,
    staged_directory,
    sweep_stale_temp_dirs,
    write_json_atomic,
)
from .images import DEFAULT_PREPROCESS, Preprocess, make_preprocess
from .memory import MemoryProfile
from .model import LoadedModel
from .profile import Profile
from .rundir import check_not_run_dir

log = logging.getLogger(__name__)

__all__ = [
    "ARTIFACT_FORMS",
    "COMPILED_OUTPUTS",
    "PLAN_FILE",
    "Plan",
    "read_plan",
    "train_settings",
]

PLAN_FILE = "plan.json"
PROFILE_FILE = "profile.json"
MEMORY_FILE = "memory.json"
MODEL_FILE = "model.onnx"
ARTIFACTS_DIR = "artifacts"
GRAPH_FILES = ("graph.json", "graph.graphml", "graph.dot")  # etgraph.dumps.GRAPH_FORMATS
#: ``plan.json``'s ``artifacts_form``: ``baked`` — the frozen parameters are constants of
#: ``training_model.onnx`` and ``eval_model.onnx`` (raw in ``<graph>.data`` beside them; the
#: checkpoint still holds every parameter: train from it, whose frozen values the constants
#: equal), the form etgraph's loop steps (MobileNetV2 DP selection at 128 px: 18.1 vs 28.0 ms
#: per step as generated, README "Versus PyTorch eager"); ``inputs`` — every parameter a graph
#: input, as ``generate_artifacts`` writes them (under a memory budget).
ARTIFACT_FORMS = ("baked", "inputs")
#: Every entry of a compiled directory (module docstring); plan.json says it is complete.
COMPILED_OUTPUTS = (MODEL_FILE, PROFILE_FILE, MEMORY_FILE, *GRAPH_FILES, ARTIFACTS_DIR, PLAN_FILE)


def read_plan(directory: str | os.PathLike) -> dict | None:
    """The ``plan.json`` of a compiled directory, or None when it has none.

    Raises:
        ConfigError: the file is not readable JSON.
    """
    path = Path(directory) / PLAN_FILE
    if not path.is_file():
        return None
    again = "compile the model again with etgraph compile"
    return read_json(path, what="", if_missing=again, if_unreadable=again)


def train_settings(
    plan: dict | None,
    *,
    preset: str | None = None,
    mean: str | None = None,
    std: str | None = None,
    scale: float | None = None,
    channel_order: str | None = None,
    frozen_bn: str | None = None,
) -> tuple[Preprocess, str]:
    """``(preprocess, frozen_bn)`` for a training run: the plan's, overridden by the options
    given (None = not given). ``preset`` starts from a preset instead of the plan's values;
    ``mean``, ``std``, ``scale`` and ``channel_order`` override single fields. An override
    that differs from the plan is logged as a warning.

    Raises:
        ConfigError: a bad option value or a malformed record in the plan
            (:func:`etgraph.data.make_preprocess`, :func:`etgraph.artifacts.check_frozen_bn`).
    """
    plan = plan or {}
    recorded = Preprocess.from_json(plan["preprocess"]) if plan.get("preprocess") else None
    preprocess = make_preprocess(
        preset if preset is not None else recorded,
        mean=mean,
        std=std,
        scale=scale,
        channel_order=channel_order,
    )
    if recorded is not None and _values(preprocess) != _values(recorded):
        log.warning(
            "preprocessing differs from the compiled plan's (%s): training with %s, as given",
            recorded.describe(),
            preprocess.describe(),
        )
    recorded_bn = plan.get("frozen_bn")
    mode = check_frozen_bn(frozen_bn or recorded_bn or DEFAULT_FROZEN_BN)
    if recorded_bn is not None and mode != recorded_bn:
        log.warning(
            "--frozen-bn %s differs from the compiled plan's %s: training with %s, as given "
            "(the plan's predicted step was for %s)",
            mode,
            recorded_bn,
            mode,
            recorded_bn,
        )
    return preprocess, mode


def _head_lr_json(model: LoadedModel) -> dict | None:
    """``plan.json``'s ``head_lr``: the head's scale (None: not scaled) and what it means."""
    record = model.head_lr
    if record is None:
        return None
    return {
        "scale": record.scale,
        "layer": record.layer,
        "tensors": list(record.tensors),
        "note": f"model.onnx, the checkpoint and artifacts/ hold these tensors divided by "
        f"{record.scale:g} and multiply the layer's output by {record.scale:g} (node "
        f"{record.node}): the head trains at {record.scale:g}x the learning rate; etgraph "
        "train's exported model and its weights API fold the scale back",
    }


def _values(p: Preprocess) -> tuple:
    return (p.mean, p.std, p.scale, p.channel_order)


@dataclass
class Plan:
    """A compiled model: the selection of paper Eq. (3) at ``rho`` with everything that made it
    (:func:`etgraph.pipeline.compile`), in memory; :meth:`save` writes it as a compiled
    directory (the module docstring), :meth:`load` reads one back.

    Attributes:
        model: the legalised model (:class:`etgraph.model.LoadedModel`).
        profile: its profile on this device (both batch-norm modes; :attr:`time_model` is the
            one of ``frozen_bn``).
        rho: the requested step-time ratio, in (0, 1].
        batch_size: the batch the profile and the artifacts are for.
        input_shapes: per-example shape of each input, by input name.
        mask: the selection mask, bool [N], forward order (:attr:`LoadedModel.names`).
        importance: float64 [N] the selection maximised (paper Eq. 2, or the data-free prior).
        importance_source: where ``importance`` came from (one line).
        preprocess: the model's input normalisation for image folders.
        frozen_bn: how unselected batch norms run (``"inference"`` or ``"train"``).
        data, tokenizer: the data it was compiled with (a spec; None: none given) and the text
            tokenizer; ``etgraph train DIR`` uses them unless told otherwise.
        resolution: the DP's time resolution ``T_q`` (None: exact µs).
        memory_profile, memory_mb, memory_resolution_mb: the memory model, the peak-memory
            budget (MiB) and the DP's memory unit (None: time budget only).
        tensor_graph: the tensor-level backward graph (networkx) with the plan's attributes, for
            the dumps; None for a plan loaded from a directory (its dumps are there).
    """

    model: LoadedModel
    profile: Profile
    rho: float
    batch_size: int
    input_shapes: dict[str, tuple[int, ...]]
    mask: np.ndarray
    importance: np.ndarray
    importance_source: str = ""
    preprocess: Preprocess = DEFAULT_PREPROCESS
    frozen_bn: str = DEFAULT_FROZEN_BN
    data: str | None = None
    tokenizer: str | None = None
    resolution: int | None = None
    memory_profile: MemoryProfile | None = None
    memory_mb: float | None = None
    memory_resolution_mb: float | None = None
    tensor_graph: object | None = field(default=None, repr=False)

    @property
    def time_model(self) -> Profile:
        """The profile of the artifacts' batch-norm mode (:meth:`Profile.for_frozen_bn`)."""
        return self.profile.for_frozen_bn(self.frozen_bn)

    @property
    def artifacts_form(self) -> str:
        """How ``artifacts/`` hold the frozen parameters (:data:`ARTIFACT_FORMS`): ``baked``
        (constants of the training and eval graphs, as etgraph's own sessions run them and its
        profile measures them: ORT folds and lays out the frozen part as at inference), or
        ``inputs`` under a memory budget (graph inputs fed from the checkpoint, as
        ``generate_artifacts`` writes them: the memory model's form, baking holds the frozen
        weights twice)."""
        return "inputs" if self.memory_mb is not None else "baked"

    @property
    def trainable(self) -> list[str]:
        """The selected tensors' initializer names (``requires_grad``), forward order."""
        return self.model.split(self.mask)[0]

    @property
    def frozen(self) -> list[str]:
        """Every other parameter (``frozen_params``): unselected tensors, running statistics."""
        return self.model.split(self.mask)[1]

    @property
    def predicted_step_us(self) -> float:
        """The time model's training step of the selection, µs (paper §2.2)."""
        return self.time_model.predicted_step_us(self.mask)

    @property
    def t_full_us(self) -> float:
        """The time model's full training step (every tensor), µs."""
        return self.time_model.t_full_us

    @property
    def predicted_speedup(self) -> float:
        """Full step over the selection's step, both predicted by the time model."""
        return self.t_full_us / self.predicted_step_us

    @property
    def memory_parts_mb(self) -> dict | None:
        """The memory model's peak of the selection and its parts, MiB (None: no budget)."""
        if self.memory_profile is None:
            return None
        return self.memory_profile.parts_mb(self.mask)

    def train_config(self, **settings) -> TrainConfig:
        """A :class:`etgraph.config.TrainConfig` for this plan: its rho, batch size,
        preprocessing, batch-norm mode, data, tokenizer and head learning-rate scale, overridden
        by ``settings`` (a ``head_lr_scale`` other than the model's is refused when training).

        Raises:
            ConfigError: a setting is out of range (:meth:`TrainConfig.validate`).
        """
        base = dict(
            rho=self.rho,
            batch_size=self.batch_size,
            preprocess=self.preprocess,
            frozen_bn=self.frozen_bn,
            data=self.data,
            tokenizer=self.tokenizer,
            head_lr_scale=self.model.head_lr_scale,
        )
        return TrainConfig(**{**base, **settings}).validate()

    def trainer(self, config: TrainConfig | None = None, **kwargs):
        """An :class:`etgraph.trainer.ElasticTrainer` of this plan's model and profile
        (``config`` default: :meth:`train_config`); keyword arguments as the trainer's."""
        from .trainer import ElasticTrainer  # ORT training: only when training

        return ElasticTrainer(
            self.model,
            self.profile,
            config if config is not None else self.train_config(),
            memory_profile=self.memory_profile,
            **kwargs,
        )

    def to_json(self) -> dict:
        """``plan.json``: the settings, the time model's figures and the per-tensor table."""
        prof, model = self.time_model, self.model
        parts = self.memory_parts_mb
        rows = [
            {
                "index": t.index,
                "name": t.name,
                "kind": t.kind,
                "t_dw_us": float(dw),
                "t_dy_us": float(dy),
                "importance": float(imp),
                "selected": bool(s),
            }
            for t, s, imp, dw, dy in zip(
                model.tensors, self.mask, self.importance, prof.t_dw_us, prof.t_dy_us, strict=True
            )
        ]
        if self.memory_profile is not None:  # what each tensor adds, and its workspace
            mp = self.memory_profile
            for row, t_mb, e_mb in zip(rows, mp.tensor_mb, mp.earliest_mb, strict=True):
                row.update({"tensor_mb": float(t_mb), "earliest_mb": float(e_mb)})
        trainable, frozen = model.split(self.mask)
        return {
            "model": str(model.source),
            "model_hash": model.hash,
            "rho": self.rho,
            "batch_size": self.batch_size,
            "input_shapes": {name: list(dims) for name, dims in self.input_shapes.items()},
            "task": model.task.to_json(),  # output trained on, loss, K or D; `train OUT` reuses it
            "forward_us": prof.forward_us,
            "t_full_us": prof.t_full_us,
            "measured_full_step_us": prof.measured_full_step_us,
            "budget_us": timing.budget_us(self.rho, prof.forward_us, prof.t_full_us),
            "predicted_step_us": self.predicted_step_us,
            "memory_mb": self.memory_mb,  # the peak-memory budget (MiB), None = time only
            "predicted_peak_mb": None if parts is None else parts["peak_mb"],
            "memory_parts_mb": parts,  # etgraph.memory.MemoryProfile.parts_mb
            "memory_resolution_mb": self.memory_resolution_mb,
            "importance_source": self.importance_source,
            "removed_head": model.head,  # restored on the trained model etgraph train exports
            "head_lr_scale": model.head_lr_scale,  # etgraph train OUT trains at it
            "head_lr": _head_lr_json(model),
            "resolution": self.resolution,
            "preprocess": self.preprocess.to_json(),  # reused by etgraph train OUT
            "frozen_bn": self.frozen_bn,
            "artifacts_form": self.artifacts_form,  # ARTIFACT_FORMS: frozen weights baked in?
            "data": self.data,  # the data compiled with: etgraph train OUT's default
            "tokenizer": self.tokenizer,
            "tensors": rows,
            "frozen_params": frozen,
            "trainable_params": trainable,
        }

    def save(self, out_dir: str | os.PathLike) -> Path:
        """Write the compiled directory ``out_dir`` (module docstring; created): built beside
        its entries and swapped in only when complete (``plan.json`` last), under an exclusive
        lock, so a failed or killed save leaves the last good compile.

        Raises:
            ConfigError: ``out_dir`` cannot be written, holds a training run, another process
                holds it, or an entry would replace a special file or one of the plan's inputs.
            ModelError: the selection's artifacts cannot be generated.
        """
        model_files = onnx_io.model_files(self.model.source)
        out = prepare_compiled_dir(out_dir, inputs=[*model_files, self.data, self.tokenizer])
        with exclusive_lock(out, "-o"):
            self.write(out)
        return out

    def write(self, out: Path) -> None:
        """:meth:`save`'s work into ``out`` (checked by :func:`prepare_compiled_dir`, its lock
        held by the caller)."""
        from . import artifact_weights, artifacts, dumps  # the generator, networkx: on write

        with staged_directory(out, COMPILED_OUTPUTS, PLAN_FILE) as stage:
            with atomic_target(stage / MODEL_FILE) as tmp:
                onnx.save(self.model.proto, str(tmp))
            self.profile.save(stage / PROFILE_FILE)
            if self.memory_profile is not None:
                self.memory_profile.save(stage / MEMORY_FILE)
            paths = artifacts.generate(
                self.model.proto,
                self.trainable,
                self.frozen,
                stage / ARTIFACTS_DIR,
                loss=self.model.task.loss,
                frozen_bn=self.frozen_bn,
                static_batch=(self.batch_size, self.input_shapes),  # as the profile measured
            )
            if self.artifacts_form == "baked":  # what etgraph's loop runs (and profiles)
                weights = artifact_weights.initializer_values(self.model.proto, self.frozen)
                artifact_weights.bake_frozen(paths.directory, weights, paths.directory)
            plan = self.to_json()
            graph = self.tensor_graph
            if graph is not None:
                from passes.layout import tensor_id

                columns = ("t_dw_us", "t_dy_us", "importance", "selected")
                columns += ("tensor_mb", "earliest_mb")
                for row in plan["tensors"]:  # the plan's attributes on the tensor nodes
                    node = graph.nodes[tensor_id(row["name"])]
                    node.update({k: row[k] for k in columns if k in row})
                for fmt in dumps.GRAPH_FORMATS:
                    dumps.write_graph(graph, stage / f"graph.{fmt}", fmt)
            else:  # a loaded plan: the dumps of the directory it was loaded from
                for name in GRAPH_FILES:
                    if (self.model.source.parent / name).is_file():
                        (stage / name).write_bytes((self.model.source.parent / name).read_bytes())
            write_json_atomic(stage / PLAN_FILE, plan)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> Plan:
        """Read the compiled directory ``directory`` (:meth:`save`'s).

        Raises:
            ModelError: not a compiled directory, or an unfinished compile (no ``plan.json``).
            ConfigError: its files are unreadable.
            ProfileMismatchError: its profile is of another model (the model was replaced).
        """
        source = Path(directory)
        if not (source / MODEL_FILE).is_file():
            raise ModelError(
                f"{source} is not a compiled directory (no {MODEL_FILE}): pass an ONNX file, or "
                f"compile one into it with etgraph compile MODEL -o {source}"
            )
        plan = read_plan(source)
        if plan is None:  # written last by compile
            raise ModelError(
                f"{source} is an unfinished compile (no {PLAN_FILE}): compile again with "
                f"etgraph compile MODEL -o {source}"
            )
        profile = Profile.load(source / PROFILE_FILE)
        model = LoadedModel.load(source / MODEL_FILE, loss=profile.loss)
        try:  # the directory's files belong together
            profile.check_matches(model.hash)
        except ProfileMismatchError as exc:
            raise ProfileMismatchError(f"{source / PROFILE_FILE}: {exc}") from exc
        try:  # a field missing from an older (or hand-written) plan gets its default
            rows = plan.get("tensors") or []
            trainable = set(plan.get("trainable_params") or [])
            selected = (
                np.array([bool(r["selected"]) for r in rows])
                if rows
                else np.array([n in trainable for n in model.names])
            )
            importance = np.array(
                [float(r["importance"]) for r in rows] or np.zeros(len(model.names))
            )
            shapes = plan.get("input_shapes") or profile.input_shapes
            memory_file = source / MEMORY_FILE
            return cls(
                model=model,
                profile=profile,
                rho=float(plan["rho"]),
                batch_size=int(plan["batch_size"]),
                input_shapes={k: tuple(v) for k, v in shapes.items()},
                mask=selected,
                importance=importance,
                importance_source=plan.get("importance_source", ""),
                preprocess=Preprocess.from_json(plan["preprocess"])
                if plan.get("preprocess")
                else DEFAULT_PREPROCESS,
                frozen_bn=plan.get("frozen_bn") or DEFAULT_FROZEN_BN,
                data=plan.get("data"),
                tokenizer=plan.get("tokenizer"),
                resolution=plan.get("resolution"),
                memory_profile=MemoryProfile.load(memory_file) if memory_file.is_file() else None,
                memory_mb=plan.get("memory_mb"),
                memory_resolution_mb=plan.get("memory_resolution_mb"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"{source / PLAN_FILE} is incomplete ({type(exc).__name__}: {exc}): compile the "
                "model again with etgraph compile"
            ) from exc

    def replace(self, **changes) -> Plan:
        """A copy with ``changes`` (dataclasses.replace)."""
        return dataclasses.replace(self, **changes)


def prepare_compiled_dir(out_dir: str | os.PathLike, *, inputs=()) -> Path:
    """Check, before any work, that a compiled directory can be written at ``out_dir``
    (created): outside the input folders, writable, not a training run, no entry a special
    file or one of ``inputs``; stale temporaries of killed compiles are swept.

    Raises:
        ConfigError: naming the path and ``-o``.
    """
    check_outside_folders(out_dir, inputs, "-o")  # before ensure_writable_dir creates it
    out = ensure_writable_dir(out_dir, "-o")
    check_not_run_dir(out, "-o")
    sweep_stale_temp_dirs(out)  # what a killed compile left
    check_outputs([out / name for name in COMPILED_OUTPUTS], "-o", inputs=inputs)
    return out
