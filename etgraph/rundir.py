"""The run directory of ``etgraph train``: its files, log, summary and the checks that resume it.

A run directory holds (names below; the period loop is :mod:`etgraph.loop`):

* ``run.json`` — model path, configuration and its hash, artifact cache (:func:`write_run_file`);
* ``profile.json`` — the profile the run selects with;
* ``log.jsonl`` — one :class:`EpochRecord` per line, appended and fsynced after every epoch
  (:func:`etgraph.files.append_jsonl`; read back with :func:`etgraph.files.read_jsonl`);
* ``checkpoint`` — ORT checkpoint after every period: weights, AdamW moments and step, and the
  run state in the string property ``etgraph_run`` (:func:`checkpoint_properties`);
* ``classes.json`` — output index -> label, from the data (:mod:`etgraph.labels`; also in
  ``model_trained.onnx``'s metadata);
* ``model_trained.onnx``, ``curves.png``, ``selection.png``, ``summary.json`` at the end
  (:class:`TrainResult`, :func:`summarize`, :func:`format_summary`);
* ``artifacts/`` (the run's own artifact cache unless a shared one is given) and ``.session/``
  (the checkpoint a new selection's session starts from; removed at the end).

Every file is written atomically (:mod:`etgraph.files`): a kill leaves the last complete version
and, at worst, temporaries that :func:`remove_temporaries` deletes when the run resumes. One
process at a time trains in a run directory (:func:`locked`).
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
from onnx import helper

from . import files
from .checkpoint import (
    DIGEST_SUFFIX,
    PREVIOUS_SUFFIX,
    CarriedState,
    read_checkpoint,
    verify_checkpoint,
)
from .errors import CheckpointError, ConfigError, DataError
from .labels import CLASSES_FILE
from .model import LoadedModel

log = logging.getLogger(__name__)

__all__ = [
    "ARTIFACTS_DIR",
    "CHECKPOINT_FILE",
    "COMPILED_FILES",
    "CURVES_FILE",
    "LOG_FILE",
    "MEMORY_FILE",
    "PROFILE_FILE",
    "RUN_FILE",
    "RUN_PROPERTY",
    "SELECTION_FILE",
    "SESSION_DIR",
    "SUMMARY_FILE",
    "TRAINED_MODEL_FILE",
    "EpochRecord",
    "TrainResult",
    "append_log",
    "check_resume_data",
    "checkpoint_properties",
    "check_not_run_dir",
    "check_run_dir",
    "format_summary",
    "locked",
    "prepare_run_dir",
    "read_data_in_memory",
    "read_earlier_hashes",
    "read_log",
    "read_run_checkpoint",
    "read_run_file",
    "remove_temporaries",
    "start_log",
    "summarize",
    "truncate_log",
    "write_run_file",
    "write_summary",
]

LOG_FILE = "log.jsonl"
CHECKPOINT_FILE = "checkpoint"
RUN_FILE = "run.json"
PROFILE_FILE = "profile.json"
MEMORY_FILE = "memory.json"  # the memory model of a run under --memory-mb
SUMMARY_FILE = "summary.json"
TRAINED_MODEL_FILE = "model_trained.onnx"
CURVES_FILE = "curves.png"
SELECTION_FILE = "selection.png"
ARTIFACTS_DIR = "artifacts"
SESSION_DIR = ".session"
#: String property of the run's checkpoint holding the run state (JSON).
RUN_PROPERTY = "etgraph_run"

#: Files written atomically in the run directory: their temporaries are removed on resume.
_ATOMIC_FILES = (
    CHECKPOINT_FILE,
    CHECKPOINT_FILE + DIGEST_SUFFIX,
    CHECKPOINT_FILE + PREVIOUS_SUFFIX,
    LOG_FILE,
    SUMMARY_FILE,
    RUN_FILE,
    TRAINED_MODEL_FILE,
    CLASSES_FILE,
    CURVES_FILE,
    SELECTION_FILE,
)

C = TypeVar("C")


# ---- records -----------------------------------------------------------------------------------


@dataclass
class EpochRecord:
    """One line of ``log.jsonl`` (times in seconds unless ``_us``; accuracies in [0, 1])."""

    epoch: int  # 1-based
    period: int  # 0-based period index
    train_loss: float
    train_acc: float
    val_loss: float
    val_acc: float
    wall_time_s: float  # this epoch, training only (validation excluded, as in the paper)
    cumulative_wall_time_s: float
    learning_rate: float  # at the end of the epoch
    selection: list[int]  # indices of the selected tensors (forward order)
    n_tensors: int
    predicted_step_us: float
    measured_step_us: float  # mean step (forward+backward+update), first step of a session excluded
    reselection_s: float  # importance + selection + artifacts + session creation (0 if none)
    importance_s: float  # the period start's, plus the gradient pass after a period's last
    #   step for the next period's importance (etgraph.steps.train_steps carry_after)
    selection_s: float
    artifacts_s: float
    session_s: float
    artifacts_cache_hit: bool | None
    peak_rss_mb: float  # peak resident memory of this period so far
    steps: int
    # Measured alike and the closed loop (etgraph.clock):
    rho_requested: float
    rho_predicted: float  # (predicted + offset) / (t_full_us + offset), the fit of this period
    predicted_measured_step_us: float  # fit.scale * (predicted + offset); NaN before any fit
    median_step_us: float  # median step, first step of a session excluded
    reference_step_us: float  # full step measured alike: median_step_us / rho_measured (the
    #   epoch's own median for `full`)
    reference_steps: int  # timed full reference steps (0 for `full`)
    rho_measured: float  # elastic / full step, each reference step against the elastic steps
    #   around it (etgraph.clock.reference_ratio)
    reference_s: float  # reference steps (warm-ups included) + opening their session
    fit_s: float  # fitting the time model (in selection_s)
    fit_scale: float  # StepTimeFit.scale used by this period's selection
    fit_fixed_us: float  # StepTimeFit.fixed_us: measured µs per step outside the model
    median_step_cpu_us: float  # as median_step_us, process CPU time (what the fit uses)
    reference_step_cpu_us: float  # as reference_step_us, process CPU time
    rho_measured_cpu: float  # as rho_measured, process CPU time
    val_s: float  # validation after the epoch (not in wall_time_s)
    predicted_peak_mb: float | None = None  # the memory model's peak of the selection (MiB)
    ort_config: str = "off"  # the sessions' options (etgraph.config_choice.TRAIN_CANDIDATES label)
    ort_probe_s: float = 0.0  # choosing them at the run's start (in wall_time_s)
    ort_probe_step_ms: dict[str, float] | None = None  # each candidate's full step (probe)
    ort_note: str = ""  # why the options were not probed (with the epoch that chose them)


@dataclass
class TrainResult:
    """Summary of a finished run (also written to ``summary.json``)."""

    out_dir: str
    strategy: str
    epochs: int
    final_val_acc: float
    final_val_loss: float
    inference_val_acc: float  # of the exported model in a plain InferenceSession
    wall_time_s: float
    full_time_s: float  # steps * full_step_us: full training's time, measured alike
    speedup: float  # full_time_s / wall_time_s (both measured in this run)
    rho_requested: float
    rho_predicted: float  # mean predicted step / t_full_us (both from the profile's time model)
    rho_achieved: float  # median over epochs of elastic step / full step measured alike
    rho_achieved_cpu: float  # the same by process CPU time (robust to other processes' load)
    full_step_us: float  # the full step measured alike (median of the epochs')
    reference_overhead_pct: float  # reference steps, % of the wall time
    deadline_s: float | None  # deadline mode: the deadline, from the command's start
    elapsed_s: float  # from the command's start (or train()'s) to the end of the run
    first_selection_s: float  # period 0: importance + DP + the first session (full pays one too)
    reselection_overhead_pct: float  # re-selections of periods >= 1, % of those periods' wall time
    peak_rss_mb_first_period: float
    peak_rss_mb_last_period: float
    trained_model: str
    ort_config: str = "off"  # the sessions' options the run trained with (last epoch's)
    ort_probe_s: float = 0.0  # choosing them by measurement (in wall_time_s)
    ort_probe_step_ms: dict[str, float] | None = None  # each candidate's full step, probed
    ort_note: str = ""  # why they were not probed
    head_lr_scale: float = 1.0  # the head trained at this factor times the learning rate
    run_rho: float | None = None  # rho of the whole run (--rho-scope run; None: of a step)


# ---- run.json and the directory ---------------------------------------------------------------


#: Files that make a directory an ``etgraph compile`` output (plan.json, model.onnx).
COMPILED_FILES = ("plan.json", "model.onnx")


def check_run_dir(out: Path, inputs: Iterable = ()) -> None:
    """Refuse, before any work, a new run's directory ``out`` (which need not exist yet) that
    cannot be created or written, holds a special file or one of ``inputs`` where a run file
    goes, lies in an input folder (image data), is a compiled directory, or holds a run. A run
    that saved no checkpoint (it failed or was stopped before its first period ended) kept
    nothing: a new run may start over there.

    Args:
        inputs: the run's input files (model, data, tokenizer, profile; None entries
            skipped), which no run file may replace, nor the run's folders join.

    Raises:
        ConfigError: naming the path and what to do (another ``--out``, or ``--resume`` for a
            run there).
    """
    inputs = [Path(p) for p in inputs if p is not None]
    files.check_creatable_dir(out, "--out")
    files.check_outside_folders(out, inputs, "--out")  # a resume would fail
    run_files = (*_ATOMIC_FILES, PROFILE_FILE, MEMORY_FILE)
    files.check_outputs([out / name for name in run_files], "--out", inputs=inputs)
    if any((out / name).exists() for name in COMPILED_FILES):
        raise ConfigError(
            f"{out} is a compiled directory (etgraph compile): train into another --out, "
            f"e.g. {out / 'train'}"
        )
    if (out / CHECKPOINT_FILE).exists():
        raise ConfigError(
            f"{out} already holds a training run: continue it with `etgraph train --resume {out}` "
            "or choose another --out"
        )


def prepare_run_dir(out: Path, inputs: Iterable = ()) -> Path:
    """Create ``out`` for a new run once :func:`check_run_dir` accepts it (checked first, so
    nothing is created where it refuses, e.g. inside an image folder), writable
    (:func:`etgraph.files.ensure_writable_dir`).

    Raises:
        ConfigError: ``out`` cannot be written, or :func:`check_run_dir` refuses it.
    """
    check_run_dir(out, inputs)
    files.ensure_writable_dir(out, "--out")
    if (out / RUN_FILE).exists():
        log.info("%s holds a run that saved no checkpoint: starting it over", out)
    return out


def locked(*, new: bool) -> Callable[[Callable[..., C]], Callable[..., C]]:
    """Decorator of the entry points that write a run directory (their ``out_dir`` argument):
    hold its exclusive lock (:func:`etgraph.files.exclusive_lock`) for the whole call, so a
    second process writing the same run is refused with one line naming the holder's pid.

    Args:
        new: the call starts a run (the directory is created, writable); else it continues
            one (a directory without ``run.json`` is not locked: the call refuses it).
    """

    def decorate(function: Callable[..., C]) -> Callable[..., C]:
        signature = inspect.signature(function)

        @functools.wraps(function)
        def call(*args, **kwargs) -> C:
            out = Path(signature.bind(*args, **kwargs).arguments["out_dir"])
            if new:
                files.ensure_writable_dir(out, "--out")
            elif not (out / RUN_FILE).is_file():
                return function(*args, **kwargs)
            with files.exclusive_lock(out, "--out" if new else "run directory"):
                return function(*args, **kwargs)

        return call

    return decorate


def check_not_run_dir(out: Path, option: str) -> None:
    """Refuse to write a compiled directory over a training run (its profile and artifacts).

    Raises:
        ConfigError: ``out`` holds a training run.
    """
    if (out / CHECKPOINT_FILE).exists() or (out / RUN_FILE).exists():
        raise ConfigError(
            f"{out} holds a training run (etgraph train): choose another {option} to compile into"
        )


def write_run_file(
    out: Path,
    *,
    model: str | os.PathLike,
    config: Mapping,
    config_hash: str,
    artifacts_root: str | os.PathLike | None,
    task: Mapping | None = None,
    earlier_hashes: Sequence[str] = (),
    data_in_memory: Sequence[str] = (),
) -> Path:
    """Write ``run.json`` (what :func:`read_run_file` needs to resume the run), atomically.

    Args:
        out: run directory.
        model: absolute path of the forward ONNX model (reloaded on resume).
        config: the configuration as JSON (``TrainConfig.to_json()``).
        config_hash: its digest (``TrainConfig.digest()``), checked on resume.
        artifacts_root: a shared artifact cache, or None for the run's own ``artifacts/``.
        task: the output trained on and the loss (:meth:`etgraph.io_specs.Task.to_json`), to
            reload the model with on resume (:func:`read_run_task`).
        earlier_hashes: the digests of the run's configurations before it was extended
            (``--resume --epochs``): its checkpoints written under them still resume it.
        data_in_memory: ``"data"``, ``"val_data"``: given in memory, not by ``config``'s
            spec, so a resume needs them again (:func:`check_resume_data`).
    """
    info = {
        "model": str(model),
        "config": dict(config),
        "config_hash": config_hash,
        "artifacts_root": str(Path(artifacts_root).resolve()) if artifacts_root else None,
        "task": dict(task) if task is not None else None,
        "earlier_config_hashes": list(earlier_hashes),
        "data_in_memory": list(data_in_memory),
    }
    return files.write_json_atomic(out / RUN_FILE, info)


def read_run_task(out: Path) -> dict:
    """The task (``output``, ``loss``) recorded in ``run.json`` by :func:`write_run_file`;
    ``{}`` for runs written before it was recorded (one output, cross-entropy). Read after
    :func:`read_run_file` has checked the file."""
    try:
        return dict(json.loads((out / RUN_FILE).read_text()).get("task") or {})
    except (OSError, ValueError, TypeError):
        return {}


def read_earlier_hashes(out: Path) -> list[str]:
    """The configuration digests the run had before it was extended (:func:`write_run_file`);
    read after :func:`read_run_file` has checked the file."""
    try:
        return [str(h) for h in json.loads((out / RUN_FILE).read_text())["earlier_config_hashes"]]
    except (OSError, ValueError, TypeError, KeyError):
        return []


def read_data_in_memory(out: Path) -> list[str]:
    """What the run was given in memory (:func:`write_run_file`); read after
    :func:`read_run_file` has checked the file."""
    try:
        return [str(n) for n in json.loads((out / RUN_FILE).read_text())["data_in_memory"]]
    except (OSError, ValueError, TypeError, KeyError):
        return []


def check_resume_data(out: Path, data, val_data) -> None:
    """Refuse to resume the run in ``out`` without the data it was given in memory
    (:func:`write_run_file`): its configuration names other data (the embedded digits when
    it names none), which the run would train on silently.

    Raises:
        DataError: naming what to pass again.
    """
    given = {"data": data, "val_data": val_data}
    missing = [n for n in read_data_in_memory(out) if given.get(n) is None]
    if missing:
        raise DataError(
            f"the run in {out} trained on {' and '.join(missing)} given in memory: pass "
            f"{', '.join(f'{n}=...' for n in missing)} again to ElasticTrainer.resume "
            "(`etgraph train --resume` cannot resume it)"
        )


def read_run_file(out: Path, load_config: Callable[[dict], C]) -> tuple[Path, C, Path | None]:
    """Read ``run.json`` of the run in ``out``.

    Args:
        out: run directory.
        load_config: builds the configuration from its JSON dict and validates it (e.g.
            ``TrainConfig.from_json``); it must have ``digest()``.

    Returns:
        ``(model, config, artifacts_root)`` as given to :func:`write_run_file`.

    Raises:
        CheckpointError: no ``run.json`` (no run there), unreadable or incomplete, or its
            configuration does not match its hash (edited by hand).
        ConfigError: as ``load_config`` for an out-of-range setting.
    """
    path = out / RUN_FILE
    files.require_run_dir(out)
    try:
        info = json.loads(path.read_text())
        config = load_config(info["config"])
        model = Path(info["model"])
    except FileNotFoundError as exc:
        raise CheckpointError(
            f"{out} holds no training run ({RUN_FILE} missing): start one with `etgraph train`"
        ) from exc
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read ({exc.strerror}): check the path") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is corrupt: start a new run") from exc
    if info.get("config_hash") != config.digest():
        raise CheckpointError(f"{path} was modified (config hash differs)")
    artifacts_root = info.get("artifacts_root")
    return model, config, Path(artifacts_root) if artifacts_root else None


def remove_temporaries(out: Path) -> None:
    """Delete the temporaries of atomic writes a killed run left half-written in ``out`` (never
    read, they would otherwise stay forever). The artifact cache removes its own."""
    files.remove_temporaries(out, _ATOMIC_FILES)


# ---- the log ----------------------------------------------------------------------------------


def start_log(out: Path) -> None:
    """Start an empty ``log.jsonl`` (a new run, or a restart before the first checkpoint)."""
    files.write_atomic(out / LOG_FILE, "")


def append_log(out: Path, record: dict) -> None:
    """Append one epoch's record to ``log.jsonl``, fsynced (survives a kill)."""
    files.append_jsonl(out / LOG_FILE, record)


