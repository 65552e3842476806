"""The trained inference model a run hands back: the user's own interface with the trained
weights (what ``model_trained.onnx`` is).

:func:`export_trained` streams a selection's eval graph with a checkpoint's weights
(:func:`etgraph.artifact_weights.export_inference_model`: no session, the weights held once),
gives it the symbolic batch back, the head's learning-rate scale folded back (``--head-lr-scale``:
no ``Mul``, the head's weights in the original parametrisation) and the head legalisation took
off (:func:`etgraph.onnx_io.restore_exported`), the original model's other outputs when one of
several was trained, and the class names; written under a hidden name and renamed into place
complete.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import onnx

from .artifact_weights import export_inference_model
from .errors import ModelError
from .files import temporary_prefix
from .labels import set_class_names, stamp_onnx
from .model import LoadedModel
from .onnx_io import export_with_original_outputs, original_outputs, restore_exported

log = logging.getLogger(__name__)

__all__ = ["export_trained"]


def export_trained(
    model: LoadedModel,
    eval_model: str | os.PathLike,
    checkpoint: str | os.PathLike,
    path: Path,
    class_names: Sequence[str] = (),
) -> Path:
    """Write the inference model of ``model`` with the weights of ``checkpoint`` to ``path``.

    Args:
        model: the loaded model the run trained (its head, head learning-rate scale, output
            and original outputs).
        eval_model: the eval graph of a selection's artifacts (any selection: every weight is
            read from the checkpoint).
        checkpoint: an ORT checkpoint holding every parameter.
        path: the ONNX file to write (atomically: a kill leaves the previous file or none).
        class_names: output index -> label, stored in ``metadata_props``.

    Returns:
        ``path``.

    Raises:
        CheckpointError: the checkpoint cannot be read.
    """
    partial = path.with_name(f"{temporary_prefix(path.name)}partial")  # hidden until done
    labelled = onnx.ModelProto()
    if class_names:  # a prediction reads back as a label (metadata_props)
        set_class_names(labelled, list(class_names))
    metadata = {p.key: p.value for p in labelled.metadata_props}
    export_inference_model(eval_model, checkpoint, partial, [model.output_name], metadata)
    # the artifacts' batch size was fixed; the original parametrisation and output meaning
    restore_exported(partial, model.head, model.head_lr)
    if _with_original_outputs(model, partial) and class_names:
        stamp_onnx(partial, list(class_names))  # the original's file had none
    os.replace(partial, path)  # a user never picks up a half-made model
    return path


def _with_original_outputs(model: LoadedModel, trained: Path) -> bool:
    """When one of several outputs was trained (``--output``): the exported model becomes the
    original model (all its outputs) with the trained weights, if the original file is still
    there and holds its weights as initializers; else it keeps the trained output only
    (logged). Returns whether the file was rewritten from the original."""
    recorded = original_outputs(model.proto)
    if recorded is None:
        return False
    names, source = recorded
    try:
        export_with_original_outputs(trained, source, set(model.names) | set(model.running_stats))
    except ModelError as exc:
        log.warning("%s; %s has the trained output %r only", exc, trained, model.output_name)
        return False
    log.info("exported %s with the original outputs %s", trained, names)
    return True
