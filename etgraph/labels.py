"""Class names: the one mapping from the data's labels to the head's output indices.

A classifier's output index ``k`` means ``class_names[k]``. The names come from the data —
string labels of a text file, sub-folder names of an image folder, the digits' own — and are
kept in three places so a prediction can always be read back as a label:

- the run directory (``classes.json``: :func:`save_class_names` / :func:`load_class_names`);
- the exported inference model's ``metadata_props`` under :data:`METADATA_KEY` as a JSON list
  (:func:`stamp_onnx` / :func:`read_onnx_class_names`);
- in memory, the dataset's ``class_names``.

Mapping rules (:func:`map_labels`): string labels take indices in sorted order (as image
folders do); labels that are all non-negative integers (``3``, or ``3.0`` as a float column
writes it) are the indices themselves (names ``"0" .. "K-1"``); an existing mapping (e.g. the
one saved with a run being resumed) is used as is and every label must be one of its names;
the class names of a model etgraph trained (its metadata) are that mapping when every label is
one of them (:func:`known_class_names`). Labels the head cannot output are a
:class:`~etgraph.errors.DataError` naming the label and the fix.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import onnx

from .errors import DataError
from .files import atomic_target, write_json_atomic

#: ``metadata_props`` key of the class names (JSON list, index k = output k).
METADATA_KEY = "etgraph.class_names"
#: File name of the mapping in a run directory.
CLASSES_FILE = "classes.json"
#: The largest integer label taken as a class index (a head wider than this is not a
#: classifier etgraph trains; larger labels are refused rather than allocated for).
MAX_CLASS_INDEX = 1_000_000


#: A class index as text: digits, maybe with a zero fraction (``"3.0"``: a JSON number or a
#: pandas column of floats, which is the index 3 as ``"3"`` is).
_INDEX = re.compile(r"[0-9]+(\.0*)?")


def _is_index(label: str) -> bool:
    return _INDEX.fullmatch(label) is not None


def map_labels(
    raw: Sequence[str],
    *,
    num_classes: int | None = None,
    class_names: Sequence[str] | None = None,
    source: str = "data",
    known: Sequence[str] = (),
) -> tuple[list[str], np.ndarray]:
    """Map raw labels to output indices.

    Args:
        raw: one label per example, as text (``"positive"``, ``"3"``).
        num_classes: the head's output width K (None: unknown, not checked).
        class_names: an existing mapping to use (index k = ``class_names[k]``); None derives one
            from ``raw``.
        source: what the labels come from, for error messages (a file name).
        known: the class names the model's head was trained with; used as ``class_names``
            when every label is one of them (:func:`known_class_names`).

    Returns:
        ``(class_names, labels)``: the names (length K when ``num_classes`` is given and the
        labels are indices or a mapping is given, else the sorted distinct labels) and int64
        ``[N]`` indices.

    Raises:
        DataError: no labels; a label not in ``class_names``; an integer label ``>= K``; more
            distinct string labels than K; ``class_names`` longer than K.
    """
    raw = [str(v) for v in raw]
    if not raw:
        raise DataError(f"{source} has no labelled examples: add rows with a 'label'")
    if class_names is None:
        class_names = known_class_names(raw, known)
    if class_names is not None:
        names = [str(v) for v in class_names]
        if num_classes is not None and len(names) > num_classes:
            raise DataError(
                f"{len(names)} class names but the model outputs {num_classes}: use the class "
                "names saved with this model or a model with a wider head"
            )
        index = {name: k for k, name in enumerate(names)}
        unknown = sorted({v for v in raw if v not in index})
        if unknown:
            raise DataError(
                f"{source}: label {unknown[0]!r} is not one of the model's classes {names[:10]}: "
                "relabel the data or train a new head"
            )
        return names, np.array([index[v] for v in raw], dtype=np.int64)
    if all(_is_index(v) for v in raw):
        values = [int(v.partition(".")[0]) for v in raw]
        top = max(values)
        if num_classes is not None and top >= num_classes:
            raise DataError(
                f"{source}: label {top} is outside the model's {num_classes} classes "
                f"(0..{num_classes - 1}): relabel the data or use a model with a wider head"
            )
        if top > MAX_CLASS_INDEX:
            raise DataError(
                f"{source}: label {top} is not a class index (the largest is "
                f"{MAX_CLASS_INDEX}): relabel the data with class indices or class names"
            )
        k = num_classes if num_classes is not None else top + 1
        return [str(i) for i in range(k)], np.array(values, dtype=np.int64)
    names = sorted(set(raw))
    if num_classes is not None and len(names) > num_classes:
        raise DataError(
            f"{source} has {len(names)} distinct labels but the model outputs {num_classes} "
            f"classes: use a model with a wider head or fewer labels (labels: {names[:10]})"
        )
    index = {name: k for k, name in enumerate(names)}
    return names, np.array([index[v] for v in raw], dtype=np.int64)


def known_class_names(labels: Iterable[str], model_names: Sequence[str]) -> list[str] | None:
    """The class names a model's head was trained with (``model_names``, index k = output k:
    :attr:`etgraph.io_specs.Task.class_names`) when every one of the data's ``labels`` is among
    them — the data is of a task the head knows, its labels keep the head's indices, even when
    some classes are absent — else None (a new task: the data's own mapping)."""
    names = [str(v) for v in model_names]
    if names and set(map(str, labels)) <= set(names):
        return names
    return None


def save_class_names(directory: str | os.PathLike, class_names: Sequence[str]) -> Path:
    """Write ``classes.json`` (``{"class_names": [...]}``) into ``directory`` atomically."""
    return write_json_atomic(
        Path(directory) / CLASSES_FILE, {"class_names": [str(v) for v in class_names]}
    )


def load_class_names(directory: str | os.PathLike) -> list[str] | None:
    """The class names saved in ``directory``, or None if it has no ``classes.json``.

    Raises:
        DataError: the file exists but is not a mapping written by :func:`save_class_names`.
    """
    path = Path(directory) / CLASSES_FILE
    if not path.is_file():
        return None
    try:
        names = json.loads(path.read_text())["class_names"]
    except (ValueError, KeyError, TypeError) as exc:
        raise DataError(
            f"{path} is not a class-name mapping ({exc}): delete or rewrite it"
        ) from exc
    if not isinstance(names, list):
        raise DataError(f"{path}: 'class_names' must be a list: delete or rewrite it")
    return [str(v) for v in names]


def stamp_onnx(path: str | os.PathLike, class_names: Sequence[str]) -> None:
    """Write the class names into the ONNX file's ``metadata_props`` (key
    :data:`METADATA_KEY`, JSON list), replacing an earlier entry; the file is rewritten
    atomically, its graph unchanged."""
    path = Path(path)
    model = onnx.load(str(path))
    set_class_names(model, class_names)
    with atomic_target(path) as tmp:
        onnx.save(model, str(tmp))
        os.chmod(tmp, 0o644)


def set_class_names(model: onnx.ModelProto, class_names: Sequence[str]) -> None:
    """Set :data:`METADATA_KEY` in ``model.metadata_props`` (in place)."""
    value = json.dumps([str(v) for v in class_names])
    for prop in model.metadata_props:
        if prop.key == METADATA_KEY:
            prop.value = value
            return
    model.metadata_props.add(key=METADATA_KEY, value=value)


def class_names_of(model: onnx.ModelProto) -> list[str] | None:
    """The class names in ``model.metadata_props``, or None if it has none (or an entry that
    is not a JSON list)."""
    for prop in model.metadata_props:
        if prop.key == METADATA_KEY:
            try:
                names = json.loads(prop.value)
            except ValueError:
                return None
            return [str(v) for v in names] if isinstance(names, list) else None
    return None


def read_onnx_class_names(path: str | os.PathLike) -> list[str] | None:
    """The class names stored in an ONNX file by :func:`stamp_onnx`, or None."""
    return class_names_of(onnx.load(str(path), load_external_data=False))