def read_log(out: str | os.PathLike) -> list[dict]:
    """The epoch records of the run in ``out``, in order, up to a line cut by a kill."""
    return files.read_jsonl(Path(out) / LOG_FILE)


def truncate_log(out: Path, epoch: int) -> list[dict]:
    """Keep the records of epochs ``<= epoch`` (those of the last checkpoint), rewriting the log
    atomically: the epochs after it are trained again on resume. Returns the kept records."""
    records = [r for r in read_log(out) if r["epoch"] <= epoch]
    files.write_atomic(out / LOG_FILE, "".join(json.dumps(r) + "\n" for r in records))
    return records


# ---- the run's checkpoint ---------------------------------------------------------------------


def checkpoint_properties(
    *, epoch: int, global_step: int, mask: np.ndarray, config_hash: str, seed: int
) -> dict[str, str]:
    """String properties of the checkpoint after ``epoch`` (a period end): the run state that
    :func:`read_run_checkpoint` checks and resumes from.

    Args:
        epoch: epochs done (1-based count).
        global_step: training steps done.
        mask: bool [N], the selection of the period that just ended.
        config_hash: ``TrainConfig.digest()`` of the run.
        seed: the run seed (the data order and probe batches derive from it).
    """
    run_state = {
        "epoch": epoch,
        "global_step": global_step,
        "selection": [int(i) for i in np.flatnonzero(mask)],
        "config_hash": config_hash,
        "rng": {
            "scheme": "epoch seed = seed*1000+epoch; probe seed = seed*1000+100000+period",
            "seed": seed,
        },
    }
    return {RUN_PROPERTY: json.dumps(run_state)}


