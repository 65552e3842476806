"""Nothing lost (issue #8): a SIGKILL while the artifacts of a new selection are generated, or
while a checkpoint is written, leaves the last good checkpoint loadable, and resuming finishes
the run exactly like an uninterrupted one. (A kill during training: ``test_runtime.py``.)

Each test trains in a child process (``DRIVER`` below) that patches one write point so that the
process SIGKILLs itself at exactly that moment, after writing a marker file that proves the
point was reached. The profile is synthetic (uniform tensor costs) so that the selection is
a function of the importance alone: deterministic, and it changes at the second period (checked),
so that the second period really generates new artifacts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from etgraph.artifacts import ARTIFACT_FILES, ArtifactPaths
from etgraph.checkpoint import read_checkpoint
from etgraph.config import TrainConfig
from etgraph.loop import resume, train
from etgraph.model import LoadedModel
from etgraph.rundir import RUN_PROPERTY

# Every test here kills real training runs and resumes them.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
EPOCHS = 3
# period 1, 8 steps, 12 val batches: the subsample of the runtime tests. rho 0.7 admits 8 of the
# default model's 17 tensors; the importance then moves tensor 16 out and 13 in at period 1.
CONFIG = dict(
    epochs=EPOCHS,
    period=1,
    rho=0.7,
    strategy="elastic",
    max_steps_per_epoch=8,
    max_val_batches=12,
    closed_loop=False,  # selections from the synthetic profile alone, not from measured times
)

DRIVER = r'''
"""Train (etgraph.loop.train) and SIGKILL this process at one write point."""
import json, os, signal, sys
from pathlib import Path

point, out, marker, model, profile, config = sys.argv[1:7]
out, marker = Path(out), Path(marker)


def die(info):
    marker.write_text(json.dumps(info))
    os.kill(os.getpid(), signal.SIGKILL)


if point == "artifacts":
    # etgraph writes a re-selection's graphs (derived from the all-trainable ones) into a
    # temporary directory it renames into the cache once complete: die in between, with the
    # training graph cut short (half written).
    import onnx

    real_save = onnx.save

    def save(proto, f, *args, **kwargs):
        real_save(proto, f, *args, **kwargs)
        path = Path(f)
        temporary = path.parent.name.startswith(".")
        if path.name == "training_model.onnx" and temporary and (out / "checkpoint").exists():
            data = path.read_bytes()  # a re-selection (period >= 1), not the first one
            path.write_bytes(data[: len(data) // 2])
            die({"tmp": str(path.parent)})

    onnx.save = save
elif point == "checkpoint-tmp":
    # the second checkpoint (after epoch 2) is half written to its temporary file: die
    # before the rename.
    from onnxruntime.training.api import CheckpointState

    real_save = CheckpointState.save_checkpoint
    saves = []

    def save_checkpoint(state, uri, include_optimizer_state=False):
        real_save(state, uri, include_optimizer_state)
        if Path(uri).parent == out:  # the run's checkpoint (not a session's)
            saves.append(uri)
            if len(saves) == 2:
                data = Path(uri).read_bytes()
                Path(uri).write_bytes(data[: len(data) // 2])
                die({"tmp": str(uri)})

    CheckpointState.save_checkpoint = staticmethod(save_checkpoint)
elif point == "checkpoint-renamed":
    # the second checkpoint has just been renamed into place: die before anything else.
    real_replace = os.replace
    replaced = []

    def replace(src, dst, *args, **kwargs):
        real_replace(src, dst, *args, **kwargs)
        if Path(dst) == out / "checkpoint":
            replaced.append(dst)
            if len(replaced) == 2:
                die({"dst": str(dst)})

    os.replace = replace
else:
    raise SystemExit(f"unknown kill point {point}")

from etgraph.config import TrainConfig
from etgraph.loop import train
from etgraph.model import LoadedModel
from etgraph.profile import Profile

train(
    LoadedModel.load(model), Profile.load(profile), TrainConfig(**json.loads(config)), out,
    progress=False,
)
'''


@pytest.fixture(scope="module")
def synthetic_profile(tmp_path_factory, default_model_path):
    """A profile of the default model with uniform costs (100 µs per tensor, no dy, 1000 µs
    forward, 1 thread): no measurement noise, so the selections are reproducible."""
    import onnxruntime

    from etgraph.profile import Profile

    model = LoadedModel.load(default_model_path)
    n = len(model.tensors)
    prof = Profile(
        model_hash=model.hash,
        tensors=model.names,
        kinds=[t.kind for t in model.tensors],
        t_dw_us=np.full(n, 100.0),
        t_dy_us=np.zeros(n),
        forward_us=1000.0,
        measured_full_step_us=1000.0 + 100.0 * n,
        batch_size=4,
        input_shapes=model.input_shapes(),
        threads=1,
        ort_version=onnxruntime.__version__,
        host="synthetic",
    )
    return prof, prof.save(tmp_path_factory.mktemp("profile") / "profile.json")


@pytest.fixture(scope="module")
def straight(tmp_path_factory, default_model_path, synthetic_profile):
    """Log records of the uninterrupted run."""
    prof, _ = synthetic_profile
    out = tmp_path_factory.mktemp("straight") / "run"
    train(LoadedModel.load(default_model_path), prof, TrainConfig(**CONFIG), out, progress=False)
    records = _log(out)
    assert [r["epoch"] for r in records] == list(range(1, EPOCHS + 1))
    # the premise of the artifacts test: period 1 selects differently, so it needs new artifacts
    assert records[1]["selection"] != records[0]["selection"]
    assert records[1]["artifacts_cache_hit"] is False
    return records


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def _checkpoint_epoch(path: Path) -> int:
    _, _, props = read_checkpoint(path)
    return json.loads(props[RUN_PROPERTY])["epoch"]


def _killed_run(tmp_path, point, model_path, profile_json) -> tuple[Path, dict]:
    """Run the driver until it kills itself at ``point``; return the run dir and the marker."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    out, marker = tmp_path / "run", tmp_path / "killed.json"
    args = [str(out), str(marker), str(model_path), str(profile_json), json.dumps(CONFIG)]
    # The driver imports this checkout's etgraph (not whichever one is installed).
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, str(driver), point, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == -signal.SIGKILL, (
        f"the run was not killed at {point} (exit {proc.returncode}):\n{proc.stderr[-2000:]}"
    )
    assert marker.is_file(), "killed, but not at the patched write point"
    return out, json.loads(marker.read_text())


