"""Trust at the edges (issue 26): what etgraph reads and writes, what survives a kill or a full
disk, what a resume checks, and inputs that used to end in an internal error.

Each test is written against the behaviour before the fix: it failed then (a file read through
a symlink, an output replacing its input, a traceback, a silently wrong picture, ...).
Commands run through the CLI's entry point in this process where that sees everything; signals,
locks held by another process, and resource limits need a real ``python -m etgraph``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import (
    assert_user_error,
    make_model,
    random_initializer,
    run_cli,
    run_cli_in_process,
)
from onnx import external_data_helper, helper
from PIL import Image, ImageCms

from etgraph import files
from etgraph.errors import ModelError
from etgraph.model import LoadedModel


@pytest.fixture(scope="module")
def cli(cache_env):
    """The CLI in this process with the session's private profile cache."""

    def run(*args: str | os.PathLike) -> subprocess.CompletedProcess:
        return run_cli_in_process(*args, env=cache_env)

    return run


def small_model() -> onnx.ModelProto:
    """x[N, 3, 8, 8] -> Flatten -> Gemm(w [4, 192]) -> y[N, 4]: one trainable tensor."""
    nodes = [
        helper.make_node("Flatten", ["x"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "w"], ["y"], name="fc", transB=1),
    ]
    return make_model(
        nodes, [random_initializer("w", (4, 192))], in_shape=("N", 3, 8, 8), out_shape=("N", 4)
    )


def save_external(model: onnx.ModelProto, folder: Path, location: str = "weights.bin") -> Path:
    """Save ``model`` as ``folder/m.onnx`` with every initializer in ``folder/location``."""
    (folder / location).parent.mkdir(parents=True, exist_ok=True)
    external_data_helper.convert_model_to_external_data(
        model, all_tensors_to_one_file=True, location=location, size_threshold=0
    )
    path = folder / "m.onnx"
    onnx.save(model, str(path))
    return path


# ---- security: nothing read outside the model's folder -------------------------------------


def test_external_data_through_a_symlink_out_of_the_folder_is_refused(cli, tmp_path):
    path = save_external(small_model(), tmp_path / "model")
    secret = tmp_path / "secret.bin"
    secret.write_bytes((tmp_path / "model" / "weights.bin").read_bytes())  # same size: loads
    (tmp_path / "model" / "weights.bin").unlink()
    (tmp_path / "model" / "weights.bin").symlink_to(secret)
    done = cli("compile", path, "-o", tmp_path / "out")
    assert_user_error(done, "'w'", str(secret), "outside the model's folder")
    assert not (tmp_path / "out" / "model.onnx").exists()


def test_external_data_linked_inside_the_folder_loads(tmp_path):
    path = save_external(small_model(), tmp_path / "model", "data/w.bin")
    (tmp_path / "model" / "alias.bin").symlink_to(tmp_path / "model" / "data" / "w.bin")
    model = onnx.load(str(path), load_external_data=False)
    for entry in model.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = "alias.bin"
    onnx.save(model, str(path))
    from etgraph.onnx_io import read_onnx

    loaded = read_onnx(path)
    expected = onnx.numpy_helper.to_array(small_model().graph.initializer[0])
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(loaded.graph.initializer[0]), expected)
    assert not loaded.graph.initializer[0].external_data


def test_a_linked_model_whose_data_is_beside_its_target_says_so(cli, tmp_path):
    real = save_external(small_model(), tmp_path / "store")
    (tmp_path / "models").mkdir()
    link = tmp_path / "models" / "m.onnx"
    link.symlink_to(real)  # its data is read beside the link, as onnx and ORT read it
    done = cli("compile", link, "-o", tmp_path / "out")
    assert_user_error(done, f"{link} is a link", f"beside the real file {real}", "pass that file")


def test_truncated_external_data_is_refused(tmp_path):
    path = save_external(small_model(), tmp_path / "model")
    weights = tmp_path / "model" / "weights.bin"
    weights.write_bytes(weights.read_bytes()[:100])
    from etgraph.onnx_io import read_onnx

    with pytest.raises(ModelError, match="'w' reads bytes 0..3072 of .* which has 100"):
        read_onnx(path)


def test_a_tensor_declaring_more_elements_than_it_holds_is_refused_at_load(cli, tmp_path):
    model = small_model()
    w = model.graph.initializer[0]
    del w.dims[:]
    w.dims.extend([10**6, 10**6])
    w.raw_data = b"\0\0\0\0"
    tmp_path.joinpath("m").mkdir()
    onnx.save(model, str(tmp_path / "m" / "m.onnx"))
    done = cli("compile", tmp_path / "m" / "m.onnx", "-o", tmp_path / "out")
    assert_user_error(done, "'w' declares 1000000000000 elements", "holds 4 bytes")


