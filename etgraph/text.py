"""Labelled text for token models: a CSV/JSONL file tokenized with the model's tokenizer.json.

A text file has a ``text`` and a ``label`` column: a CSV with a header row (UTF-8, a BOM is
allowed), or JSON Lines with one object per line (``{"text": "...", "label": "sport"}``).
Each text is tokenized with the ``tokenizers`` library from the model's own ``tokenizer.json``
(``--tokenizer``), truncated and padded to the model's sequence length T, and turned into the
token inputs the model has, by name:

- ``input_ids``: token ids, int64 ``[N, T]``, padded with the tokenizer's pad id;
- ``attention_mask``: 1 for tokens, 0 for padding, int64 ``[N, T]``;
- ``token_type_ids``: segment ids (0 for a single text), int64 ``[N, T]``.

Labels map to the head's indices by :func:`etgraph.labels.map_labels` (strings in sorted
order, integers as themselves, or an existing mapping). :func:`etgraph.data.load_task_data`
turns the result into a dataset with a stratified train/validation split, as for images
(``--data FILE.csv --tokenizer tokenizer.json``).

Every problem with the inputs is a :class:`~etgraph.errors.DataError` with one line naming it
and the fix: a file without the columns, a row without a label, a tokenizer whose vocabulary
does not fit the model's embedding table, labels outside the head's classes, a model input that
is not a token input.
"""

from __future__ import annotations

import csv
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from .errors import DataError
from .labels import map_labels

log = logging.getLogger(__name__)

#: Suffixes read as text files (anything else is not text data).
TEXT_SUFFIXES = (".csv", ".jsonl")
#: The token inputs a text file can feed, by graph input name.
TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
#: Pad tokens tried, in order, when the tokenizer has no padding configured.
PAD_TOKENS = ("[PAD]", "<pad>", "<PAD>")
#: How many embedding rows beyond the tokenizer's vocabulary are accepted (tables padded to a
#: multiple of 64 or 128 are common); more means the tokenizer belongs to another model.
VOCAB_SLACK = 128


def is_text_file(spec: str | os.PathLike | None) -> bool:
    """Whether a ``--data`` value names a text file (by suffix: ``.csv`` or ``.jsonl``)."""
    return spec is not None and Path(spec).suffix.lower() in TEXT_SUFFIXES


def check_text_options(data: str | os.PathLike | None, tokenizer: str | os.PathLike | None) -> None:
    """Check ``--data`` and ``--tokenizer`` go together (cheap: before any profiling).

    Raises:
        DataError: text data without a tokenizer, a tokenizer without text data, or a text
            file or tokenizer that does not exist.
    """
    if not is_text_file(data):
        if tokenizer is not None:
            raise DataError(
                f"--tokenizer applies to text data (.csv or .jsonl), not {data or 'digits'}: "
                "drop --tokenizer or pass --data FILE.csv"
            )
        return
    if tokenizer is None:
        raise DataError(
            f"text data {data} needs the model's tokenizer: pass --tokenizer tokenizer.json"
        )
    if not Path(data).is_file():  # type: ignore[arg-type]
        raise DataError(f"text file {data} does not exist: give a .csv or .jsonl file")
    if not Path(tokenizer).is_file():
        raise DataError(f"tokenizer {tokenizer} does not exist: give the model's tokenizer.json")


@dataclass
class TextData:
    """Tokenized labelled text.

    Attributes:
        name: the file it was read from.
        inputs: graph input name -> int64 ``[N, T]`` (the model's token inputs, in its order).
        labels: int64 ``[N]`` in ``[0, len(class_names))``.
        class_names: label of each output index.
        texts: the raw texts, ``N`` strings.
    """

    name: str
    inputs: dict[str, np.ndarray]
    labels: np.ndarray
    class_names: list[str]
    texts: list[str]