def _resume_and_compare(out: Path, straight: list[dict]) -> list[dict]:
    """Resume the killed run and check it ends like the uninterrupted one."""
    result = resume(out, progress=False)
    records = _log(out)
    assert [r["epoch"] for r in records] == list(range(1, EPOCHS + 1))  # each epoch once
    assert result.epochs == EPOCHS
    assert json.loads((out / "summary.json").read_text())["epochs"] == EPOCHS
    assert (out / "model_trained.onnx").is_file()
    assert _checkpoint_epoch(out / "checkpoint") == EPOCHS
    assert [r["selection"] for r in records] == [r["selection"] for r in straight]
    np.testing.assert_allclose(
        [r["val_loss"] for r in records], [r["val_loss"] for r in straight], rtol=1e-5
    )
    return records


def _complete_artifacts(directory: Path) -> bool:
    """The three graphs are there and parse, and the checkpoint reads where there is one (a
    selection's artifacts have none: the run writes the checkpoints its sessions start from)."""
    paths = ArtifactPaths(directory)
    if not paths.exists(checkpoint=False):
        return False
    try:
        for model in (paths.training_model, paths.eval_model, paths.optimizer_model):
            onnx.load(str(model))
        if paths.checkpoint.exists():
            read_checkpoint(paths.checkpoint)
    except Exception:  # a cut file: DecodeError, CheckpointError, ...
        return False
    return True


def test_sigkill_during_artifact_generation(
    tmp_path, default_model_path, synthetic_profile, straight
):
    _, profile_json = synthetic_profile
    out, marker = _killed_run(tmp_path, "artifacts", default_model_path, profile_json)

    # whatever the cache would hand out (a directory named by a key) is complete and loads
    cache = out / "artifacts"
    entries = [d for d in cache.iterdir() if not d.name.startswith(".")]
    for d in entries:
        assert _complete_artifacts(d), f"{d} is incomplete: {sorted(os.listdir(d))}"
    assert len(entries) == 2  # the importance (all tensors) and period-0 selections
    # the half-written set is still in its temporary directory ".<key>.<random>" (derive())
    tmp = Path(marker["tmp"])
    assert tmp.parent == cache and tmp.name.startswith(".")
    target = cache / tmp.name.split(".")[1]
    assert not target.exists()
    assert [r["epoch"] for r in _log(out)] == [1]  # killed at period 1's re-selection
    assert _checkpoint_epoch(out / "checkpoint") == 1  # the last good checkpoint loads

    records = _resume_and_compare(out, straight)
    assert not tmp.exists()  # resume removed the killed run's temporary directory
    assert records[1]["artifacts_cache_hit"] is False  # regenerated, not the killed leftovers
    assert _complete_artifacts(target)
    assert sorted(os.listdir(target)) == sorted(ARTIFACT_FILES[:3])  # the graphs only


@pytest.mark.parametrize("point", ["checkpoint-tmp", "checkpoint-renamed"])
def test_sigkill_during_checkpoint_write(
    tmp_path, point, default_model_path, synthetic_profile, straight
):
    _, profile_json = synthetic_profile
    out, marker = _killed_run(tmp_path, point, default_model_path, profile_json)

    assert [r["epoch"] for r in _log(out)] == [1, 2]  # killed at the checkpoint after epoch 2
    if point == "checkpoint-tmp":
        assert _checkpoint_epoch(out / "checkpoint") == 1  # the previous good checkpoint loads
        tmp = Path(marker["tmp"])  # the cut new one is a temporary file beside it
        assert tmp.parent == out and tmp.name.startswith(".") and tmp.is_file()
        assert tmp.stat().st_size < (out / "checkpoint").stat().st_size
    else:
        assert _checkpoint_epoch(out / "checkpoint") == 2  # the new one, complete

    _resume_and_compare(out, straight)
    if point == "checkpoint-tmp":
        assert not tmp.exists()  # resume removed the cut temporary file