def test_a_node_name_that_is_not_utf8_is_refused(cli, tmp_path):
    model = small_model()
    model.graph.node[0].name = "flattenXX"
    path = tmp_path / "m.onnx"
    data = model.SerializeToString().replace(b"flattenXX", b"flatte\xff\xfeX")  # same length
    path.write_bytes(data)
    done = cli("compile", path, "-o", tmp_path / "out")
    assert_user_error(done, "is not valid UTF-8", "node #0")
    with pytest.raises(ModelError):
        LoadedModel.load(path)


# ---- security: nothing written where it should not be ---------------------------------------


def test_compile_into_the_models_own_folder_does_not_replace_the_model(cli, tmp_path):
    model = tmp_path / "model.onnx"
    onnx.save(small_model(), str(model))
    before = model.read_bytes()
    done = cli("compile", model, "-o", tmp_path)
    assert_user_error(done, f"would replace the input {model}", "-o")
    assert model.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


def test_train_into_the_models_own_folder_does_not_replace_the_model(
    cli, default_model_path, tmp_path
):
    # a trained model trained again where it lies: the export (model_trained.onnx) would be it
    model = tmp_path / "model_trained.onnx"
    shutil.copyfile(default_model_path, model)
    before = model.read_bytes()
    done = cli("train", model, "--out", tmp_path, "--epochs", "1", "--max-steps-per-epoch", "2")
    assert_user_error(done, f"would replace the input {model}", "--out")
    assert model.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model_trained.onnx"]


