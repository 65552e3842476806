"""Files on disk, written so that a kill at any instant loses nothing.

* :func:`atomic_target` / :func:`write_atomic` / :func:`write_json_atomic` — a file is written to
  a temporary sibling (``.<name>.<random>``), fsynced and renamed over its destination: readers
  see the old complete version or the new complete one, never a partial one.
* :func:`atomic_directory` — the same for a directory (ORT training artifacts).
* :func:`remove_temporaries` — delete what a killed writer left behind.
* :func:`ensure_writable_dir` — the one check that an output directory can be written;
  :func:`ensure_writable_file` the same for an output file.
* :func:`check_outputs` — refuse, before any work, an output that is a special file or one of
  the command's own inputs.
* :func:`staged_directory` — build a directory's files beside it and put them in place only on
  success (``etgraph compile``: a failed or killed re-compile leaves the last good one).
* :func:`exclusive_lock` — one etgraph process at a time in a run or compiled directory.
* :func:`private_temp_dir` / :func:`sweep_stale_temp_dirs` — private temporary directories
  named after their process, and the removal of those a killed process left.
* :func:`transient_file` — a file read once and dropped (a session's starting checkpoint), in
  RAM where there is room.
* :func:`append_jsonl` / :func:`read_jsonl` — the one JSON-lines log writer and reader.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from .errors import CheckpointError, ConfigError, ModelError

log = logging.getLogger(__name__)

__all__ = [
    "LOCK_FILE",
    "RAM_DIR",
    "append_jsonl",
    "atomic_directory",
    "atomic_target",
    "check_creatable_dir",
    "check_outputs",
    "check_outside_folders",
    "ensure_writable_dir",
    "ensure_writable_file",
    "exclusive_lock",
    "private_temp_dir",
    "read_jsonl",
    "remove_temporaries",
    "staged_directory",
    "sweep_stale_temp_dirs",
    "temporary_prefix",
    "transient_file",
    "write_atomic",
    "write_json_atomic",
    "write_parts",
]

#: The lock file of a run or compiled directory (:func:`exclusive_lock`); it holds the pid.
LOCK_FILE = ".etgraph-lock"
#: Name prefix of etgraph's temporary directories: ``etgraph-<kind>-<pid>-<random>``
#: (:func:`private_temp_dir`; hidden inside a directory being built: :func:`staged_directory`).
_TEMP_PREFIX = "etgraph-"
_TEMP_NAME = re.compile(r"\.?etgraph-[a-z]+(?:-[a-z]+)*-(\d+)-[^/]+")


def temporary_prefix(name: str) -> str:
    """Name prefix of the temporaries an atomic write of ``name`` goes through."""
    return f".{name}."


@contextlib.contextmanager
def atomic_target(path: str | os.PathLike, *, fsync: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write to; when the block completes, fsync it
    (unless ``fsync`` is False: a file nothing needs after a crash) and rename it over ``path``.
    On an exception it is deleted; a SIGKILL leaves it for :func:`remove_temporaries`, and
    ``path`` keeps its last complete version."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=temporary_prefix(path.name), dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        if fsync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_parts(path: str | os.PathLike, parts: Sequence[bytes | memoryview]) -> None:
    """Write the bytes-like ``parts`` to ``path`` one after another (created or truncated),
    each from its own memory: no joined copy."""
    with open(path, "wb", buffering=0) as f:
        for part in parts:
            view = memoryview(part)
            while view.nbytes:  # a raw write may write less than asked
                view = view[f.write(view) :]


def write_atomic(path: str | os.PathLike, data: bytes | str | Sequence[bytes | memoryview]) -> Path:
    """Write ``data`` (bytes, text as UTF-8, or bytes-like parts written in order,
    :func:`write_parts`) to ``path`` atomically; returns the path."""
    if isinstance(data, str):
        data = data.encode()
    with atomic_target(path) as tmp:
        write_parts(tmp, [data] if isinstance(data, (bytes, bytearray, memoryview)) else data)
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


def require_model_path(path: str | os.PathLike, *, directory_ok: bool = False) -> Path:
    """``path`` as a Path if it names a model file (or, with ``directory_ok``, a compiled
    directory); checked by every command before anything heavy is imported, so that a typo
    answers at once.

    Raises:
        ModelError: nothing of that kind is there.
    """
    path = Path(path)
    if not (path.is_file() or (directory_ok and path.is_dir())):
        kind = "model file or compiled directory" if directory_ok else "model file"
        raise ModelError(f"{path}: no such {kind}")
    return path


def require_run_dir(out: Path) -> None:
    """Check that ``out`` is a directory an earlier run could have written (before anything
    heavy is imported: ``etgraph train --resume /typo`` answers at once).

    Raises:
        CheckpointError: ``out`` does not exist or is a file.
    """
    if not out.is_dir():
        raise CheckpointError(
            f"{out} is not a run directory ({'a file' if out.exists() else 'it does not exist'}): "
            "pass the --out directory of an earlier `etgraph train`"
        )


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


def check_creatable_dir(path: str | os.PathLike, option: str = "--out") -> None:
    """Refuse, without creating anything, a directory ``path`` that cannot be made or written:
    it or its nearest existing parent is a file, or that parent is not writable (what
    :func:`ensure_writable_dir` would find later, after the work before it).

    Raises:
        ConfigError: naming the path and ``option``.
    """
    path = Path(path).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    reason = None
    if not existing.is_dir():
        reason = f"{existing} is a file"
    elif not os.access(existing, os.W_OK | os.X_OK):
        reason = f"{existing} is read-only"
    if reason is not None:
        raise ConfigError(
            f"output directory {path} is not writable ({reason}): choose another with {option}"
        )


def ensure_writable_file(
    path: str | os.PathLike, option: str = "-o", inputs: Iterable = ()
) -> Path:
    """Check, before the work that produces it, that a file can be written at ``path``: not a
    directory, a special file or one of ``inputs`` (:func:`check_outputs`), in a writable
    directory (created if needed).

    Raises:
        ConfigError: ``path`` is a directory, a special file or an input, or its directory
            cannot be created or written.
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path} is a directory: give {option} the path of a file")
    check_outputs([path], option, inputs)
    ensure_writable_dir(path.parent, option)
    return path