def read_run_checkpoint(
    out: Path, model: LoadedModel, config_hash: str | Sequence[str]
) -> tuple[CarriedState, int]:
    """Read the run's ``checkpoint`` and check that it can resume training ``model``: first its
    sha256 against the one recorded when it was written
    (:func:`etgraph.checkpoint.verify_checkpoint`; a damaged checkpoint is replaced by the
    previous one if that is intact, and the run continues from there).

    Returns:
        ``(state, epoch)``: the carried state and the number of epochs done.

    Raises:
        CheckpointError: damaged (no intact previous one) or corrupt; without etgraph's run
            state; of another configuration; lacks a tensor of ``model``; or holds a tensor
            whose shape or dtype differs from the model's (ORT would fail deep inside
            otherwise). Each message names the file.
    """
    path = out / CHECKPOINT_FILE
    verify_checkpoint(path)
    carried, _, properties = read_checkpoint(path)
    try:
        run_state = json.loads(properties[RUN_PROPERTY])
        epoch = int(run_state["epoch"])
    except (KeyError, ValueError, TypeError) as exc:
        raise CheckpointError(
            f"checkpoint {path} has no run state: it was not written by etgraph"
        ) from exc
    hashes = [config_hash] if isinstance(config_hash, str) else list(config_hash)
    if run_state.get("config_hash") not in hashes:
        raise CheckpointError(f"checkpoint {path} belongs to another configuration")
    missing = (set(model.names) | set(model.running_stats)) - set(carried.weights)
    if missing:
        raise CheckpointError(
            f"checkpoint {path} lacks tensors {sorted(missing)[:3]}: it belongs to another model"
        )
    for init in model.proto.graph.initializer:
        if init.name in carried.weights:
            have = carried.weights[init.name]
            want = (tuple(init.dims), helper.tensor_dtype_to_np_dtype(init.data_type))
            if (have.shape, have.dtype) != want:
                raise CheckpointError(
                    f"checkpoint {path} holds {init.name!r} as {have.dtype} "
                    f"{list(have.shape)}, the model needs {want[1]} {list(want[0])}: it is "
                    "corrupt or of another model; delete the run directory to start over"
                )
    return carried, epoch


