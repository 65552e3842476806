"""`etgraph inspect` through a real subprocess."""

from __future__ import annotations

import shutil

from helpers import run_cli

from etgraph.dumps import read_graph
from etgraph.graph import charges


def test_inspect_model_then_compiled_dir(tiny_cnn_onnx, tmp_path):
    out = tmp_path / "dumps"
    proc = run_cli("inspect", str(tiny_cnn_onnx), "--out", str(out), "--render")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:5] == ["index", "name", "kind", "shape", "params"]
    assert lines[1].split()[:4] == ["0", "features.0.0.weight", "kernel", "16x3x3x3"]
    assert "fc.bias" in proc.stdout and "11 tensors" in proc.stdout
    for fmt in ("json", "graphml", "dot"):
        assert (out / f"graph.{fmt}").is_file()
    if shutil.which("dot"):
        assert (out / "graph.svg").is_file()
    else:
        assert "not rendered" in proc.stdout
    graph = read_graph(out / "graph.json")
    assert len(charges(graph)) == graph.graph["num_ops"]

    # a compiled directory (holding graph.json) is inspected without rebuilding
    proc = run_cli("inspect", str(out), "--format", "dot", "--out", str(tmp_path / "again"))
    assert proc.returncode == 0, proc.stderr
    assert lines[1] in proc.stdout
    assert (tmp_path / "again" / "graph.dot").is_file()
    assert not (tmp_path / "again" / "graph.json").exists()
    # its graph was built as compiled: a --loss for it would be silently ignored
    proc = run_cli("inspect", str(out), "--loss", "mse", "--out", str(tmp_path / "mse"))
    assert proc.returncode == 1 and "drop --loss" in proc.stderr
    assert not (tmp_path / "mse").exists()


def test_inspect_errors_are_one_line(tmp_path):
    proc = run_cli("inspect", str(tmp_path / "missing.onnx"))
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith("etgraph: error:")
    assert "missing.onnx" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1

    proc = run_cli("inspect", str(tmp_path))  # a directory without graph.json
    assert proc.returncode == 1 and "no graph.json" in proc.stderr

    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a model at all")
    proc = run_cli("inspect", str(junk))
    assert proc.returncode == 1 and "junk.onnx" in proc.stderr


def test_inspect_passes_prints_the_pipeline():
    proc = run_cli("inspect", "--passes")
    assert proc.returncode == 0, proc.stderr
    titles = [line for line in proc.stdout.splitlines() if not line.startswith(" ")]
    assert [title.split(" (")[0] for title in titles] == [
        "ONNX legalisation",
        "tensor-graph passes",
        "eval-model fix-ups",
        "training-model passes",
    ]
    sections = proc.stdout.split(titles[1])
    passes = [line.split(":")[0].strip() for line in sections[1].splitlines()[1:6]]
    assert passes == [
        "1. LinearizePass",
        "2. ConvDensePass",
        "3. BatchNormPass",
        "4. EmbeddingPass",
        "5. NonTrainablePass",
    ]
    assert "23. RefuseNoGradOpsPass: " in sections[0]
    assert "1. TrimEvalBatchNormPass: " in sections[1]


def test_inspect_without_target_is_a_usage_error():
    proc = run_cli("inspect")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "etgraph: error: Missing argument 'TARGET'. (see `etgraph inspect --help`)"
    )
