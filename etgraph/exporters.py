"""Who wrote a model, and what to tell its user about fixing it at the source (issue 27).

A refusal says what is wrong and what to do; what to do depends on where the model came from.
A torch user re-exports with other settings; a Keras user converts again with tf2onnx; a
scikit-learn user picks another estimator; a model shipped inside a Python package cannot be
re-exported at all, so the message says what etgraph would need instead. The exporter is read
from the model's ``producer_name`` (``pytorch``, ``tf2onnx``, ``paddle2onnx``, ``skl2onnx``,
...), the package from the model's path (``site-packages``).

:func:`remedy` is the one place messages take their "what to do" ending from.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["EXPORTERS", "exporter_of", "package_of", "remedy"]

#: ``producer_name`` prefix -> (exporter, the framework the user fixes the model in).
EXPORTERS: dict[str, tuple[str, str]] = {
    "pytorch": ("torch", "PyTorch"),
    "tf2onnx": ("tf2onnx", "TensorFlow/Keras (or JAX through jax2tf)"),
    "keras2onnx": ("tf2onnx", "Keras"),
    "paddle2onnx": ("paddle2onnx", "PaddlePaddle"),
    "skl2onnx": ("skl2onnx", "scikit-learn"),
    "onnxmltools": ("onnxmltools", "the source framework"),
}


def exporter_of(producer_name: str | None) -> str:
    """The exporter that wrote a model: a key of the :data:`EXPORTERS` values (``"torch"``,
    ``"tf2onnx"``, ``"paddle2onnx"``, ``"skl2onnx"``, ``"onnxmltools"``), or ``""`` when the
    ``producer_name`` names none of them."""
    name = (producer_name or "").strip().lower()
    for prefix, (exporter, _) in EXPORTERS.items():
        if name.startswith(prefix):
            return exporter
    return ""


def package_of(source: str | os.PathLike | None) -> str | None:
    """The installed Python package a model file ships in (the folder under ``site-packages``
    or ``dist-packages``, e.g. ``"paddleocr"``), or None."""
    if source is None:
        return None
    parts = Path(str(source)).parts
    for i, part in enumerate(parts[:-1]):
        if part in ("site-packages", "dist-packages") and i + 2 < len(parts):
            return parts[i + 1]
    return None


def remedy(
    what: str,
    *,
    producer_name: str | None,
    source: str | os.PathLike | None = None,
    torch: str | None = None,
    needed: str | None = None,
) -> str:
    """The "what to do" ending of a refusal, for the model's origin.

    Args:
        what: the change, said for any exporter (e.g. "replace it by MaxPool").
        producer_name: the model's ``producer_name``.
        source: the model's path (a model in ``site-packages`` cannot be re-exported).
        torch: a torch-specific way to make the change (e.g. ``"use .flatten(1)"``), said only
            for models torch exported.
        needed: what etgraph would need to train the model as it is (for a model shipped in a
            package); default: "a rewrite of it".

    Returns:
        E.g. ``"replace it by MaxPool (torch: ...) and re-export"``, ``"replace it by MaxPool
        in the Keras model and convert it again with tf2onnx"``, or ``"the model ships in
        package X and cannot be re-exported: etgraph would need ..."``.
    """
    package = package_of(source)
    if package is not None:
        return (
            f"the model ships in the package {package!r} and cannot be re-exported: etgraph "
            f"would need {needed or 'a rewrite of it'} to train it"
        )
    exporter = exporter_of(producer_name)
    if exporter == "torch":
        return f"{what} ({torch}) and re-export" if torch else f"{what} and re-export"
    if exporter in ("tf2onnx", "paddle2onnx", "skl2onnx", "onnxmltools"):
        framework = next(f for e, f in EXPORTERS.values() if e == exporter)
        return f"{what} in the {framework} model and convert it again with {exporter}"
    return f"{what} and re-export"