# ---- the summary ------------------------------------------------------------------------------


def summarize(
    out: Path,
    records: Sequence[dict],
    *,
    strategy: str,
    rho: float,
    profile,
    inference_acc: float,
    trained_model: Path,
    deadline_s: float | None = None,
    elapsed_s: float = float("nan"),
    head_lr_scale: float = 1.0,
    run_rho: float | None = None,
) -> TrainResult:
    """The :class:`TrainResult` of a finished run from its epoch records.

    Args:
        out: run directory (reported as given).
        records: all epoch records (:class:`EpochRecord` dicts), in order.
        strategy, rho: the run's strategy and requested rho (the summary's is the
            steps-weighted mean of the epochs' ``rho_requested``, which deadline mode chooses).
        profile: the run's :class:`etgraph.profile.Profile` (``t_full_us``: the time model's
            full step, for ``rho_predicted``). Speed figures are the loop's own measurements:
            elastic and full steps measured alike (``median_step_us``, ``reference_step_us``).
        inference_acc: validation accuracy of the exported model, in [0, 1].
        trained_model: path of the exported model.
        deadline_s, elapsed_s: deadline mode's deadline (None without) and the run's time
            from its start, s.
        run_rho: rho of the whole run (``TrainConfig.rho_scope == "run"``), else None.
        head_lr_scale: the run's head learning-rate factor (``--head-lr-scale``).
    """
    wall = sum(r["wall_time_s"] for r in records)
    later = [r for r in records if r["period"] > 0]
    later_wall = sum(r["wall_time_s"] for r in later)
    first_selection = sum(r["reselection_s"] for r in records if r["period"] == 0)
    weights = np.array([r["steps"] for r in records], dtype=np.float64)
    measured = np.array([r["median_step_us"] for r in records], dtype=np.float64)
    reference = np.array([r["reference_step_us"] for r in records], dtype=np.float64)
    predicted = np.array([r["predicted_step_us"] for r in records], dtype=np.float64)
    ok = np.isfinite(measured) & np.isfinite(reference)
    # The median over epochs: a short epoch times one reference step, and one step a burst of
    # load delays (seen: 26.9 ms against 5.6-6.3 in the other epochs) must not set the figure.
    full_step = float(np.median(reference[ok])) if ok.any() else np.nan
    full_time = full_step * float(weights.sum()) * 1e-6
    reference_s = sum(r["reference_s"] for r in records)
    rss: dict[int, float] = {}
    for r in records:
        rss[r["period"]] = max(rss.get(r["period"], 0.0), r["peak_rss_mb"])
    last = records[-1] if records else {}
    # the epoch that chose the options trained last: probed (step times) or not (the reason)
    chose = next(
        (r for r in reversed(records) if r.get("ort_note") or r.get("ort_probe_step_ms")), {}
    )
    return TrainResult(
        out_dir=str(out),
        strategy=strategy,
        epochs=len(records),
        final_val_acc=float(last.get("val_acc", float("nan"))),
        final_val_loss=float(last.get("val_loss", float("nan"))),
        inference_val_acc=float(inference_acc),
        wall_time_s=float(wall),
        full_time_s=full_time,
        speedup=full_time / wall if wall > 0 else float("nan"),
        rho_requested=float(
            np.average([r.get("rho_requested", rho) for r in records], weights=weights)
        )
        if records
        else rho,
        rho_predicted=float(np.average(predicted, weights=weights) / profile.t_full_us),
        rho_achieved=_median_ratio(records, "median_step_us", "reference_step_us"),
        rho_achieved_cpu=_median_ratio(records, "median_step_cpu_us", "reference_step_cpu_us"),
        full_step_us=full_step,
        reference_overhead_pct=100.0 * reference_s / wall if wall > 0 else 0.0,
        deadline_s=deadline_s,
        elapsed_s=float(elapsed_s),
        first_selection_s=float(first_selection),
        reselection_overhead_pct=float(
            100.0 * sum(r["reselection_s"] for r in later) / later_wall if later_wall > 0 else 0.0
        ),
        peak_rss_mb_first_period=float(rss[min(rss)]) if rss else float("nan"),
        peak_rss_mb_last_period=float(rss[max(rss)]) if rss else float("nan"),
        trained_model=str(trained_model),
        ort_config=str(last.get("ort_config", "off")),
        ort_probe_s=float(sum(r.get("ort_probe_s", 0.0) for r in records)),
        ort_probe_step_ms=chose.get("ort_probe_step_ms"),
        ort_note=chose.get("ort_note", ""),
        head_lr_scale=float(head_lr_scale),
        run_rho=run_rho,
    )


