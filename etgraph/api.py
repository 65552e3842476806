"""The entry points of etgraph's Python API that are not a class of their own: loading a model
and profiling it on this device (the compiler is :mod:`etgraph.pipeline`, training
:class:`etgraph.trainer.ElasticTrainer`). Everything ``import etgraph`` exports is listed in
``etgraph.__all__``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import onnx

from .data import DEFAULT_MODEL_PATH
from .errors import ConfigError
from .io_specs import LOSSES
from .model import LoadedModel
from .onnx_io import legalize_proto
from .profile import Profile, default_cache_dir

__all__ = ["load_model", "profile_model"]


def load_model(
    source: str | os.PathLike | onnx.ModelProto | None = None,
    *,
    output: str | None = None,
    loss: str = "ce",
    head_lr_scale: float | None = None,
) -> LoadedModel:
    """Load, check and legalise a model for training (paper §5's import step).

    Args:
        source: an ``.onnx`` file (its external data beside it), an ``onnx.ModelProto`` in
            memory (copied; not modified), or None for the embedded default model.
        output: the graph output to train on (None: the model's only output).
        loss: ``"ce"`` (cross-entropy on logits ``[B, K]``, labels int64 class indices) or
            ``"mse"`` (mean squared error on ``[B, D]``, float32 targets).
        head_lr_scale: train the head (the dense layer making the output) at this factor
            times the learning rate, exactly (:mod:`passes.onnx.head_lr`: its weights stored
            divided by it, its output multiplied by it; 10 is the measured useful value for a
            fresh head). None: as the model records (1 for a model etgraph did not compile).
            Train it with a :class:`etgraph.config.TrainConfig` of the same ``head_lr_scale``.

    Returns:
        The :class:`etgraph.model.LoadedModel`: the legalised proto, trainable tensors in
        forward order, inputs, task.

    Raises:
        ModelError: not a readable or valid ONNX model, or nothing to train.
        UnsupportedOpError: an op on the data path has no gradient in ORT 1.19.2 and no rewrite.
        ConfigError: several outputs and no ``output``, or an unknown ``loss``.
        HeadLrScaleError: ``head_lr_scale`` is not positive and finite, or the model's output
            is not made by a dense head (Gemm, MatMul [+ Add]) with initializer weights.
    """
    if loss not in LOSSES:
        raise ConfigError(f"unknown loss {loss!r}: choose one of {', '.join(LOSSES)}")
    if isinstance(source, onnx.ModelProto):
        name = "<in-memory model>"
        proto = legalize_proto(source, name, output, head_lr_scale)
        return LoadedModel.from_proto(proto, source=name, loss=loss)
    return LoadedModel.load(
        source if source is not None else DEFAULT_MODEL_PATH,
        output=output,
        loss=loss,
        head_lr_scale=head_lr_scale,
    )


def profile_model(
    model: LoadedModel,
    *,
    batch_size: int = 4,
    input_shape: Mapping[str, Sequence[int]] | Sequence[int] | Sequence[str] | None = None,
    level: str = "fast",
    threads: int | None = None,
    cache: bool = True,
) -> Profile:
    """Measure every tensor's backward times ``t_dw_us`` / ``t_dy_us`` and the forward time of
    ``model`` with ONNX Runtime on this device (paper §5, wall clock, µs).

    Args:
        model: from :func:`load_model`.
        batch_size: the training batch size (> 0): the sessions run at this static batch.
        input_shape: per-example shapes of the inputs where the model's are symbolic (a mapping
            name -> dims, ``(C, H, W)`` for one input, or ``--input-shape`` texts).
        level: ``"fast"`` or ``"thorough"`` (:data:`etgraph.profiler.LEVELS`).
        threads: ORT intra-op threads (None: physical cores).
        cache: read and write the profile cache (``$ETGRAPH_CACHE/profiles`` or
            ``~/.cache/etgraph/profiles``), keyed by model hash, shapes, batch, threads, loss.

    Returns:
        The :class:`etgraph.profile.Profile` (arrays float64 [N] in forward order, µs).

    Raises:
        ConfigError: a bad batch size, shape or level. ModelError: ORT cannot train the model.
    """
    from .profiler import profile_model as measure  # scipy's optimizer: only when profiling

    return measure(
        model,
        batch_size=batch_size,
        input_shapes=input_shape,
        level=level,
        threads=threads,
        cache_dir=default_cache_dir() if cache else None,
    )
