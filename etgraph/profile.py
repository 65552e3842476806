"""The profile of one model on one device, and its cache (paper §5).

* :class:`Profile` — measured per-tensor ``t_dw_us`` / ``t_dy_us`` (float64 [N], µs, forward
  order), the selection-independent ``forward_us`` and how they were obtained; JSON to and from
  disk (:meth:`Profile.save`, :meth:`Profile.load`), :meth:`Profile.check_matches` against the
  setting it is used in, the time model's ``T_full`` (:attr:`Profile.t_full_us`) and a
  selection's predicted step (:meth:`Profile.predicted_step_us`).
* :func:`default_cache_dir`, :func:`profile_key` — where :func:`etgraph.profiler.profile_model`
  caches profiles and under which name.

JSON format (``format_version``): 6 records the profiling ``level`` (``fast`` or
``thorough``), the trace's per-node cost and the load average; 5 held one per-sample shape per
model input (``input_shapes``, by input name) and the loss; 4 named the measured full step
``measured_full_step_us`` and had one ``input_shape`` (of the input named ``input``); format 3
called it ``full_step_us``. Formats 3, 4 and 5 still load (keys mapped; they were all measured
at the ``thorough`` level). Profiles of other formats raise
:class:`~etgraph.errors.ProfileMismatchError`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import ConfigError, ProfileMismatchError
from .files import read_json, write_json_atomic
from .timing import BranchCharges, step_us

__all__ = [
    "PROFILE_FORMAT_VERSION",
    "Profile",
    "default_cache_dir",
    "format_shape",
    "format_shapes",
    "profile_key",
]

#: JSON format written by :meth:`Profile.to_dict`. 2: branch charges; 3: measured without
#: thread-pool spinning; 4: ``full_step_us`` renamed ``measured_full_step_us``; 5: per-input
#: ``input_shapes`` and ``loss``; 6: ``level``, ``trace_overhead_us``, ``load_average``.
PROFILE_FORMAT_VERSION = 6

#: Older formats :meth:`Profile.from_dict` still reads, with the keys renamed since (all of
#: them measured what the ``thorough`` level measures).
_RENAMED_KEYS = {3: {"full_step_us": "measured_full_step_us"}, 4: {}, 5: {}}

#: Profiling levels (:data:`etgraph.profiler.LEVELS`).
_LEVELS = ("fast", "thorough")

#: The one input of every model profiled before format 5 (legalisation renamed it so).
_LEGACY_INPUT = "input"

#: Version of the measurement method in :func:`profile_key`. Bumped when what is measured
#: changes (format 3: no spinning; 4: batch norms also measured in inference mode,
#: ``batch_norms``; 5: sessions bake frozen parameters, ``last_only_inference``; 6: the
#: first_only selection timed baked in inference mode, ``inference_path_moved_us``; 7: the
#: kernels of nodes ORT's optimisations renamed count for their nodes,
#: :func:`etgraph.measure.traced_node`), not for JSON renames: a cached format-3 profile
#: measured the same way still hits.
_METHOD_VERSION = 7


@dataclass
class Profile:
    """Measured per-tensor timings of one model on this device (paper §5).

    Attributes:
        model_hash: :func:`etgraph.onnx_io.model_hash` of the profiled model.
        tensors: trainable tensor names, forward order (index 0 nearest the input), length N.
        kinds: tensor kinds (kernel, bias, gamma, beta, embedding, ...), length N.
        t_dw_us: float64 [N] µs: time to compute (and apply with AdamW) tensor k's own gradient;
            paid iff tensor k is selected.
        t_dy_us: float64 [N] µs: time of the error-gradient work charged to tensor k; paid iff the
            earliest selected tensor is at or before k.
        forward_us: µs paid by every step whatever the selection: ``forward_pass_us +
            optimizer_fixed_us + step_overhead_us``.
        measured_full_step_us: MEASURED step (:func:`etgraph.measure.robust_time`, the 20th
            percentile) with all tensors trainable, µs: at the ``thorough`` level a
            training-API step (Module + AdamW + grad reset); at ``fast`` the training graph's
            run in a plain session without the trace
            (:meth:`etgraph.measure.ProfiledGraph.untraced_time_us`: per-node minimum kernel
            times + executor cost per node + the run's time outside its kernels) plus the
            AdamW kernel's fit for every tensor. Not ``T_full``: that is :attr:`t_full_us`,
            the time model's full step.
        batch_size, threads (intra-op threads), ort_version, host.
        input_shapes: per-sample shape (dims after the batch) of every model input, by name,
            graph order (:func:`etgraph.io_specs.input_shapes`).
        loss: the loss the training graphs were built with (``"ce"`` or ``"mse"``).
        clock: how real steps were timed, ``"wall"`` or ``"cpu"``
            (:func:`etgraph.measure.step_clock`).
        level: how much was measured, ``"fast"`` or ``"thorough"``
            (:mod:`etgraph.profiler`, "Profiling levels").
        forward_pass_us: forward + loss kernels (+ per-node overhead), µs.
        optimizer_fixed_us, optimizer_per_tensor_us, optimizer_per_element_us: AdamW fit, µs
            (:class:`etgraph.fold.OptimizerFit`).
        node_overhead_us: executor cost per node outside its kernel, µs.
        trace_overhead_us: what ORT's per-node trace adds to a profiled run (the time
            between kernels less the executor's ``node_overhead_us``), µs per node, of the fast
            level's full graph (left out of its step times); 0 at ``thorough``.
        step_overhead_us: measured step minus what nodes and optimizer explain, mean over the
            profiled configurations (:func:`etgraph.fold.calibrate`), µs.
        forward_saved_fraction: share of a layer's forward time saved when no gradient passes
            it (:func:`etgraph.fold.saved_forward_fraction`); that share is on ``t_dy_us`` of the
            layer's anchor tensor, the rest in ``forward_pass_us``.
        repeats, warmup: runs per measurement.
        reproduced: fast level: whether two of its rounds took the same wall time (within
            ``etgraph.profile_levels.REPRODUCED_TOLERANCE``); False: other work stretched every
            round, the shape of the model may be off, and the profile is not cached. None: not
            checked (thorough level, or a profile from before this field).
        profiling_s: wall time the profiling took, s.
        load_average: the machine's 1-minute load average when profiling ended (None: not
            recorded); a busy machine inflates every time.
        checks: ``{configuration: {"measured_us", "predicted_us", "trainable"}}`` for the
            configurations profiled (a built-in validation of the time model).
        nodes: per backward-graph node ``{name, op, us, charge, tensor}`` of the full graph.
        branches: ``t_dy`` work of ops on parallel branches (D(o) not a prefix), grouped:
            ``[{"tensor", "prefix", "extra": [indices], "us"}]``
            (:class:`~etgraph.timing.BranchCharges`); already inside ``t_dy_us``, used to count
            it exactly.
        batch_norms: each batch norm's cost in training and in inference mode
            (:func:`etgraph.fold.batch_norm_modes`); the timings above are of training mode
            (``--frozen-bn train``), :meth:`for_frozen_bn` gives those of ``inference``.
        inference_forward_moved_us: float [N] µs (or empty): forward time moved from
            ``forward_us`` to ``t_dy_us`` per anchor tensor in inference mode on top of
            training mode's, measured with the ``last_only_inference`` configuration (a frozen
            layer's Conv + BN + activation fuse in baked graphs); applied by
            :meth:`for_frozen_bn`.
        inference_path_moved_us: float [N] µs (or empty): forward time moved from ``t_dy_us``
            to ``t_dw_us`` per anchor tensor in inference mode, measured with the first_only
            selection baked in inference mode (the fast level's ``first_only``, the thorough
            level's ``first_only_inference``): a frozen layer the gradient passes runs
            baked (Conv + BN + activation fused, frozen Convs blocked), so its forward costs
            its training-mode time only when one of its tensors trains; applied by
            :meth:`for_frozen_bn`.
    """

    model_hash: str
    tensors: list[str]
    kinds: list[str]
    t_dw_us: np.ndarray
    t_dy_us: np.ndarray
    forward_us: float
    measured_full_step_us: float
    batch_size: int
    input_shapes: dict[str, tuple[int, ...]]
    threads: int
    ort_version: str
    host: str
    clock: str = "wall"
    loss: str = "ce"
    level: str = "thorough"
    forward_pass_us: float = 0.0
    optimizer_fixed_us: float = 0.0
    optimizer_per_tensor_us: float = 0.0
    optimizer_per_element_us: float = 0.0
    node_overhead_us: float = 0.0
    trace_overhead_us: float = 0.0
    step_overhead_us: float = 0.0
    forward_saved_fraction: float = 0.0
    repeats: int = 0
    warmup: int = 0
    reproduced: bool | None = None
    profiling_s: float = 0.0
    load_average: float | None = None
    checks: dict = field(default_factory=dict)
    nodes: list = field(default_factory=list)
    branches: list = field(default_factory=list)
    batch_norms: list = field(default_factory=list)
    inference_forward_moved_us: list = field(default_factory=list)
    inference_path_moved_us: list = field(default_factory=list)
    #: Where this profile was read from the cache (not saved; None: measured now or loaded).
    cached_from: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        self.t_dw_us = np.asarray(self.t_dw_us, dtype=np.float64)
        self.t_dy_us = np.asarray(self.t_dy_us, dtype=np.float64)
        self.input_shapes = {
            str(k): tuple(int(d) for d in v) for k, v in dict(self.input_shapes).items()
        }

    def to_dict(self) -> dict:
        """JSON-ready dict (format :data:`PROFILE_FORMAT_VERSION`); per-tensor rows under
        ``"tensor_timings"``."""
        out = {"format_version": PROFILE_FORMAT_VERSION}
        for f in dataclasses.fields(self):
            if f.name in ("tensors", "kinds", "t_dw_us", "t_dy_us", "cached_from"):
                continue
            value = getattr(self, f.name)
            if f.name == "input_shapes":
                value = {k: list(v) for k, v in value.items()}
            out[f.name] = list(value) if isinstance(value, tuple) else value
        out["tensor_timings"] = [
            {"index": i, "name": n, "kind": k, "t_dw_us": float(dw), "t_dy_us": float(dy)}
            for i, (n, k, dw, dy) in enumerate(
                zip(self.tensors, self.kinds, self.t_dw_us, self.t_dy_us, strict=True)
            )
        ]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> Profile:
        """Inverse of :meth:`to_dict`; also reads formats 5, 4 and 3 (``level`` thorough;
        ``input_shape`` becomes the shape of input ``input``; format 3's ``full_step_us`` is
        ``measured_full_step_us``).

        Raises:
            ProfileMismatchError: another format version.
            KeyError, TypeError: a required field is missing or malformed.
        """
        version = data.get("format_version")
        if version != PROFILE_FORMAT_VERSION and version not in _RENAMED_KEYS:
            raise ProfileMismatchError(
                f"profile format {version!r} is not {PROFILE_FORMAT_VERSION}: "
                "re-run `etgraph profile`"
            )
        renamed = _RENAMED_KEYS.get(version, {})
        rows = data["tensor_timings"]
        kwargs = {
            renamed.get(k, k): v
            for k, v in data.items()
            if k not in ("format_version", "tensor_timings")
        }
        if "input_shape" in kwargs:
            kwargs["input_shapes"] = {_LEGACY_INPUT: kwargs.pop("input_shape")}
        known = {f.name for f in dataclasses.fields(cls)} - {"cached_from"}
        kwargs = {k: v for k, v in kwargs.items() if k in known}
        if kwargs.get("level", "thorough") not in _LEVELS:
            raise ProfileMismatchError(
                f"profile level {kwargs['level']!r} is not one of {', '.join(_LEVELS)}: "
                "re-run `etgraph profile`"
            )
        return cls(
            tensors=[r["name"] for r in rows],
            kinds=[r["kind"] for r in rows],
            t_dw_us=[r["t_dw_us"] for r in rows],
            t_dy_us=[r["t_dy_us"] for r in rows],
            **kwargs,
        )

    def save(self, path: str | os.PathLike) -> Path:
        """Write the profile as JSON (format :data:`PROFILE_FORMAT_VERSION`) atomically
        (:func:`etgraph.files.write_json_atomic`); returns the path."""
        return write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        """Read a profile written by :meth:`save` (format 6, or 5, 4, 3).

        Raises:
            ConfigError: the file is missing or not valid JSON.
            ProfileMismatchError: the file is a profile of another format version, or lacks a
                field.
        """
        path = Path(path)
        data = read_json(
            path, what="profile", if_missing="run `etgraph profile`", if_unreadable="delete it"
        )
        if not isinstance(data, dict) or "format_version" not in data:
            raise ProfileMismatchError(
                f"{path} is not an etgraph profile (no format_version): re-run `etgraph profile` "
                "(or compile again)"
            )
        try:
            return cls.from_dict(data)
        except ProfileMismatchError as exc:
            raise ProfileMismatchError(f"{path}: {exc}") from exc
        except (KeyError, TypeError) as exc:
            raise ProfileMismatchError(
                f"profile {path} lacks field {exc}: re-run `etgraph profile`"
            ) from exc

    def check_matches(
        self,
        model_hash: str,
        *,
        batch_size: int | None = None,
        input_shapes: Mapping[str, Sequence[int]] | None = None,
        threads: int | None = None,
        clock: str | None = None,
        loss: str | None = None,
        level: str | None = None,
    ) -> None:
        """Raise :class:`ProfileMismatchError` unless this profile fits the given setting.

        Args:
            model_hash: :func:`etgraph.onnx_io.model_hash` of the model it is used for.
            batch_size, input_shapes, threads, clock, loss, level: checked when given.
        """
        if model_hash != self.model_hash:
            raise ProfileMismatchError(
                f"profile is of model {self.model_hash[:12]}, not {model_hash[:12]}: "
                "profile this model (`etgraph profile MODEL.onnx`)"
            )
        if batch_size is not None and int(batch_size) != self.batch_size:
            raise ProfileMismatchError(
                f"profile was measured at batch size {self.batch_size}, not {batch_size}: "
                "re-profile with --batch-size"
            )
        if input_shapes is not None and format_shapes(input_shapes) != format_shapes(
            self.input_shapes
        ):
            raise ProfileMismatchError(
                f"profile was measured at input shape {format_shapes(self.input_shapes)}, not "
                f"{format_shapes(input_shapes)}: re-profile with --input-shape"
            )
        if loss is not None and loss != self.loss:
            raise ProfileMismatchError(
                f"profile was measured with loss {self.loss}, not {loss}: re-profile with --loss"
            )
        if threads is not None and int(threads) != self.threads:
            raise ProfileMismatchError(
                f"profile was measured with {self.threads} threads, not {threads}: "
                "re-profile with --threads"
            )
        if clock is not None and clock != self.clock:
            raise ProfileMismatchError(
                f"profile timed steps with the {self.clock} clock, not {clock}: re-profile"
            )
        if level is not None and level != self.level:
            raise ProfileMismatchError(
                f"profile was measured at level {self.level}, not {level}: re-profile with "
                f"--profile-level {level}"
            )

    @property
    def t_full_us(self) -> float:
        """``T_full`` of paper Eq. (1): the time model's step with every tensor selected, in µs.

        The budget ``rho * T_full`` compares two estimates of the same time model (the paper's
        ``T_selective(M) <= rho * T_full``), so ``rho = 1`` always admits every tensor, however
        noisy the measurement ``measured_full_step_us`` was; that stays the measurement that
        validates the model.
        """
        return float(self.forward_us + self.t_dw_us.sum() + self.t_dy_us.sum())

    @property
    def branch_charges(self) -> BranchCharges:
        """:class:`etgraph.timing.BranchCharges` of :attr:`branches`.

        Raises:
            ConfigError: malformed branch rows.
        """
        return BranchCharges.from_rows(self.branches, len(self.tensors))

    def predicted_step_us(self, mask) -> float:
        """:func:`etgraph.timing.step_us` of ``mask`` (bool [N]) with this profile's timings,
        branch work counted exactly, µs."""
        return step_us(mask, self.t_dw_us, self.t_dy_us, self.forward_us, self.branch_charges)

    def for_frozen_bn(self, frozen_bn: str) -> Profile:
        """The time model of runs with ``frozen_bn`` (issue #14; :mod:`etgraph.artifacts`).

        ``"train"``: this profile (every batch norm in training mode, as profiled). With
        ``"inference"`` a batch norm whose gamma and beta are both unselected runs in inference
        mode. Per batch norm (gamma ``g``, beta ``b``; measured costs in :attr:`batch_norms`),
        with ``d_dy = train_dy - inference_dy`` and ``d_fwd = train_forward -
        inference_forward`` (either may be negative: on small activations the inference
        rewrite's extra nodes can cost more than ``BatchNormInternal``):

        * ``t_dy_us[b] -= d_dy`` (and its branch group): a gradient passing the layer pays the
          backward of the mode the layer is in when it is frozen;
        * ``forward_us -= d_fwd``: every frozen layer's forward is the inference one;
        * ``t_dw_us[g] += (d_dy + d_fwd) / 2`` and the same on ``t_dw_us[b]``: selecting the
          layer puts it back in training mode.

        Then :attr:`inference_forward_moved_us` (when measured) moves forward time to
        ``t_dy_us`` per anchor (paid iff the gradient passes that layer), and
        :attr:`inference_path_moved_us` moves forward time from ``t_dy_us`` to ``t_dw_us``
        per anchor (paid iff the anchor tensor trains). Exact when both or
        neither of ``g`` and ``b`` are selected, and ``T_full`` (every
        tensor selected, every batch norm in training mode) is unchanged, so the budget
        ``rho * T_full`` is the same in both modes; when exactly one is selected the
        prediction is off by ``(d_dy + d_fwd) / 2`` (µs, per such layer). Tensor times are
        clamped at 0, the clamped amount taken off the forward time, so ``T_full`` stays
        exactly the profile's.

        Returns:
            A new :class:`Profile` (``batch_norms`` emptied: the adjustment is applied once),
            or this one for ``"train"`` or when it has no batch-norm rows (a profile of method
            version 3; re-profile to have them).

        Raises:
            ConfigError: ``frozen_bn`` is neither ``"inference"`` nor ``"train"``.
        """
        if frozen_bn not in ("inference", "train"):
            raise ConfigError(f"unknown frozen batch-norm mode {frozen_bn!r}")
        if frozen_bn == "train" or not self.batch_norms:
            return self
        t_dw, t_dy = self.t_dw_us.copy(), self.t_dy_us.copy()
        forward = self.forward_us
        branches = [dict(r, extra=list(r["extra"])) for r in self.branches]
        for row in self.batch_norms:
            g, b = int(row["gamma"]), int(row["beta"])
            d_dy = row["train_dy_us"] - row["inference_dy_us"]
            d_fwd = row["train_forward_us"] - row["inference_forward_us"]
            t_dy[b] -= d_dy
            forward -= d_fwd
            t_dw[[g, b]] += (d_dy + d_fwd) / 2
            if row.get("gap") is not None:
                prefix, extra = int(row["gap"][0]), sorted(int(i) for i in row["gap"][1])
                for r in branches:
                    if (r["tensor"], r["prefix"], sorted(r["extra"])) == (b, prefix, extra):
                        r["us"] = max(0.0, r["us"] - d_dy)
        if len(self.inference_forward_moved_us) == len(t_dy):
            moved = np.asarray(self.inference_forward_moved_us, dtype=np.float64)
            t_dy += moved
            forward -= float(moved.sum())
        if len(self.inference_path_moved_us) == len(t_dy):
            moved = np.asarray(self.inference_path_moved_us, dtype=np.float64)
            t_dy -= moved
            t_dw += moved
        clamped = float(np.maximum(-t_dw, 0.0).sum() + np.maximum(-t_dy, 0.0).sum())
        return dataclasses.replace(
            self,
            t_dw_us=np.maximum(t_dw, 0.0),
            t_dy_us=np.maximum(t_dy, 0.0),
            forward_us=forward - clamped,
            branches=branches,
            batch_norms=[],
            inference_forward_moved_us=[],
            inference_path_moved_us=[],
        )


def format_shape(shape: Sequence[int]) -> str:
    """``"3x32x32"`` for ``(3, 32, 32)``."""
    return "x".join(str(int(d)) for d in shape)


def format_shapes(shapes: Mapping[str, Sequence[int]]) -> str:
    """``"3x32x32"`` for a single input; ``"input_ids=16,attention_mask=16"`` for several."""
    if len(shapes) == 1:
        return format_shape(next(iter(shapes.values())))
    return ",".join(f"{name}={format_shape(dims)}" for name, dims in shapes.items())


def default_cache_dir() -> Path:
    """Default profile cache: ``$ETGRAPH_CACHE/profiles``, else ``~/.cache/etgraph/profiles``."""
    root = os.environ.get("ETGRAPH_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "etgraph"
    return base / "profiles"


def profile_key(
    model_hash: str,
    input_shapes: Mapping[str, Sequence[int]],
    batch_size: int,
    threads: int,
    clock: str = "wall",
    loss: str = "ce",
    level: str = "thorough",
) -> str:
    """Cache key of a profile (16 hex digits): sha256 over model hash, input shapes
    (:func:`format_shapes`), batch size, threads, clock, the loss (when not ``ce``), the
    profiling level (when not ``thorough``) and the measurement method's version (a cached
    ``thorough`` profile of format 5 still hits: measured the same way)."""
    text = (
        f"{model_hash}|{format_shapes(input_shapes)}|{int(batch_size)}|{int(threads)}|{clock}"
        f"|v{_METHOD_VERSION}"
    )
    if loss != "ce":
        text += f"|{loss}"
    if level != "thorough":
        text += f"|{level}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]