def _median_ratio(records: Sequence[dict], numerator: str, denominator: str) -> float:
    """Median over the epochs that have both of the per-epoch ratio of two times measured
    alike (NaN if none; records without the fields count as missing)."""
    num = np.array([r.get(numerator, np.nan) for r in records], dtype=np.float64)
    den = np.array([r.get(denominator, np.nan) for r in records], dtype=np.float64)
    ok = np.isfinite(num) & np.isfinite(den) & (den > 0)
    return float(np.median(num[ok] / den[ok])) if ok.any() else float("nan")


def write_summary(out: Path, result: TrainResult) -> Path:
    """Write ``summary.json`` (the fields of ``result``), atomically."""
    return files.write_json_atomic(out / SUMMARY_FILE, asdict(result))


def _speed_lines(result: TrainResult) -> list[str]:
    """The summary's speed lines: full training measured alike and the rho achieved; none for
    full training itself (it is its own reference)."""
    if result.strategy == "full":
        return [f"full step           {result.full_step_us / 1e3:.2f} ms (median)"]
    if not math.isfinite(result.full_time_s):
        return [
            "full training       not measured: a run under --memory-mb takes no full "
            "reference steps, so no speedup or achieved rho (compare with a run of "
            "--strategy full)"
        ]
    return [
        f"full training       {result.full_time_s:.1f} s  -> speedup {result.speedup:.2f}x  (full "
        f"step {result.full_step_us / 1e3:.2f} ms measured alike in the loop, "
        f"{result.reference_overhead_pct:.2f} % of the wall time)",
        f"rho                 requested {result.rho_requested:.2f}  predicted "
        f"{result.rho_predicted:.2f}  achieved {result.rho_achieved:.2f} (wall), "
        f"{result.rho_achieved_cpu:.2f} (CPU time)",
    ]