def read_text_file(path: str | os.PathLike) -> tuple[list[str], list[str]]:
    """Read the ``text`` and ``label`` columns of a CSV (header row) or JSONL file.

    Returns:
        ``(texts, labels)``, both as strings, one per row (labels stripped of whitespace).

    Raises:
        DataError: the file is missing or unreadable, is not ``.csv``/``.jsonl``, lacks a
            column, has a row without a label, a JSON list or object for a text or label, a
            CSV row of more fields than its header (an unquoted comma) or a JSONL line that
            is not an object, or is empty.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"text file {path} does not exist: give a .csv or .jsonl file")
    suffix = path.suffix.lower()
    if suffix not in TEXT_SUFFIXES:
        raise DataError(f"{path}: text data must be a .csv or .jsonl file, got {suffix!r}")
    try:
        rows = _read_jsonl(path) if suffix == ".jsonl" else _read_csv(path)
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 text ({exc.reason}): save it as UTF-8") from exc
    texts, labels = [], []
    for line, row in rows:
        label = row.get("label")
        if label is None or str(label).strip() == "":
            raise DataError(f"{path}:{line}: the row has no label: give every row a 'label'")
        for column in ("text", "label"):  # JSON: str() would train on "['a', 'b']"
            if isinstance(row.get(column), (list, dict)):
                kind = "list" if isinstance(row[column], list) else "object"
                raise DataError(
                    f"{path}:{line}: the row's {column!r} is a JSON {kind}, not one "
                    f"{'text' if column == 'text' else 'label'}: give a string"
                )
        text = "" if row.get("text") is None else str(row["text"])
        for value in (text, str(label)):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:  # JSON's "\ud800": half of a surrogate pair
                raise DataError(
                    f"{path}:{line}: the row holds {value[exc.start : exc.end]!r}, half of a "
                    "UTF-16 surrogate pair, not a character: fix the escape or drop the row"
                ) from exc
        texts.append(text)
        labels.append(str(label).strip())
    if not texts:
        raise DataError(f"{path} has no rows: add rows with 'text' and 'label'")
    return texts, labels


def _missing_columns(path: Path, columns: Sequence[str]) -> DataError:
    return DataError(
        f"{path} has no {' and no '.join(repr(c) for c in ('text', 'label') if c not in columns)}"
        f" column (columns: {', '.join(map(str, columns)) or 'none'}): a text file needs "
        "'text' and 'label' columns"
    )


#: The longest CSV field read, in characters (the csv module's default is 128 KiB; a text
#: longer than that is legitimate, it is truncated to the model's sequence length).
CSV_FIELD_LIMIT = 2**31 - 1


def _read_csv(path: Path) -> list[tuple[int, dict]]:
    limit = csv.field_size_limit(CSV_FIELD_LIMIT)
    try:
        with path.open(encoding="utf-8-sig", newline="") as f:
            reader = csv.DictReader(f)
            try:
                columns = reader.fieldnames or []
                if "text" not in columns or "label" not in columns:
                    raise _missing_columns(path, columns)
                rows = []
                for row in reader:
                    if None in row:  # csv.DictReader's key of the fields beyond the header's
                        raise DataError(
                            f"{path}:{reader.line_num}: the row has {len(columns) + len(row[None])}"
                            f" fields, the header {len(columns)}: quote a text that holds "
                            'commas ("a, b")'
                        )
                    rows.append((reader.line_num, row))
                return rows
            except csv.Error as exc:
                raise DataError(
                    f"{path}:{reader.line_num}: not readable CSV ({exc}): save it as CSV with a "
                    "header row"
                ) from exc
    finally:
        csv.field_size_limit(limit)


def _read_jsonl(path: Path) -> list[tuple[int, dict]]:
    rows = []
    with path.open(encoding="utf-8-sig") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise DataError(f"{path}:{line_no}: not JSON ({exc}): one object per line") from exc
            if not isinstance(row, dict):
                raise DataError(f"{path}:{line_no}: not a JSON object: one object per line")
            if "text" not in row or "label" not in row:
                raise _missing_columns(path, list(row))
            rows.append((line_no, row))
    return rows


def load_tokenizer(path: str | os.PathLike, *, vocab_rows: int | None = None) -> Tokenizer:
    """Load a ``tokenizer.json`` and check it fits the model's embedding table.

    Args:
        path: the tokenizer file (``tokenizers`` JSON format, as ``transformers`` saves it).
        vocab_rows: rows of the model's word-embedding table (the ``input_ids`` input's
            :attr:`etgraph.io_specs.InputSpec.index_rows`); None skips the check.

    Raises:
        DataError: the file is missing or not a tokenizer; its vocabulary (with added tokens)
            is larger than ``vocab_rows`` (ids would index past the table) or smaller by more
            than :data:`VOCAB_SLACK` (it belongs to another model).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"tokenizer {path} does not exist: give the model's tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own Exception type on bad JSON
        raise DataError(
            f"{path} is not a tokenizers tokenizer.json ({str(exc).splitlines()[0]}): "
            "give the model's tokenizer.json"
        ) from exc
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab_rows is not None and not vocab_rows - VOCAB_SLACK <= size <= vocab_rows:
        raise DataError(
            f"tokenizer {path} has a vocabulary of {size} tokens but the model's embedding "
            f"table has {vocab_rows} rows: use the tokenizer.json the model was trained with"
        )
    return tokenizer


