"""Files on disk, written so that a kill at any instant loses nothing.

* :func:`atomic_target` / :func:`write_atomic` / :func:`write_json_atomic` — a file is written to
  a temporary sibling (``.<name>.<random>``), fsynced and renamed over its destination: readers
  see the old complete version or the new complete one, never a partial one.
* :func:`atomic_directory` — the same for a directory (ORT training artifacts).
* :func:`remove_temporaries` — delete what a killed writer left behind.
* :func:`ensure_writable_dir` — the one check that an output directory can be written;
  :func:`ensure_writable_file` the same for an output file.
* :func:`append_jsonl` / :func:`read_jsonl` — the one JSON-lines log writer and reader.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from .errors import ConfigError

log = logging.getLogger(__name__)

__all__ = [
    "append_jsonl",
    "atomic_directory",
    "atomic_target",
    "ensure_writable_dir",
    "ensure_writable_file",
    "read_jsonl",
    "remove_temporaries",
    "temporary_prefix",
    "write_atomic",
    "write_json_atomic",
]


def temporary_prefix(name: str) -> str:
    """Name prefix of the temporaries an atomic write of ``name`` goes through."""
    return f".{name}."


@contextlib.contextmanager
def atomic_target(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write to; when the block completes, fsync it and
    rename it over ``path``. On an exception it is deleted; a SIGKILL leaves it for
    :func:`remove_temporaries`, and ``path`` keeps its last complete version."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=temporary_prefix(path.name), dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomic(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write ``data`` (bytes, or text as UTF-8) to ``path`` atomically; returns the path."""
    payload = data.encode() if isinstance(data, str) else data
    with atomic_target(path) as tmp:
        tmp.write_bytes(payload)
    return Path(path)


def write_json_atomic(path: str | os.PathLike, payload) -> Path:
    """Write ``payload`` as indented JSON (one trailing newline) to ``path`` atomically."""
    return write_atomic(path, json.dumps(payload, indent=2) + "\n")


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory beside ``path`` to fill; when the block completes, it replaces
    ``path`` (an existing directory there is removed). On an exception it is deleted; a SIGKILL
    leaves it (``.<name>.<random>``) for :func:`remove_temporaries`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=temporary_prefix(path.name), dir=path.parent))
    try:
        yield tmp
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=temporary_prefix(path.name), dir=path.parent))
            old.rmdir()
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_temporaries(directory: str | os.PathLike, names: Iterable[str] | None = None) -> None:
    """Delete the temporaries that killed atomic writes left in ``directory``.

    Args:
        directory: where to look (nothing happens if it does not exist).
        names: only temporaries of these destination names; None = every ``.<name>.<random>``
            file or directory. Only for a directory no other process is writing to.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return
    prefixes = None if names is None else tuple(temporary_prefix(n) for n in names)
    for p in directory.iterdir():
        if prefixes is None:
            if not p.name.startswith(".") or p.name.count(".") < 2:
                continue
        elif not p.name.startswith(prefixes):
            continue
        log.info("removing %s, left by an interrupted write", p)
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                p.unlink()


def ensure_writable_dir(path: str | os.PathLike, option: str = "--out") -> Path:
    """Create ``path`` if needed and check that it is a writable directory.

    Args:
        path: the directory.
        option: the command-line option that chose it, named in the error.

    Raises:
        ConfigError: it cannot be created or written (a parent is a file, read-only, ...).
    """
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".etgraph-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"output directory {path} is not writable ({exc.strerror}): choose another with "
            f"{option}"
        ) from exc
    return path


def ensure_writable_file(path: str | os.PathLike, option: str = "-o") -> Path:
    """Check, before the work that produces it, that a file can be written at ``path``: not a
    directory, in a writable directory (created if needed).

    Raises:
        ConfigError: ``path`` is a directory, or its directory cannot be created or written.
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path} is a directory: give {option} the path of a file")
    ensure_writable_dir(path.parent, option)
    return path


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    """Append ``record`` as one JSON line to ``path`` and fsync it (a log survives a kill)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_json(path: str | os.PathLike, *, what: str, if_missing: str, if_unreadable: str):
    """The JSON document at ``path``.

    Raises:
        ConfigError: ``"<what> <path> does not exist: <if_missing>"``, or ``"<what> <path> is
            not readable JSON (<reason>): <if_unreadable>"``.
    """
    path = Path(path)
    label = f"{what} {path}" if what else str(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"{label} does not exist: {if_missing}") from exc
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{label} is not readable JSON ({exc}): {if_unreadable}") from exc


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a JSON-lines file, without its unreadable lines: the last one cut by a
    kill (expected), or one damaged in the middle (skipped with a warning, the records after it
    kept). A missing file has none."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except ValueError:
            if number < len(lines):
                log.warning("%s: line %d is not readable JSON: skipped", path, number)
    return records
