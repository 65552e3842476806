"""ORT training checkpoints: read and write the flatbuffer format of onnxruntime-training 1.19.2.

A re-selection (paper §4, "elastic" selection every period) starts a new ORT session whose
trainable set differs from the last one. What survives is a :class:`CarriedState`: every weight
(trainable tensors, frozen tensors, BatchNorm running statistics), the AdamW moments of the
tensors that were trainable, and the AdamW step count. ORT 1.19.2 has no Python API for optimizer
moments but loads them from a checkpoint, so this module reads and writes the checkpoint itself,
with the flatbuffer bindings shipped in the wheel (``onnxruntime/tools/ort_format_model/
ort_flatbuffers_py``; file identifier ``ODTC``, version 2, one optimizer group ``group0``).

* :func:`read_checkpoint` — state, trainable names and string properties of a checkpoint
  (``CheckpointState.save_checkpoint``'s or :func:`write_checkpoint`'s).
* :func:`write_checkpoint` — a checkpoint that starts a session for a new selection: newly
  trainable tensors get zero moments (ORT requires an entry for every trainable parameter).
* :func:`checkpoint_target` / :func:`verify_checkpoint` — a checkpoint written with its sha256
  recorded beside it (``<name>.sha256``) and the previous version kept (``<name>.prev``);
  checked before a run resumes from it, falling back to the previous one if it is damaged.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import shutil
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import flatbuffers
import numpy as np
import onnx
from onnx import helper
from onnxruntime.tools.ort_format_model.ort_flatbuffers_py import fbs

from .errors import CheckpointError, ConfigError
from .files import atomic_target, temporary_prefix, write_atomic, write_json_atomic, write_parts

log = logging.getLogger(__name__)

__all__ = [
    "DIGEST_SUFFIX",
    "MOMENT_NAMES",
    "PREVIOUS_SUFFIX",
    "CarriedState",
    "checkpoint_bytes",
    "checkpoint_target",
    "read_checkpoint",
    "verify_checkpoint",
    "write_checkpoint",
]

#: ``<checkpoint><DIGEST_SUFFIX>``: JSON ``{"sha256": [the checkpoint's, the previous one's]}``.
DIGEST_SUFFIX = ".sha256"
#: ``<checkpoint><PREVIOUS_SUFFIX>``: the version before the last save (a hard link).
PREVIOUS_SUFFIX = ".prev"

#: Names of the AdamW moments ORT stores per trainable parameter (first, second moment).
MOMENT_NAMES = ("momentum0", "momentum1")


@dataclass
class CarriedState:
    """Everything that survives a re-selection.

    Attributes:
        weights: name -> array for every parameter of the session: trainable tensors (selected
            or not) and BatchNorm running statistics.
        moments: name -> {"momentum0": m, "momentum1": v} for the tensors that were trainable
            in the session the state came from (AdamW first/second moments, tensor shape).
        step: AdamW step count (shared by all tensors: ORT has one optimizer group).
    """

    weights: dict[str, np.ndarray]
    moments: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    step: int = 0

    def updated(
        self,
        weights: Mapping[str, np.ndarray],
        model: onnx.ModelProto,
        *,
        reset_moments: bool = False,
    ) -> CarriedState:
        """This state with ``weights`` (initializer name -> array) in place of its own, checked
        against ``model``'s initializers; with ``reset_moments`` those tensors' AdamW moments
        are dropped (they restart from zero). Modifies and returns this state.

        Raises:
            ConfigError: a name that is not one of the state's weights, or an array of another
                shape or dtype than the initializer's.
        """
        specs = {i.name: i for i in model.graph.initializer}
        for name, value in weights.items():
            if name not in self.weights or name not in specs:
                raise ConfigError(f"{name!r} is not a parameter of the model: use get_weights()'s")
            value = np.asarray(value)
            dims = tuple(specs[name].dims)
            dtype = helper.tensor_dtype_to_np_dtype(specs[name].data_type)
            if value.shape != dims or value.dtype != dtype:
                raise ConfigError(
                    f"{name!r} is {dtype} {list(dims)}; got {value.dtype} {list(value.shape)}"
                )
            self.weights[name] = np.array(value, copy=True)
            if reset_moments:
                self.moments.pop(name, None)
        return self

    @property
    def optimizer_state(self) -> bool:
        """Whether the state holds AdamW moments or a step count. Without them a checkpoint
        needs no optimizer group (:func:`write_checkpoint` ``optimizer_state=False``): ORT's
        ``Optimizer`` then starts from zero moments at step 0 itself, and the file is a third
        of the size when every tensor trains (a run's first selection on ResNet50 128 px:
        94 MB, not 261 MB; the same weights after 3 steps, bit for bit)."""
        return bool(self.moments) or self.step > 0


def _mapped(path: Path) -> mmap.mmap | bytes:
    """The file mapped read-only (the mapping lives as long as views into it); an empty file's
    bytes (it cannot be mapped)."""
    with path.open("rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def _tensor_to_array(t, copy: bool = True) -> np.ndarray:
    dtype = helper.tensor_dtype_to_np_dtype(t.DataType())
    dims = tuple(int(d) for d in t.DimsAsNumpy()) if t.DimsLength() else ()
    raw = t.RawDataAsNumpy() if t.RawDataLength() else np.zeros(0, np.uint8)
    if not copy:  # a read-only view into the file's buffer (possibly unaligned)
        return np.frombuffer(raw, dtype=dtype).reshape(dims)
    return np.frombuffer(raw.tobytes(), dtype=dtype).reshape(dims)


def read_checkpoint(
    path: str | os.PathLike, *, copy: bool = True, moments: bool = True
) -> tuple[CarriedState, list[str], dict[str, str]]:
    """Read an ORT training checkpoint (flatbuffer ``ODTC``, as saved by ORT 1.19.2).

    Args:
        path: checkpoint file (``CheckpointState.save_checkpoint`` or :func:`write_checkpoint`).
        copy: False: the arrays are read-only views into the file mapped into memory (memory:
            only the pages read become resident, once, instead of the whole file and the
            arrays while reading — what a checkpoint rewrite under a memory budget needs,
            :func:`write_checkpoint` copies them out; skipped moments are never read).
        moments: False: the optimizer moments are not read (``state.moments`` empty; the step
            is read).

    Returns:
        ``(state, requires_grad, properties)``: the carried state (weights of all parameters,
        moments if the checkpoint holds optimizer state, step), the names of the trainable
        parameters, and the string properties.

    Raises:
        CheckpointError: the file is missing, truncated, or not an ORT checkpoint.
    """
    path, with_moments = Path(path), moments
    try:
        buf = path.read_bytes() if copy else _mapped(path)
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror}") from exc
    if len(buf) < 8 or buf[4:8] != b"ODTC":
        raise CheckpointError(f"{path} is not an onnxruntime training checkpoint (bad header)")
    try:
        ck = fbs.Checkpoint.Checkpoint.GetRootAs(buf, 0)
        ms = ck.ModuleState()
        weights: dict[str, np.ndarray] = {}
        requires_grad = []
        for j in range(ms.RequiresGradParamsLength()):
            t = ms.RequiresGradParams(j)
            name = t.Name().decode()
            weights[name] = _tensor_to_array(t, copy)
            requires_grad.append(name)
        for j in range(ms.FrozenParamsLength()):
            t = ms.FrozenParams(j)
            weights[t.Name().decode()] = _tensor_to_array(t, copy)
        moments: dict[str, dict[str, np.ndarray]] = {}
        step = 0
        for g in range(ck.OptimizerGroupsLength()):
            group = ck.OptimizerGroups(g)
            step = int(group.Step())
            for s in range(group.OptimizerStatesLength() if with_moments else 0):
                ps = group.OptimizerStates(s)
                moments[ps.ParamName().decode()] = {
                    ps.Momentums(k).Name().decode(): _tensor_to_array(ps.Momentums(k), copy)
                    for k in range(ps.MomentumsLength())
                }
        properties = {}
        bag = ck.PropertyBag()
        if bag is not None:
            for j in range(bag.StringsLength()):
                sp = bag.Strings(j)
                properties[sp.Name().decode()] = sp.Value().decode()
    except Exception as exc:  # flatbuffers raises IndexError/struct.error on corrupt data
        raise CheckpointError(
            f"checkpoint {path} is corrupt ({type(exc).__name__}): delete it to start over"
        ) from exc
    return CarriedState(weights, moments, step), requires_grad, properties


class _Builder(flatbuffers.Builder):
    """A Builder that also keeps the tensors whose bytes are written later (:func:`_builder`)."""

    __slots__ = ("deferred",)


def _builder(size: int) -> _Builder:
    """A flatbuffers Builder of ``size`` bytes on an anonymous mapping: its pages are
    allocated as the (back-to-front) building reaches them, not zero-filled up front as the
    Builder's own bytearray is (ResNet50, 190 MB: 1.9 of the 7.9 s a checkpoint took on the
    loaded 2-core machine). Growing past ``size`` falls back to the Builder's bytearray.

    The tensors' bytes are not copied in: :func:`_raw_vector` reserves their place and records
    it in ``builder.deferred``, and :func:`_file_parts` writes them to the file straight from
    the arrays, so the pages of those places are never touched."""
    b = _Builder(0)
    b.Bytes = mmap.mmap(-1, size)
    b.head = size
    b.deferred = []  # (distance of the place from the buffer's end, array)
    return b


def _raw_vector(builder, array: np.ndarray, zeros: bool = False) -> int:
    """A ``[ubyte]`` vector of ``array``'s bytes (C order, native little-endian), its place
    reserved and recorded in ``builder.deferred`` (:func:`_builder`), not copied: the file is
    written from the array's own memory (:func:`_file_parts`). ``zeros``: as many zero bytes,
    neither written nor recorded (the buffer is zero where the builder has not written: its
    mapping, or the zero-filled bytearray it grows into)."""
    n = array.nbytes
    builder.StartVector(1, n, 1)
    builder.head = builder.head - n
    if not zeros:  # its distance from the end survives the builder growing (it grows in front)
        builder.deferred.append((len(builder.Bytes) - builder.head, np.ascontiguousarray(array)))
    builder.vectorNumElems = n
    return builder.EndVector()


def _file_parts(builder) -> list[memoryview]:
    """The finished buffer of ``builder`` as the parts a file is written from, in order: the
    builder's own bytes between the tensors, and each tensor recorded in ``builder.deferred``
    as a view of its array (no copy of a tensor)."""
    buffer = memoryview(builder.Bytes)
    parts, cursor = [], builder.Head()
    for start, array in sorted((len(buffer) - d, a) for d, a in builder.deferred):
        parts.append(buffer[cursor:start])
        parts.append(memoryview(array).cast("B"))
        cursor = start + array.nbytes
    parts.append(buffer[cursor:])
    return [p for p in parts if p.nbytes]


def _fb_tensor(builder, name: str, array: np.ndarray, zeros: bool = False) -> int:
    """A Tensor of ``array`` (``zeros``: of its shape and dtype, all zero, :func:`_raw_vector`)."""
    name_off = builder.CreateString(name)
    dims_off = builder.CreateNumpyVector(np.asarray(np.shape(array), dtype=np.int64))
    raw_off = _raw_vector(builder, array, zeros)
    fbs.Tensor.Start(builder)
    fbs.Tensor.AddName(builder, name_off)
    fbs.Tensor.AddDims(builder, dims_off)
    fbs.Tensor.AddDataType(builder, helper.np_dtype_to_tensor_dtype(array.dtype))
    fbs.Tensor.AddRawData(builder, raw_off)
    return fbs.Tensor.End(builder)


def _fb_vector(builder, start, offsets: list[int]) -> int:
    start(builder, len(offsets))
    for off in reversed(offsets):
        builder.PrependUOffsetTRelative(off)
    return builder.EndVector()


def _fb_module_state(builder, weights: Mapping[str, np.ndarray], trainable: set[str]) -> int:
    """The ModuleState: every weight, those in ``trainable`` as trainable, the rest frozen."""
    train_offs, frozen_offs = [], []
    for name in sorted(weights):
        off = _fb_tensor(builder, name, weights[name])
        (train_offs if name in trainable else frozen_offs).append(off)
    train_vec = _fb_vector(builder, fbs.ModuleState.StartRequiresGradParamsVector, train_offs)
    frozen_vec = _fb_vector(builder, fbs.ModuleState.StartFrozenParamsVector, frozen_offs)
    fbs.ModuleState.Start(builder)
    fbs.ModuleState.AddRequiresGradParams(builder, train_vec)
    fbs.ModuleState.AddFrozenParams(builder, frozen_vec)
    fbs.ModuleState.AddIsNominalState(builder, False)
    fbs.ModuleState.AddHasExternalData(builder, False)
    return fbs.ModuleState.End(builder)


def _fb_parameter_moments(
    builder, name: str, weight: np.ndarray, carried: Mapping[str, np.ndarray]
) -> int:
    """The ParameterOptimizerState of tensor ``name``: its ``carried`` moments, zeros for a
    missing one (a newly trained tensor; never materialised).

    Raises:
        ConfigError: a carried moment's shape differs from the weight's.
    """
    moment_offs = []
    for moment in MOMENT_NAMES:
        value = carried.get(moment)
        if value is None:
            moment_offs.append(_fb_tensor(builder, moment, np.asarray(weight), zeros=True))
            continue
        if value.shape != weight.shape:
            raise ConfigError(f"moment {moment} of {name!r} has shape {value.shape}")
        moment_offs.append(_fb_tensor(builder, moment, value))
    moments_vec = _fb_vector(builder, fbs.ParameterOptimizerState.StartMomentumsVector, moment_offs)
    name_off = builder.CreateString(name)
    fbs.ParameterOptimizerState.Start(builder)
    fbs.ParameterOptimizerState.AddParamName(builder, name_off)
    fbs.ParameterOptimizerState.AddMomentums(builder, moments_vec)
    return fbs.ParameterOptimizerState.End(builder)


def _fb_optimizer_groups(
    builder, state: CarriedState, trainable: Sequence[str], initial_learning_rate: float
) -> int:
    """The optimizer groups vector: one group ``group0`` with ``state.step`` and the moments of
    every ``trainable`` tensor (:func:`_fb_parameter_moments`)."""
    param_offs = [
        _fb_parameter_moments(builder, name, state.weights[name], state.moments.get(name, {}))
        for name in trainable
    ]
    states_vec = _fb_vector(builder, fbs.OptimizerGroup.StartOptimizerStatesVector, param_offs)
    group_name = builder.CreateString("group0")
    fbs.OptimizerGroup.Start(builder)
    fbs.OptimizerGroup.AddGroupName(builder, group_name)
    fbs.OptimizerGroup.AddStep(builder, int(state.step))
    fbs.OptimizerGroup.AddInitialLearningRate(builder, float(initial_learning_rate))
    fbs.OptimizerGroup.AddOptimizerStates(builder, states_vec)
    group_off = fbs.OptimizerGroup.End(builder)
    return _fb_vector(builder, fbs.Checkpoint.StartOptimizerGroupsVector, [group_off])


def _fb_property_bag(builder, properties: Mapping[str, str]) -> int:
    """A PropertyBag of string ``properties`` (sorted by key)."""
    prop_offs = []
    for key, value in sorted(properties.items()):
        k_off, v_off = builder.CreateString(key), builder.CreateString(value)
        fbs.StringProperty.Start(builder)
        fbs.StringProperty.AddName(builder, k_off)
        fbs.StringProperty.AddValue(builder, v_off)
        prop_offs.append(fbs.StringProperty.End(builder))
    strings_vec = _fb_vector(builder, fbs.PropertyBag.StartStringsVector, prop_offs)
    fbs.PropertyBag.Start(builder)
    fbs.PropertyBag.AddStrings(builder, strings_vec)
    return fbs.PropertyBag.End(builder)


def checkpoint_bytes(
    weights: Mapping[str, np.ndarray], requires_grad: Collection[str], *, optimizer_state=True
) -> int:
    """An upper bound (bytes) of the size of the checkpoint :func:`write_checkpoint` writes
    for ``weights`` with ``requires_grad`` trainable: every weight, two moments per trainable
    one with ``optimizer_state``, and room for the names and tables."""
    payload = sum(np.asarray(a).nbytes for a in weights.values())
    if optimizer_state:
        payload += 2 * sum(np.asarray(weights[n]).nbytes for n in requires_grad)
    return payload + 256 * (3 * len(weights) + 16) + (1 << 16)


def write_checkpoint(
    path: str | os.PathLike,
    state: CarriedState,
    requires_grad: Sequence[str],
    *,
    initial_learning_rate: float = 1e-4,
    properties: Mapping[str, str] | None = None,
    optimizer_state: bool = True,
    durable: bool = True,
) -> None:
    """Write an ORT training checkpoint that starts a session for a new selection.

    Every weight in ``state.weights`` is stored: the names in ``requires_grad`` as trainable,
    the rest as frozen. The optimizer state holds ``state.step`` and, for every trainable name,
    its moments from ``state.moments`` when present, zeros otherwise (ORT requires an entry for
    every trainable parameter). Written atomically (:func:`etgraph.files.write_atomic`).

    Args:
        path: destination file.
        state: weights (all parameters), moments, step.
        requires_grad: names of the parameters the new session trains (subset of weights).
        initial_learning_rate: stored in the optimizer group (the runtime sets lr each step).
        properties: string properties stored in the checkpoint.
        optimizer_state: False: no optimizer group (no step, no moments), like the checkpoint
            ``generate_artifacts`` writes: for a Module without Optimizer (gradients only), or
            artifacts whose Optimizer starts fresh.
        durable: written atomically and synced to disk (:func:`etgraph.files.write_atomic`);
            False: renamed into place without a sync, for a transient file a session is about to
            load (nothing is lost on a kill: the run resumes from its own checkpoint).

    Memory: the builder is sized for the whole file up front and the file is written from it,
    so the transient is one file's size (no growth copies, no ``tobytes``/``Output`` copies).

    Raises:
        ConfigError: a ``requires_grad`` name has no weight, or a moment's shape differs.
    """
    trainable = set(requires_grad)
    missing = trainable - set(state.weights)
    if missing:
        raise ConfigError(f"no weight for trainable tensors {sorted(missing)[:5]}")
    b = _builder(checkpoint_bytes(state.weights, trainable, optimizer_state=optimizer_state))
    module_off = _fb_module_state(b, state.weights, trainable)
    groups_vec = None
    if optimizer_state:
        groups_vec = _fb_optimizer_groups(b, state, sorted(trainable), initial_learning_rate)
    bag_off = _fb_property_bag(b, properties) if properties else None

    fbs.Checkpoint.Start(b)
    fbs.Checkpoint.AddVersion(b, 2)  # the version ORT 1.19.2 writes and reads
    fbs.Checkpoint.AddModuleState(b, module_off)
    if groups_vec is not None:
        fbs.Checkpoint.AddOptimizerGroups(b, groups_vec)
    if bag_off is not None:
        fbs.Checkpoint.AddPropertyBag(b, bag_off)
    b.Finish(fbs.Checkpoint.End(b), file_identifier=b"ODTC")
    parts = _file_parts(b)  # the tensors written from the arrays themselves
    if durable:
        write_atomic(path, parts)
    else:  # a new file renamed into place: a reader of the old one keeps it
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{temporary_prefix(path.name)}{os.getpid()}")
        write_parts(tmp, parts)
        os.replace(tmp, path)


# ---- integrity --------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _recorded(path: Path) -> list[str]:
    """The digests recorded for ``path`` (empty: none, or the record is unreadable)."""
    try:
        digests = json.loads(_sibling(path, DIGEST_SUFFIX).read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [d for d in digests if isinstance(d, str)] if isinstance(digests, list) else []


def _link_atomic(source: Path, destination: Path) -> None:
    """Make ``destination`` a hard link to ``source``, replacing it atomically."""
    with atomic_target(destination) as link:
        link.unlink()
        os.link(source, link)


@contextlib.contextmanager
def checkpoint_target(path: str | os.PathLike, *, durable: bool = True) -> Iterator[Path]:
    """:func:`etgraph.files.atomic_target` for a checkpoint: yield a temporary path to write it
    to; when the block completes, the current version (if any) is kept as
    ``<path>.prev`` (a hard link: no copy), the new one's sha256 is recorded in
    ``<path>.sha256`` together with the current one's, and the new file replaces ``path``.

    A kill at any point leaves a checkpoint and a ``.prev`` whose digests are recorded: the old
    pair until the record is written, which lists both the old and the new digest.

    ``durable=False`` is for a checkpoint nothing resumes from (a trainer's private work
    directory, removed when it closes): the new file still replaces ``path`` by a rename (a
    view mapped from the old file stays valid), with no fsync, digest or previous version."""
    path = Path(path)
    with atomic_target(path, fsync=durable) as tmp:
        yield tmp
        if not durable:
            return
        digest = _sha256(tmp)
        current = _recorded(path)[:1]
        if path.exists():
            try:
                _link_atomic(path, _sibling(path, PREVIOUS_SUFFIX))
            except OSError:  # no hard links on this file system: no previous version
                _sibling(path, PREVIOUS_SUFFIX).unlink(missing_ok=True)
                current = []
        write_json_atomic(_sibling(path, DIGEST_SUFFIX), {"sha256": [digest, *current]})


def verify_checkpoint(path: str | os.PathLike) -> bool:
    """Check the checkpoint ``path`` against the sha256 recorded when etgraph wrote it
    (:func:`checkpoint_target`). A damaged checkpoint is replaced by the previous version
    (``<path>.prev``) if that one is intact; a checkpoint without a record (written by an
    earlier etgraph) passes.

    Returns:
        False if it fell back to the previous version (logged as a warning), else True.

    Raises:
        CheckpointError: the checkpoint is damaged and no intact previous version is kept.
    """
    path = Path(path)
    recorded = _recorded(path)
    if not recorded or not path.exists() or _sha256(path) in recorded:
        return True
    prev = _sibling(path, PREVIOUS_SUFFIX)
    previous = _sha256(prev) if prev.is_file() else None
    if previous in recorded:
        log.warning(
            "checkpoint %s is damaged (its sha256 differs from the one recorded when it was "
            "written): continuing from the previous checkpoint (%s)",
            path,
            prev.name,
        )
        with atomic_target(path) as tmp:  # a copy: damage to one leaves the other
            shutil.copyfile(prev, tmp)
        write_json_atomic(_sibling(path, DIGEST_SUFFIX), {"sha256": [previous]})
        return False
    raise CheckpointError(
        f"checkpoint {path} is damaged: its sha256 differs from the one recorded when etgraph "
        "wrote it, and no intact previous checkpoint is kept; delete the run directory to "
        "start over"
    )
