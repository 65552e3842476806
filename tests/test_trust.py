"""Trust at the edges (issue 26): what etgraph reads and writes, what survives a kill or a full
disk, what a resume checks, and inputs that used to end in an internal error.

Each test is written against the behaviour before the fix: it failed then (a file read through
a symlink, an output replacing its input, a traceback, a silently wrong picture, ...).
Commands run through the CLI's entry point in this process where that sees everything; signals,
locks held by another process, and resource limits need a real ``python -m etgraph``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import assert_user_error, make_model, random_initializer, run_cli_in_process
from onnx import external_data_helper, helper

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