def check_outputs(paths: Iterable, option: str, inputs: Iterable = ()) -> None:
    """Refuse, before any work, to write any of ``paths`` where that would replace what it must
    not: a special file (device node, FIFO, socket; links followed) or one of the command's
    ``inputs`` (the same file, through a link or not; None entries skipped).

    Raises:
        ConfigError: naming the path and ``option``, the command-line option that chose it.
    """
    given = [Path(p) for p in inputs if p is not None]
    for path in map(Path, paths):
        try:
            mode = os.stat(path).st_mode
        except OSError:
            continue  # nothing there (or unreadable: writing it fails with its own error)
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise ConfigError(
                f"{path} is a special file (a device, FIFO or socket), not a file etgraph may "
                f"replace: choose another {option}"
            )
        for source in given:
            with contextlib.suppress(OSError):
                if os.path.samefile(path, source):
                    raise ConfigError(
                        f"writing {path} would replace the input {source} (the same file): "
                        f"choose another {option}"
                    )


def check_outside_folders(out: str | os.PathLike, inputs: Iterable, option: str) -> None:
    """Refuse, before anything is created, an output directory ``out`` that is, or lies inside,
    one of the command's input folders (an image folder: every folder etgraph writes there
    would become a class of the data, and a later run on it fails; None entries skipped).

    Raises:
        ConfigError: naming both paths and ``option``.
    """
    where = Path(out).resolve()
    for folder in (Path(p) for p in inputs if p is not None):
        if folder.is_dir() and folder.resolve() in (where, *where.parents):
            raise ConfigError(
                f"{out} is inside the data folder {folder}: the folders etgraph writes there "
                f"would become classes of its data; choose an {option} outside it"
            )


@contextlib.contextmanager
def staged_directory(path: str | os.PathLike, names: Iterable[str], marker: str) -> Iterator[Path]:
    """Yield a private directory inside ``path`` to write the entries ``names`` of ``path``
    into; when the block completes, they replace those of ``path`` (an entry ``names`` lists
    but the block did not write is removed from ``path``), ``marker`` last. On an exception
    (or a kill: :func:`sweep_stale_temp_dirs`) ``path`` keeps its last complete entries.

    ``marker`` is the entry whose presence says the directory is complete: it is removed first
    and put in place last, so the short moment of the swap itself leaves the directory
    incomplete, never a mix of two builds that looks complete. Entries ``path`` holds besides
    ``names`` are kept."""
    path = Path(path)
    stage = Path(tempfile.mkdtemp(prefix=f".{_TEMP_PREFIX}stage-{os.getpid()}-", dir=path))
    try:
        yield stage
        names = [n for n in names if n != marker] + [marker]
        (path / marker).unlink(missing_ok=True)
        for name in names:
            new, old = stage / name, path / name
            if old.is_dir() and not old.is_symlink():
                old.rename(stage / f".old-{name}")  # a directory is not replaced by rename
            if new.exists():
                new.rename(old)
            else:
                old.unlink(missing_ok=True)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


#: The lock files this process holds (real path -> nesting depth): :func:`exclusive_lock`.
_HELD: dict[str, int] = {}