@pytest.mark.parametrize(
    ("command", "inside"),
    [("train", "."), ("train", "run"), ("compile", "compiled")],
)
def test_train_or_compile_into_its_own_image_folder_is_refused(cli, tmp_path, command, inside):
    """A run written into its image folder (or a sub-folder) made its own folders classes of
    its data: it trained, then its resume failed with `class folder .../artifacts has no
    images` (or, before the first checkpoint, started over into the same error); a compiled
    directory there made the `etgraph train` it suggests fail alike. Refused before anything
    is created in the folder."""
    images = tmp_path / "images"
    for k in range(5):
        (images / f"c{k}").mkdir(parents=True)
        Image.new("RGB", (8, 8), (k, k, k)).save(images / f"c{k}" / "0.png")
    out = images / inside
    option = "--out" if command == "train" else "-o"
    done = cli(command, "--data", images, option, out, *(("--epochs", "1") * (command == "train")))
    assert_user_error(done, f"{out} is inside the data folder {images}", f"{option} outside it")
    assert sorted(p.name for p in images.iterdir()) == [f"c{k}" for k in range(5)]


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_profile_output_on_a_special_file_is_refused(cli, default_model_path, tmp_path, kind):
    target = tmp_path / "profile.json"
    if kind == "fifo":
        os.mkfifo(target)
    else:
        try:
            os.mknod(target, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
        except PermissionError:
            pytest.skip("creating a device node needs root")
    done = cli("profile", default_model_path, "-o", target)
    assert_user_error(done, str(target), "special file")
    assert not stat.S_ISREG(os.lstat(target).st_mode)


def test_profile_output_on_its_own_model_is_refused(cli, tmp_path):
    model = tmp_path / "m.onnx"
    onnx.save(small_model(), str(model))
    link = tmp_path / "link.onnx"
    link.symlink_to(model)
    assert_user_error(cli("profile", model, "-o", link), "would replace the input")


def test_profile_output_on_its_models_external_data_is_refused(cli, tmp_path):
    """The weights beside the model are an input too: -o model.onnx.data wrote the profile
    over them (the model could not be loaded again)."""
    model = tmp_path / "m.onnx"
    onnx.save(small_model(), str(model), save_as_external_data=True, location="m.onnx.data",
              size_threshold=0)  # fmt: skip
    weights = tmp_path / "m.onnx.data"
    before = weights.read_bytes()
    assert_user_error(cli("profile", model, "-o", weights), f"would replace the input {weights}")
    assert weights.read_bytes() == before


# ---- nothing lost: compile builds beside the last good one; one process per directory ------

QUICK_TRAIN = ["--epochs", "1", "--max-steps-per-epoch", "2", "--max-val-batches", "1", "--quiet"]
#: A run that lasts long enough to be interrupted (each epoch a few seconds).
LONG_TRAIN = ["--epochs", "40", "--max-steps-per-epoch", "100", "--max-val-batches", "1"]


def files_of(directory: Path) -> dict[str, bytes]:
    """Every regular file under ``directory`` (hidden ones included, but the lock file, which
    records the last process's pid) and its bytes."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in directory.rglob("*")
        if p.is_file() and p.name != ".etgraph-lock"
    }


def wait_for(
    condition, timeout_s: float = 120.0, proc: subprocess.Popen | None = None, poll_s=0.05
) -> None:
    """Poll ``condition()`` every ``poll_s`` until true (fails after ``timeout_s``, or if
    ``proc`` ended)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc is None or proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(poll_s)


def _default_sigint() -> None:
    """In the child before ``exec``: SIGINT unblocked and at its default disposition, as a
    terminal's foreground process has it. A process inherits a blocked or ignored SIGINT, and
    Python then never raises KeyboardInterrupt: in the full suite (not alone) the Ctrl-C test
    saw its run ignore the signal and finish."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def popen_cli(*args, env: dict[str, str]) -> subprocess.Popen:
    """``python -m etgraph ARGS`` started in the background (text stderr piped), with SIGINT
    at its default disposition (:func:`_default_sigint`)."""
    return subprocess.Popen(
        [sys.executable, "-m", "etgraph", *map(str, args)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
        preexec_fn=_default_sigint,
    )


@pytest.fixture(scope="module")
def compiled(cli, tmp_path_factory) -> Path:
    """A compile of the embedded default model (quick profile)."""
    out = tmp_path_factory.mktemp("compiled") / "c"
    done = cli("compile", "-o", out, "--repeats", "1")
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.slow  # real training
def test_a_failed_recompile_leaves_the_last_good_compile(cli, compiled, tmp_path):
    before = files_of(compiled)
    done = cli("compile", "-o", compiled, "--repeats", "1", "--data", tmp_path / "typo")
    assert_user_error(done, "typo")
    assert files_of(compiled) == before
    assert cli("train", compiled, "--out", tmp_path / "run", *QUICK_TRAIN).returncode == 0


@pytest.mark.slow  # real profiling
def test_a_killed_recompile_leaves_the_last_good_compile(compiled, cache_env, tmp_path):
    out = tmp_path / "c"
    shutil.copytree(compiled, out)
    before = files_of(out)
    fresh = {"ETGRAPH_CACHE": str(tmp_path / "cache")}  # the profile is measured again
    proc = popen_cli("compile", "-o", out, "--repeats", "30", env=fresh)
    # killed while the new compile is written beside the old one: Plan.save's stage, which
    # lasts ~0.1 s on this model at the end of the compile (polled every 2 ms)
    try:
        wait_for(lambda: list(out.glob(".etgraph-stage-*")), proc=proc, poll_s=0.002)
    finally:
        proc.kill()
        proc.communicate()
    after = files_of(out)
    assert {k: v for k, v in after.items() if not k.startswith(".etgraph-stage-")} == before
    done = run_cli_in_process("compile", "-o", out, "--repeats", "1", env=cache_env)
    assert done.returncode == 0, done.stderr
    assert not list(out.glob(".etgraph-stage-*")), "the killed compile's stage was not swept"


@pytest.mark.slow  # real training
def test_a_second_run_in_the_same_directory_is_refused(cli, default_profile, cache_env, tmp_path):
    out = tmp_path / "run"
    first = popen_cli(
        "train", "--out", out, "--profile", default_profile[1], *LONG_TRAIN, env=cache_env
    )
    try:
        wait_for(lambda: (out / "log.jsonl").exists(), proc=first)
        done = cli("train", "--out", out, "--profile", default_profile[1], *QUICK_TRAIN)
        assert_user_error(done, f"pid {first.pid}", "in use by another etgraph process")
        done = cli("train", "--resume", out, "--quiet")
        assert_user_error(done, f"pid {first.pid}")
    finally:
        first.kill()
        first.communicate()


def test_a_second_compile_into_the_same_directory_is_refused(cache_env, compiled):
    """This process holds the directory; another etgraph process is refused, naming it."""
    from etgraph.files import exclusive_lock

    with exclusive_lock(compiled, "-o"):
        done = run_cli("compile", "-o", compiled, "--repeats", "1", env=cache_env)
    assert_user_error(done, f"pid {os.getpid()}", "-o")


# ---- temporary directories: private, removed on SIGTERM, swept after SIGKILL ----------------


def etgraph_dirs(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.startswith("etgraph-"))


@pytest.mark.slow  # real training
def test_sigterm_removes_the_temporary_directories(default_profile, cache_env, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = tmp_path / "run"
    env = {**cache_env, "TMPDIR": str(tmp)}
    proc = popen_cli("train", "--out", out, "--profile", default_profile[1], *LONG_TRAIN, env=env)
    try:  # terminated while training: the session's baked graphs hold the model's weights
        wait_for(lambda: (out / "log.jsonl").exists() and etgraph_dirs(tmp), proc=proc)
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o700 for p in etgraph_dirs(tmp))
        proc.terminate()
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr
    assert stderr.strip().splitlines()[-1] == (
        f"etgraph: terminated: continue from the last checkpoint with `etgraph train --resume "
        f"{out}`"
    )
    assert etgraph_dirs(tmp) == []


def test_temporary_directories_of_killed_processes_are_swept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"etgraph-baked-{dead.pid}-abc"
    live = tmp_path / f"etgraph-baked-{os.getpid()}-abc"
    other = tmp_path / f"something-{dead.pid}-abc"
    for d in (stale, live, other):
        d.mkdir()
        (d / "weights.onnx").write_bytes(b"x")
    done = subprocess.run(
        [sys.executable, "-m", "etgraph", "inspect", "--passes"],
        env={**os.environ, "TMPDIR": str(tmp_path)},
        capture_output=True,
    )
    assert done.returncode == 0
    assert not stale.exists() and live.exists() and other.exists()


def test_transient_files_go_to_ram_where_there_is_room_and_never_stay(tmp_path, monkeypatch):

    ram, disk = tmp_path / "ram", tmp_path / "disk"
    ram.mkdir()
    monkeypatch.setattr(files, "RAM_DIR", ram)
    for size, in_ram, allowed in ((1 << 20, True, True), (1 << 60, False, True), (1, False, False)):
        with files.transient_file("s.ckpt", size, disk, ram=allowed) as path:
            path.write_bytes(b"state")
            assert (path.parent.parent == ram) is in_ram and (path.parent == disk) is not in_ram
            if in_ram:  # a private directory, named for the sweep after a kill
                assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
                assert path.parent.name.startswith(f"etgraph-transient-{os.getpid()}-")
        assert not path.exists() and list(ram.iterdir()) == []
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = ram / f"etgraph-transient-{dead.pid}-abc"
    stale.mkdir()
    assert stale in files.sweep_stale_temp_dirs() and not stale.exists()


def test_the_temporary_directories_of_a_killed_process_are_swept_whatever_their_kind(tmp_path):
    # every kind etgraph makes; "fl-artifacts" (a Flower client's cache, ~20 MB per Ray worker,
    # left by every killed federated run) once escaped the sweep by its hyphen
    sources = "".join(p.read_text() for p in Path(files.__file__).parent.rglob("*.py"))
    kinds = set(re.findall(r'private_temp_dir\(\s*"([^"]+)"', sources))
    assert {"fl-artifacts", "baked", "train"} <= kinds
    code = (
        "import os, sys; from etgraph.files import private_temp_dir\n"
        "dirs = [private_temp_dir(k, dir=sys.argv[1]) for k in sys.argv[2:]]\n"
        "print(flush=True); os.kill(os.getpid(), 9)"
    )
    child = subprocess.run([sys.executable, "-c", code, tmp_path, *sorted(kinds)], check=False)
    assert child.returncode == -signal.SIGKILL
    left = sorted(tmp_path.iterdir())
    assert len(left) == len(kinds)
    keep = tmp_path / "etgraph-ablation-text-1tkm_h96"  # not a private_temp_dir name: kept
    keep.mkdir()
    assert sorted(files.sweep_stale_temp_dirs(tmp_path)) == left
    assert list(tmp_path.iterdir()) == [keep]


def test_ctrl_c_while_profiling_does_not_suggest_resuming_a_run_that_was_not_started(tmp_path):
    out = tmp_path / "run"
    env = {"ETGRAPH_CACHE": str(tmp_path / "cache")}  # nothing cached: the model is profiled
    proc = popen_cli("train", "--out", out, "--profile-level", "thorough", env=env)
    try:
        assert "profiling" in proc.stderr.readline()
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        stderr = proc.stderr.read()  # not communicate(timeout=...): it skips what readline buffered
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == "etgraph: interrupted"
    assert not out.exists()


# ---- checkpoint integrity --------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_period_run(cli, default_profile, tmp_path_factory) -> Path:
    """A finished run of 2 epochs, a checkpoint after each (period 1)."""
    out = tmp_path_factory.mktemp("runs") / "run"
    args = ["--epochs", "2", "--period", "1", "--max-steps-per-epoch", "3", "--max-val-batches"]
    done = cli("train", "--out", out, "--profile", default_profile[1], *args, "1", "--quiet")
    assert done.returncode == 0, done.stderr
    return out


def zero_middle(path: Path, count: int = 4000) -> None:
    """Zero ``count`` bytes in the middle of ``path`` (inside a weight tensor's data: the file
    still parses)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + count] = bytes(count)
    path.write_bytes(data)