def format_summary(result: TrainResult) -> str:
    """One screen of text summarising ``result`` for the CLI."""
    if math.isnan(result.final_val_acc):  # regression (--loss mse): the loss is the metric
        metric = [f"val loss (MSE)      {result.final_val_loss:.4f}"]
    else:
        metric = [
            f"val accuracy        {100 * result.final_val_acc:.2f} %   "
            f"(exported model: {100 * result.inference_val_acc:.2f} %)",
            f"val loss            {result.final_val_loss:.4f}",
        ]
    scale = result.head_lr_scale
    head = f", the head at {scale:g}x the lr" if scale != 1 else ""
    lines = [
        f"strategy            {result.strategy}  ({result.epochs} epochs{head})",
        *metric,
        f"wall time           {result.wall_time_s:.1f} s  (training, validation excluded)",
        *_speed_lines(result),
        f"sessions            spinning {result.ort_config}"
        + (
            f"  (probed in {result.ort_probe_s:.2f} s, full step "
            + ", ".join(f"{k} {v:.2f} ms" for k, v in result.ort_probe_step_ms.items())
            + ")"
            if result.ort_probe_step_ms
            else f"  ({result.ort_note})"
            if result.ort_note
            else ""
        ),
        f"selection           first {result.first_selection_s:.2f} s, re-selections "
        f"{result.reselection_overhead_pct:.2f} % of their periods' wall time",
        f"peak RSS            first period {result.peak_rss_mb_first_period:.0f} MiB, last "
        f"{result.peak_rss_mb_last_period:.0f} MiB",
        f"trained model       {result.trained_model}",
    ]
    if result.run_rho is not None:
        lines.insert(
            4,
            f"rho of the run      {result.run_rho:.2f} of full training's time requested: each "
            "period's step rho planned from the run's progress (below, steps)",
        )
    if result.deadline_s is not None:
        error = 100.0 * (result.elapsed_s / result.deadline_s - 1.0)
        lines.insert(
            4,
            f"deadline            {result.deadline_s:.1f} s, finished after "
            f"{result.elapsed_s:.1f} s ({error:+.1f} %)",
        )
    return "\n".join(lines)