@contextlib.contextmanager
def exclusive_lock(directory: str | os.PathLike, option: str) -> Iterator[None]:
    """Hold an exclusive lock on ``directory`` for the block: ``fcntl.flock`` on its
    :data:`LOCK_FILE`, which records the holder's pid and is removed when the block ends. A
    second etgraph process is refused; the lock goes with the process however it ends (a file
    left by a kill is locked again by the next process).

    The lock is reentrant within a process: a block nested in one that holds it (an API call
    inside a command holding its directory) holds it too.

    Raises:
        ConfigError: another process holds it (the message names its pid and ``option``).
    """
    lock = Path(directory) / LOCK_FILE
    key = os.path.realpath(lock)
    if key in _HELD:  # this process holds it already
        _HELD[key] += 1
        try:
            yield
        finally:
            _HELD[key] -= 1
        return
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(
                f"{directory} is in use by another etgraph process (pid {holder}): wait for "
                f"it to end, or choose another {option}"
            ) from None
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_ino == os.stat(lock, follow_symlinks=False).st_ino:
                break  # the file still there, not one its last holder removed meanwhile
        os.close(fd)
    _HELD[key] = 1
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        del _HELD[key]
        with contextlib.suppress(OSError):
            lock.unlink()  # while still locked: a waiting process then sees it gone
        os.close(fd)


def private_temp_dir(
    kind: str, dir: str | os.PathLike | None = None
) -> tempfile.TemporaryDirectory:
    """A new private (0700) temporary directory ``etgraph-<kind>-<pid>-<random>`` under
    ``$TMPDIR`` (or ``dir``), removed by ``cleanup()``, when its context ends, at interpreter
    exit (the CLI turns SIGTERM into an exit) or, after a SIGKILL, by
    :func:`sweep_stale_temp_dirs` at the next start."""
    return tempfile.TemporaryDirectory(prefix=f"{_TEMP_PREFIX}{kind}-{os.getpid()}-", dir=dir)


#: A RAM file system (Linux's tmpfs) for transient files (:func:`transient_file`).
RAM_DIR = Path("/dev/shm")


@contextlib.contextmanager
def transient_file(
    name: str, size_bytes: int, fallback_dir: str | os.PathLike, *, ram: bool = True
) -> Iterator[Path]:
    """A path for a transient file ``name`` of about ``size_bytes`` that is written, read once
    and dropped (a session's starting checkpoint: ORT reads it into memory), removed when the
    block ends. With ``ram``, in a private temporary directory in :data:`RAM_DIR` when that is
    a writable directory with room for the file twice over (a 282 MB checkpoint: written in
    0.13-0.15 s and replaced in 0.02-0.03 s there, against 0.28-0.42 s and 0.2-0.36 s on this
    machine's ext4 disk; issue 31); else (or without ``ram``: under a memory budget the file
    must not hold RAM) in ``fallback_dir``."""
    room = 0
    if ram:
        with contextlib.suppress(OSError):
            st = os.statvfs(RAM_DIR)
            if os.access(RAM_DIR, os.W_OK | os.X_OK):
                room = st.f_bavail * st.f_frsize
    tmp = None
    if room >= 2 * size_bytes:
        with contextlib.suppress(OSError):
            tmp = private_temp_dir("transient", dir=RAM_DIR)
    directory = Path(tmp.name) if tmp is not None else Path(fallback_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        if tmp is not None:
            tmp.cleanup()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def sweep_stale_temp_dirs(root: str | os.PathLike | None = None) -> list[Path]:
    """Remove the temporary directories (:func:`private_temp_dir`, :func:`staged_directory`)
    of etgraph processes that no longer run, under ``root`` (default ``$TMPDIR`` and
    :data:`RAM_DIR`): this user's only, recognised by name. Returns those removed."""
    roots = [Path(root)] if root is not None else [Path(tempfile.gettempdir()), RAM_DIR]
    removed = []
    for directory in dict.fromkeys(roots):
        removed += _sweep(directory)
    return removed


def _sweep(root: Path) -> list[Path]:
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            match = _TEMP_NAME.fullmatch(entry.name)
            if match is None or not entry.is_dir(follow_symlinks=False):
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid != os.geteuid():
                    continue
                if not _alive(int(match.group(1))):
                    log.info("removing %s, left by a process that was killed", entry.path)
                    shutil.rmtree(entry.path, ignore_errors=True)
                    removed.append(Path(entry.path))
    return removed


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    """Append ``record`` as one JSON line to ``path`` and fsync it (a log survives a kill); a
    symbolic link there is not followed."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    with open(fd, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_json(path: str | os.PathLike, *, what: str, if_missing: str, if_unreadable: str):
    """The JSON object at ``path`` (etgraph's files: plan, profile, memory model, run).

    Raises:
        ConfigError: ``"<what> <path> does not exist: <if_missing>"``, or ``"<what> <path> is
            not readable JSON (<reason>): <if_unreadable>"`` (also for a document that is not
            an object).
    """
    path = Path(path)
    label = f"{what} {path}" if what else str(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"{label} does not exist: {if_missing}") from exc
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{label} is not readable JSON ({exc}): {if_unreadable}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{label} is not readable JSON (not an object): {if_unreadable}")
    return data


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