@pytest.mark.slow  # real training
def test_a_damaged_checkpoint_is_refused_at_resume(cli, two_period_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(two_period_run, out)
    zero_middle(out / "checkpoint")
    (out / "checkpoint.prev").unlink(missing_ok=True)
    done = cli("train", "--resume", out, "--quiet")
    assert_user_error(done, f"checkpoint {out / 'checkpoint'} is damaged", "sha256")


@pytest.mark.slow  # real training
def test_a_damaged_checkpoint_falls_back_to_the_previous_one(
    cli, two_period_run, cache_env, tmp_path
):
    out = tmp_path / "run"
    shutil.copytree(two_period_run, out)
    zero_middle(out / "checkpoint")
    done = run_cli("train", "--resume", out, env=cache_env)  # the warning as a user sees it
    assert done.returncode == 0, done.stderr
    assert f"checkpoint {out / 'checkpoint'} is damaged" in done.stderr
    assert "continuing from the previous checkpoint" in done.stderr
    assert f"resuming {out} after epoch 1 of 2" in done.stdout + done.stderr
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in log] == [1, 2]
    done = cli("train", "--resume", out, "--quiet")  # the repaired run is intact
    assert done.returncode == 0 and "damaged" not in done.stderr, done.stderr


@pytest.mark.slow  # real training
def test_the_trained_model_appears_only_complete(cli, default_profile, monkeypatch, tmp_path):
    """model_trained.onnx is exported, its batch freed and its head restored before it
    appears: a kill in between left a model fixed at the training batch (it failed at batch
    1). Every time a model is read while the run exports, the file there is the final one."""
    import onnx_ir

    out, seen = tmp_path / "run", []
    load = onnx_ir.load

    def spy(*args, **kwargs):
        if (out / "model_trained.onnx").exists():
            seen.append((out / "model_trained.onnx").read_bytes())
        return load(*args, **kwargs)

    monkeypatch.setattr(onnx_ir, "load", spy)
    done = cli("train", "--out", out, "--profile", default_profile[1], *QUICK_TRAIN)
    assert done.returncode == 0, done.stderr
    final = (out / "model_trained.onnx").read_bytes()
    assert all(snapshot == final for snapshot in seen)
    assert not list(out.glob(".model_trained.onnx.*"))


