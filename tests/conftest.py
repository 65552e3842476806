"""Shared fixtures (helpers that are not fixtures are in ``helpers.py``).

* small zoo models exported once per test session (seconds each): each ``*_onnx`` fixture
  returns the path of a training-ready ONNX file (input ``input`` ``float32 [B, 3, 32, 32]``,
  output ``logits`` ``float32 [B, 10]``, dynamic batch axis) written by
  :func:`models.export.export_onnx` into a session temporary directory;
* the embedded default model, loaded once, and one real (short) profile of it;
* ``cache_env``: an environment with a private ``ETGRAPH_CACHE`` for CLI subprocesses.

Tests marked ``slow`` run real training, profiling or kill/resume cycles:
``python -m pytest -q -m "not slow"`` is the fast subset.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from etgraph.data import DEFAULT_MODEL_PATH
from etgraph.model import LoadedModel
from etgraph.profile import Profile
from etgraph.profiler import profile_model

SMALL_INPUT_SHAPE = (3, 32, 32)
SMALL_NUM_CLASSES = 10


def _export(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    from models.export import export_onnx

    out = tmp_path_factory.mktemp("zoo") / f"{name}.onnx"
    return export_onnx(
        name, out, input_shape=SMALL_INPUT_SHAPE, num_classes=SMALL_NUM_CLASSES, seed=0
    )


@pytest.fixture(scope="session")
def tiny_cnn_onnx(tmp_path_factory) -> Path:
    """tiny_cnn: 3 conv-BN-ReLU blocks, global average pool, Gemm head (3x32x32 -> 10)."""
    return _export(tmp_path_factory, "tiny_cnn")


@pytest.fixture(scope="session")
def resnet18s_onnx(tmp_path_factory) -> Path:
    """resnet18s: narrow ResNet-18 layout with residual Adds and downsample branches."""
    return _export(tmp_path_factory, "resnet18s")


@pytest.fixture(scope="session")
def tiny_vit_onnx(tmp_path_factory) -> Path:
    """tiny_vit: patch 8, width 64, 2 encoder blocks, 2 heads (LayerNorm, MatMul, Softmax)."""
    return _export(tmp_path_factory, "tiny_vit")


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The embedded pretrained default model (``etgraph/assets/default_model.onnx``)."""
    assert DEFAULT_MODEL_PATH.is_file(), (
        f"{DEFAULT_MODEL_PATH} missing: run models/pretrain_default.py"
    )
    return DEFAULT_MODEL_PATH


@pytest.fixture(scope="session")
def default_model(default_model_path) -> LoadedModel:
    """The embedded default model, loaded and legalised once."""
    return LoadedModel.load(default_model_path)


@pytest.fixture(scope="session")
def default_profile(tmp_path_factory, default_model) -> tuple[Profile, Path]:
    """A real (short: 2 repeats, 1 warm-up) profile of the default model at batch 4, and the
    path of its JSON."""
    root = tmp_path_factory.mktemp("default-profile")
    prof = profile_model(default_model, batch_size=4, repeats=2, warmup=1, cache_dir=root)
    return prof, prof.save(root / "profile.json")


@pytest.fixture(scope="session")
def cache_env(tmp_path_factory) -> dict[str, str]:
    """Environment entries for CLI subprocesses: a private profile cache for the session."""
    return {"ETGRAPH_CACHE": str(tmp_path_factory.mktemp("etgraph-cache"))}