def _pad_id(tokenizer: Tokenizer) -> int:
    if tokenizer.padding is not None:
        return int(tokenizer.padding["pad_id"])
    for token in PAD_TOKENS:
        pad = tokenizer.token_to_id(token)
        if pad is not None:
            return int(pad)
    return 0


def tokenize(
    tokenizer: Tokenizer, texts: Sequence[str], seq_len: int, input_names: Sequence[str]
) -> dict[str, np.ndarray]:
    """Encode ``texts`` (with the tokenizer's special tokens, e.g. ``[CLS] ... [SEP]``),
    truncated and padded to ``seq_len``.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` (its own padding/truncation settings are
            replaced, on a copy).
        texts: N strings.
        seq_len: T, the model's sequence length.
        input_names: the model's token inputs, a subset of :data:`TOKEN_INPUTS`.

    Returns:
        ``{name: int64 [N, T]}`` for each of ``input_names``, in that order.

    Raises:
        DataError: an input name that is not a token input, or ``seq_len`` < 1.
    """
    other = [name for name in input_names if name not in TOKEN_INPUTS]
    if other:
        raise DataError(
            f"model input {other[0]!r} is not a token input ({', '.join(TOKEN_INPUTS)}): "
            "text data feeds only those; give the inputs as --data FILE.npz"
        )
    if seq_len < 1:
        raise DataError(f"sequence length must be >= 1, got {seq_len}: give --input-shape")
    tok = Tokenizer.from_str(tokenizer.to_str())  # do not change the caller's tokenizer
    tok.enable_truncation(max_length=seq_len)
    tok.enable_padding(length=seq_len, pad_id=_pad_id(tokenizer))
    encodings = tok.encode_batch(list(texts))
    fields = {
        "input_ids": lambda e: e.ids,
        "attention_mask": lambda e: e.attention_mask,
        "token_type_ids": lambda e: e.type_ids,
    }
    out = {}
    for name in input_names:
        get = fields[name]
        out[name] = np.array([get(e) for e in encodings], dtype=np.int64).reshape(
            len(encodings), seq_len
        )
    n_cut = sum(1 for e in encodings if e.overflowing)
    if n_cut:
        log.info("%d of %d texts truncated to %d tokens", n_cut, len(encodings), seq_len)
    return out


def load_text_data(
    path: str | os.PathLike,
    tokenizer_path: str | os.PathLike,
    *,
    input_names: Sequence[str],
    seq_len: int,
    vocab_rows: int | None = None,
    num_classes: int | None = None,
    class_names: Sequence[str] | None = None,
    known_names: Sequence[str] = (),
) -> TextData:
    """Read, label and tokenize a text file for a token model.

    Args:
        path: ``.csv`` or ``.jsonl`` with ``text`` and ``label`` columns.
        tokenizer_path: the model's ``tokenizer.json``.
        input_names: the model's graph inputs (each one of :data:`TOKEN_INPUTS`).
        seq_len: the model's sequence length T.
        vocab_rows: rows of the model's word-embedding table (checked against the tokenizer).
        num_classes: the head's output width K (labels are checked against it).
        class_names: an existing label mapping to apply (e.g. saved with a run).
        known_names: the class names the model's head was trained with, kept when every label
            is one of them (:func:`etgraph.labels.known_class_names`).

    Returns:
        A :class:`TextData`.

    Raises:
        DataError: see :func:`read_text_file`, :func:`load_tokenizer`, :func:`tokenize` and
            :func:`etgraph.labels.map_labels`.
    """
    texts, raw = read_text_file(path)
    names, labels = map_labels(
        raw, num_classes=num_classes, class_names=class_names, source=str(path), known=known_names
    )
    tokenizer = load_tokenizer(tokenizer_path, vocab_rows=vocab_rows)
    inputs = tokenize(tokenizer, texts, seq_len, input_names)
    ids = inputs.get("input_ids")
    if vocab_rows is not None and ids is not None and ids.size and int(ids.max()) >= vocab_rows:
        pad = _pad_id(tokenizer)
        what = f"pads with id {pad}" if pad >= vocab_rows else f"gives id {int(ids.max())}"
        raise DataError(
            f"tokenizer {tokenizer_path} {what}, outside the model's embedding table of "
            f"{vocab_rows} rows: fix its padding pad_id (or use the model's own tokenizer)"
        )
    log.info("%s: %d texts, %d classes, T=%d", path, len(texts), len(names), seq_len)
    return TextData(str(path), inputs, labels, names, texts)