def test_checkpoint_digests_follow_saves_and_fallbacks(tmp_path):
    from etgraph.checkpoint import checkpoint_target, verify_checkpoint
    from etgraph.errors import CheckpointError

    path = tmp_path / "checkpoint"

    def save(data: bytes) -> None:
        with checkpoint_target(path) as tmp:
            tmp.write_bytes(data)

    save(b"A" * 100)
    save(b"B" * 100)
    assert verify_checkpoint(path) and (tmp_path / "checkpoint.prev").read_bytes() == b"A" * 100
    path.write_bytes(b"B" * 99 + b"X")  # damaged in place
    assert not verify_checkpoint(path) and path.read_bytes() == b"A" * 100
    assert not path.samefile(tmp_path / "checkpoint.prev")  # restored as a copy
    save(b"C" * 100)  # after a fallback, the previous one kept is the one resumed from
    path.write_bytes(b"garbage")
    assert not verify_checkpoint(path) and path.read_bytes() == b"A" * 100
    path.write_bytes(b"garbage")
    (tmp_path / "checkpoint.prev").write_bytes(b"garbage too")
    with pytest.raises(CheckpointError, match="is damaged"):
        verify_checkpoint(path)
    # a record that is JSON but not a list of digests: none recorded (was an internal error)
    (tmp_path / "checkpoint.sha256").write_text('{"sha256": 3}')
    assert verify_checkpoint(path)


# ---- image modes: every mode Pillow opens decodes to the right picture, or is refused -------

