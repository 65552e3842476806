"""`etgraph inspect`: the tensor table, the graph dumps and its one-line errors."""

from __future__ import annotations

import shutil

import pytest
from helpers import run_cli_in_process

from etgraph.dumps import read_graph
from etgraph.graph import charges


@pytest.mark.slow  # builds the tensor graph with ORT (seconds)
def test_inspect_model_then_compiled_dir(tiny_cnn_onnx, tmp_path):
    out = tmp_path / "dumps"
    proc = run_cli_in_process("inspect", str(tiny_cnn_onnx), "--out", str(out), "--render")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:5] == ["index", "name", "kind", "shape", "params"]
    assert lines[1].split()[:4] == ["0", "features.0.0.weight", "kernel", "16x3x3x3"]
    assert "fc.bias" in proc.stdout and "11 tensors" in proc.stdout
    for fmt in ("json", "graphml", "dot"):
        assert (out / f"graph.{fmt}").is_file()
    if shutil.which("dot"):
        assert (out / "graph.svg").is_file()
    else:  # the tensor chain, drawn with matplotlib
        assert "chain.png" in proc.stdout and (out / "chain.png").stat().st_size > 1000
    graph = read_graph(out / "graph.json")
    assert len(charges(graph)) == graph.graph["num_ops"]

    # a compiled directory (holding graph.json) is inspected without rebuilding
    proc = run_cli_in_process(
        "inspect", str(out), "--format", "dot", "--out", str(tmp_path / "again")
    )
    assert proc.returncode == 0, proc.stderr
    assert lines[1] in proc.stdout
    assert (tmp_path / "again" / "graph.dot").is_file()
    assert not (tmp_path / "again" / "graph.json").exists()
    # its graph was built as compiled: a --loss for it would be silently ignored
    proc = run_cli_in_process("inspect", str(out), "--loss", "mse", "--out", str(tmp_path / "mse"))
    assert proc.returncode == 1 and "drop --loss" in proc.stderr
    assert not (tmp_path / "mse").exists()


def test_inspect_errors_are_one_line(tmp_path):
    proc = run_cli_in_process("inspect", str(tmp_path / "missing.onnx"))
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith("etgraph: error:")
    assert "missing.onnx" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1

    proc = run_cli_in_process("inspect", str(tmp_path))  # a directory without graph.json
    assert proc.returncode == 1 and "no graph.json" in proc.stderr

    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a model at all")
    proc = run_cli_in_process("inspect", str(junk))
    assert proc.returncode == 1 and "junk.onnx" in proc.stderr


def test_inspect_passes_prints_the_pipeline():
    proc = run_cli_in_process("inspect", "--passes")
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
    legalisation = [line.strip() for line in sections[0].splitlines()[1:]]
    assert legalisation[-2].split(". ")[1].startswith("RefuseNoGradOpsPass: ")  # refuses, then
    assert legalisation[-1].split(". ")[1].startswith("ScaleHeadLrPass: ")  # --head-lr-scale
    assert ":data:" not in proc.stdout and ":func:" not in proc.stdout  # plain text
    assert "1. TrimEvalBatchNormPass: " in sections[1]


def test_inspect_without_target_is_a_usage_error():
    proc = run_cli_in_process("inspect")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "etgraph: error: Missing argument 'TARGET'. (see `etgraph inspect --help`)"
    )


def test_pictures_name_tensors_and_keep_one_colour_per_series(tmp_path):
    """selection.png names the tensors (their layer groups on a large model); curves.png draws
    validation and training in the same colour in both panels."""
    from matplotlib.figure import Figure

    from etgraph import plots

    ax = Figure().subplots()
    plots._name_ticks(ax, ["a.weight", "a.bias", "b.weight"], 3)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a.weight", "a.bias", "b.weight"]
    names = [f"layer{i // 2}.{'weight' if i % 2 == 0 else 'bias'}" for i in range(100)]
    ax = Figure().subplots()
    plots._name_ticks(ax, names, 100)
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels[:2] == ["layer0", "layer1"] and len(labels) == 50  # a name per layer
    records = [
        {
            "cumulative_wall_time_s": t,
            "val_acc": 0.5,
            "train_acc": 0.4,
            "train_loss": 1.0,
            "val_loss": 1.1,
        }  # fmt: skip
        for t in (1.0, 2.0)
    ]
    drawn = []
    real = plots._figure

    def spy(size):
        drawn.append(real(size))
        return drawn[-1]

    plots._figure, saved = spy, plots._figure
    try:
        plots.plot_curves(records, tmp_path / "curves.png")
    finally:
        plots._figure = saved
    colours = [
        {line.get_label(): line.get_color() for line in ax.get_lines()} for ax in drawn[0].axes
    ]
    assert colours[0] == colours[1] and colours[0]["validation"] != colours[0]["training"]


def test_selection_picture_has_room_for_long_tensor_names(tmp_path):
    """A transformer's tensor names on a two-epoch run: matplotlib warned it could not lay the
    figure out (the names, written upwards, were taller than the figure)."""
    import warnings

    from etgraph import plots

    names = [f"encoder.layer.{i}.attention.output.LayerNorm.weight" for i in range(12)]
    records = [{"epoch": e, "selection": [1, 2], "n_tensors": len(names)} for e in (1, 2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plots.plot_selection(records, tmp_path / "selection.png", names=names)