H, W = 6, 8
GREY = np.linspace(0, 255, H * W).round().astype(np.uint8).reshape(H, W)
RGB = np.stack([GREY, 255 - GREY, GREY // 2], axis=-1)


def _image(mode: str) -> tuple[Image.Image, str, np.ndarray, float]:
    """A picture in ``mode``, the file suffix to save it as, the 8-bit RGB [H, W, 3] it must
    decode to, and the tolerance (lossy or approximate conversions)."""
    grey3 = np.repeat(GREY[:, :, None], 3, axis=2)
    alpha = (255 - GREY)[:, :, None]
    if mode == "I;16":
        return Image.fromarray(GREY.astype(np.uint16) * 257), ".png", grey3, 0
    if mode == "I":
        return Image.fromarray(GREY.astype(np.int32) * 257), ".tif", grey3, 0
    if mode == "F":  # floats in [0, 1]
        return Image.fromarray(GREY.astype(np.float32) / 255), ".tif", grey3, 0.01
    if mode == "F255":  # floats in [0, 255]
        return Image.fromarray(GREY.astype(np.float32)), ".tif", grey3, 0.01
    if mode == "RGBA":
        return Image.fromarray(np.concatenate([RGB, alpha], axis=2), "RGBA"), ".png", RGB, 0
    if mode == "LA":
        return Image.fromarray(np.stack([GREY, 255 - GREY], -1), "LA"), ".png", grey3, 0
    if mode in ("P", "PA"):
        img = Image.fromarray(RGB).convert("P")
        if mode == "PA":
            img.info["transparency"] = 0
        return img, ".png", np.asarray(img.convert("RGB")), 0
    if mode == "1":
        img = Image.fromarray(GREY).convert("1")
        return img, ".png", np.repeat(np.asarray(img, np.uint8)[:, :, None] * 255, 3, 2), 0
    if mode == "CMYK":
        return Image.fromarray(RGB).convert("CMYK"), ".tif", RGB, 1
    if mode == "LAB":  # 8-bit LAB loses up to 20/255 of sRGB: compared with LittleCMS's
        lab, srgb = ImageCms.createProfile("LAB"), ImageCms.createProfile("sRGB")
        img = Image.fromarray(RGB).convert("LAB")
        to_rgb = ImageCms.buildTransformFromOpenProfiles(lab, srgb, "LAB", "RGB")
        return img, ".tif", np.asarray(ImageCms.applyTransform(img, to_rgb)), 0
    if mode == "L":
        return Image.fromarray(GREY, "L"), ".png", grey3, 0
    return Image.fromarray(RGB, "RGB"), ".png", RGB, 0


@pytest.mark.parametrize(
    "mode", ["1", "L", "LA", "P", "PA", "RGB", "RGBA", "CMYK", "LAB", "I;16", "I", "F", "F255"]
)
def test_every_image_mode_decodes_to_its_picture(mode, tmp_path):
    from etgraph.data import load_image_folder
    from etgraph.images import make_preprocess

    img, suffix, expected, tolerance = _image(mode)
    (tmp_path / "a").mkdir()
    path = tmp_path / "a" / f"x{suffix}"
    img.save(path, **({"transparency": 0} if mode == "PA" else {}))
    with Image.open(path) as reopened:  # the file holds the mode under test
        assert reopened.mode == {"F255": "F", "PA": "P"}.get(mode, mode), reopened.mode
    dataset = load_image_folder(
        tmp_path, input_shape=(3, H, W), val_fraction=0, preprocess=make_preprocess("none")
    )
    x, _ = next(dataset.val_batches(1)) if dataset.n_val else dataset.probe_batch(1, 0)
    decoded = np.moveaxis(x[0], 0, -1) * 255  # [H, W, 3], 0-255
    assert np.abs(decoded - expected).max() <= tolerance + 1e-3, mode


@pytest.mark.parametrize(
    ("array", "fragment"),
    [
        (np.array([[-5.0, 300.0]], np.float32), "float picture with values -5..300"),
        (np.array([[0.0, np.nan]], np.float32), "float picture"),
        (np.array([[0, 70000]], np.int32), "beyond 16 bits"),
    ],
    ids=["float-range", "float-nan", "int32-range"],
)
def test_an_image_that_cannot_be_scaled_is_refused(cli, default_profile, tmp_path, array, fragment):
    for label in ("a", "b"):  # every picture is one of them: the first batch decodes one
        (tmp_path / "data" / label).mkdir(parents=True)
        for i in range(6):
            Image.fromarray(np.resize(array, (8, 8))).save(tmp_path / "data" / label / f"{i}.tif")
    done = cli(
        "train", "--out", tmp_path / "run", "--profile", default_profile[1],
        "--data", tmp_path / "data", *QUICK_TRAIN,
    )  # fmt: skip
    assert_user_error(done, "cannot read image", ".tif", fragment)


def test_a_decompression_bomb_is_refused_in_one_line(cli, default_profile, monkeypatch, tmp_path):
    for label in ("a", "b"):
        (tmp_path / "data" / label).mkdir(parents=True)
        for i in range(6):
            Image.fromarray(np.zeros((8, 8), np.uint8)).save(tmp_path / "data" / label / f"{i}.png")
    bomb = tmp_path / "data" / "a" / "bomb.png"
    Image.fromarray(np.zeros((150, 150), np.uint8)).save(bomb)
    # Pillow refuses pictures of more than 2 * MAX_IMAGE_PIXELS: 10000 stands for 89 million
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10000)
    done = cli(
        "train", "--out", tmp_path / "run", "--profile", default_profile[1],
        "--data", tmp_path / "data", *QUICK_TRAIN,
    )  # fmt: skip
    assert_user_error(done, f"cannot read image {bomb}", "decompression bomb")


# ---- text and tabular edge cases: one line each, or read correctly --------------------------


@pytest.fixture
def tokenizer_json(tmp_path) -> Path:
    """A word-level tokenizer: [PAD]=0 [UNK]=1, then a few words."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "good", "bad", "film"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path / "tokenizer.json"


def load_text(path: Path, tokenizer: Path, num_classes: int | None = 2):
    from etgraph.text import load_text_data

    return load_text_data(
        path, tokenizer, input_names=["input_ids"], seq_len=6, vocab_rows=5,
        num_classes=num_classes,
    )  # fmt: skip


def test_a_csv_text_field_over_128_kib_is_read(tmp_path, tokenizer_json):
    long = " ".join(["good"] * 50_000)  # 250 KB: csv's default field limit is 128 KiB
    path = tmp_path / "t.csv"
    path.write_text(f"text,label\n{long},1\nbad film,0\n")
    data = load_text(path, tokenizer_json)
    assert data.inputs["input_ids"][0].tolist() == [2] * 6
    assert data.labels.tolist() == [1, 0]


@pytest.mark.parametrize("num_classes", [2, None], ids=["head-2", "symbolic-head"])
def test_a_huge_integer_label_is_refused(tmp_path, tokenizer_json, num_classes):
    from etgraph.errors import DataError

    path = tmp_path / "t.csv"
    path.write_text("text,label\ngood film,99999999999999999999999\nbad film,0\n")
    with pytest.raises(DataError, match="label 99999999999999999999999 is "):
        load_text(path, tokenizer_json, num_classes)


def test_a_lone_surrogate_in_jsonl_is_refused(tmp_path, tokenizer_json):
    from etgraph.errors import DataError

    path = tmp_path / "t.jsonl"
    path.write_text('{"text": "good", "label": "a"}\n{"text": "bad \\ud800", "label": "b"}\n')
    with pytest.raises(DataError, match=r"t.jsonl:2: .*surrogate"):
        load_text(path, tokenizer_json)


def test_a_pad_id_outside_the_embedding_table_is_refused(tmp_path, tokenizer_json):
    from tokenizers import Tokenizer

    from etgraph.errors import DataError

    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.enable_padding(pad_id=1_000_000, pad_token="[PAD]")
    tok.save(str(tokenizer_json))
    path = tmp_path / "t.csv"
    path.write_text("text,label\ngood,1\nbad film,0\n")
    with pytest.raises(DataError, match="pads with id 1000000, outside the model's embedding"):
        load_text(path, tokenizer_json)


def test_an_npz_with_zero_rows_is_refused(cli, default_profile, tmp_path):
    np.savez(
        tmp_path / "d.npz", input=np.zeros((0, 3, 32, 32), np.float32), labels=np.zeros(0, int)
    )
    done = cli("train", "--out", tmp_path / "run", "--profile", default_profile[1],
               "--data", tmp_path / "d.npz", *QUICK_TRAIN)  # fmt: skip
    assert_user_error(done, "d.npz holds 0 examples")


def test_a_negative_seed_is_refused(cli, default_profile, tmp_path):
    done = cli("train", "--out", tmp_path / "run", "--profile", default_profile[1],
               "--seed", "-1", *QUICK_TRAIN)  # fmt: skip
    assert_user_error(done, "'--seed': -1 is not in the range x>=0", code=2)


# ---- resource limits: bounded, or refused in one line before anything is allocated ----------


def test_threads_beyond_the_cpus_are_bounded(default_model_path, tmp_path):
    env = {"ETGRAPH_CACHE": str(tmp_path / "cache")}
    args = ("profile", default_model_path, "-o", tmp_path / "p.json", "--repeats", "1")
    done = run_cli(*args, "--threads", "100000", env=env)
    assert done.returncode == 0, done.stderr
    cpus = len(os.sched_getaffinity(0))
    assert f"100000 threads asked for, {cpus} CPUs to run them on: using {cpus}" in done.stderr
    assert json.loads((tmp_path / "p.json").read_text())["threads"] == cpus


def test_probe_batches_beyond_the_data_are_refused(cli, default_profile, tmp_path):
    done = cli("train", "--out", tmp_path / "run", "--profile", default_profile[1],
               "--probe-batches", "100000", *QUICK_TRAIN)  # fmt: skip
    assert_user_error(done, "--probe-batches 100000 is more than the", "pass at most")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", ["train", "compile", "profile"])
def test_an_input_shape_too_big_for_memory_is_refused_before_allocating(
    cli, default_model_path, tmp_path, command
):
    # 4 x 3 x 60000 x 60000 float32: the input alone is 161 GiB (numpy's allocation fails at
    # once on any machine: this test never takes the memory)
    out = {"train": ["--out"], "compile": ["-o"], "profile": [default_model_path, "-o"]}
    done = cli(command, *out[command], tmp_path / "out", "--input-shape", "3x60000x60000")
    assert_user_error(done, "input shape input=3x60000x60000 at batch 4 needs at least", "GiB")


def limited(resource_id: int, limit: int):
    """``preexec_fn`` setting ``resource_id``'s soft and hard limits in the child."""
    import resource

    return lambda: resource.setrlimit(resource_id, (limit, limit))


# 700 MiB: torch's import aborted the process; 200 MiB: importing the CLI's own libraries
# raised MemoryError before its error handling existed
@pytest.mark.parametrize("limit_mib", [200, 700])
def test_an_address_space_limit_too_low_to_load_is_one_line(tmp_path, limit_mib):
    import resource

    done = subprocess.run(
        [sys.executable, "-m", "etgraph", "train", "--out", tmp_path / "run", "--epochs", "1"],
        capture_output=True,
        text=True,
        preexec_fn=limited(resource.RLIMIT_AS, limit_mib * 2**20),
    )
    assert_user_error(done, f"address-space limit (ulimit -v) is {limit_mib} MiB", "raise it")


def test_out_of_memory_and_disk_inside_libraries_are_recognised():
    from etgraph.errors import ResourceError, resource_error

    ort_save = RuntimeError(
        "checkpoint.cc:231 ToFile Failed to save checkpoint to file: /x/.checkpoint.h9. "
        "error:No space left on device errno:28"
    )
    assert "no room to write" in str(resource_error(ort_save))
    full = OSError(28, "No space left on device", "/x/model.onnx")
    assert "no room to write /x/model.onnx" in str(resource_error(full))
    threads = RuntimeError(
        "pthread_create failed, error code: 12 error msg: Cannot allocate memory"
    )
    assert str(resource_error(threads)).startswith("out of memory")
    wrapped = ValueError("build failed")
    wrapped.__cause__ = MemoryError()
    assert isinstance(resource_error(wrapped), ResourceError)
    assert resource_error(ValueError("a bug")) is None


def test_a_file_size_limit_during_compile_keeps_the_last_compile(compiled, cache_env, tmp_path):
    import resource

    out = tmp_path / "c"
    shutil.copytree(compiled, out)
    before = files_of(out)
    done = subprocess.run(
        [sys.executable, "-m", "etgraph", "compile", "-o", out, "--repeats", "1", "--rho", "0.7"],
        capture_output=True,
        text=True,
        env={**os.environ, **cache_env},
        preexec_fn=limited(resource.RLIMIT_FSIZE, 300_000),  # model.onnx is 485 KB
    )
    assert_user_error(done, "no room to write", "File too large")
    assert files_of(out) == before


@pytest.fixture
def small_disk(tmp_path):
    """A 2.5 MiB tmpfs (root only), grown with ``small_disk.grow()``: the default model's run
    writes 0.6 MB of artifacts and 1.2 MB per checkpoint, so its second checkpoint fills it
    (a session's transient checkpoint goes to RAM, :func:`etgraph.files.transient_file`)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2560k", "tmpfs", mount])
    if done.returncode != 0:
        pytest.skip("mounting a tmpfs needs root")

    class Disk:
        path = mount

        @staticmethod
        def grow():
            subprocess.run(["mount", "-o", "remount,size=20m", mount], check=True)

    yield Disk
    subprocess.run(["umount", mount])


@pytest.mark.slow  # real training
def test_a_full_disk_during_training_loses_nothing(small_disk, default_profile, cache_env):
    out = small_disk.path / "run"
    args = ["--epochs", "2", "--period", "1", "--max-steps-per-epoch", "2"]
    train = ["train", "--out", out, "--profile", default_profile[1], *args, "--quiet"]
    done = run_cli(*train, "--max-val-batches", "1", env=cache_env)
    assert_user_error(done, "no room to write", f"etgraph train --resume {out}")
    # where the disk fills depends on the artifacts of the selections (measured times): most
    # often in period 2, with epoch 1's checkpoint written
    checkpointed = (out / "checkpoint").is_file()
    small_disk.grow()
    done = run_cli("train", "--resume", out, env=cache_env)
    assert done.returncode == 0, done.stderr
    if checkpointed:  # the run continues after it: nothing lost
        assert f"resuming {out} after epoch 1 of 2" in done.stdout + done.stderr
    assert [r["epoch"] for r in map(json.loads, (out / "log.jsonl").open())] == [1, 2]
    assert (out / "model_trained.onnx").is_file()
