"""The CLI's entry point: version, help, and how an internal error (a bug) is reported."""

from __future__ import annotations

import subprocess
import sys

import click
import networkx as nx
import pytest
from helpers import run_cli

from etgraph import __version__, graph
from etgraph import cli as cli_module
from passes import tensor_graph_pipeline
from passes.base import run_passes


def test_version_and_help():
    out = run_cli("--version")
    assert out.returncode == 0
    assert __version__ in out.stdout
    out = run_cli("--help")
    assert out.returncode == 0
    assert "Usage" in out.stdout


def test_bare_command_prints_its_help_not_an_error():
    out = run_cli()
    assert out.returncode == 2 and out.stdout.startswith("Usage: etgraph") and not out.stderr


def test_a_typo_is_answered_before_the_heavy_imports(tmp_path):
    """A missing model or --out, or an option out of its range, is refused before onnxruntime,
    torch or onnx_ir is imported (seconds each on a small board): one process runs the
    commands, then lists what it holds."""
    nope, out = str(tmp_path / "nope.onnx"), str(tmp_path / "out")
    commands = [  # (argv, exit code, what the line says)
        (["compile", nope, "-o", out], 1, "no such model file"),
        (["profile", nope], 1, "no such model file"),
        (["inspect", nope], 1, "no such model file"),
        (["train", nope, "-o", out], 1, "no such model file"),
        (["train", "--epochs", "1"], 1, "missing --out"),
        (["federate", nope, "--round-deadline", "30s", "-o", out], 1, "no such model file"),
        (["train", "--epochs", "0", "-o", out], 2, "'--epochs': 0 is not in the range x>=1"),
        (["train", "--rho", "2", "-o", out], 2, "'--rho': 2.0 is not in the range 0.0<x<=1.0"),
        (["compile", nope, "--batch-size", "0"], 2, "'--batch-size': 0 is not in the range x>=1"),
        (["federate", "--rounds", "0", "-o", out], 2, "'--rounds': 0 is not in the range x>=1"),
    ]
    script = f"""
import contextlib, io, sys
from etgraph.cli import main
for argv in {[argv for argv, _, _ in commands]!r}:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            main(argv)
    except SystemExit as exc:
        print(exc.code, err.getvalue().strip())
print(sorted(m for m in ("onnxruntime", "torch", "onnx_ir", "onnxscript") if m in sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    *errors, imported = done.stdout.strip().splitlines()
    assert len(errors) == len(commands), done.stdout + done.stderr
    for line, (_, code, fragment) in zip(errors, commands, strict=True):
        assert line.startswith(f"{code} etgraph: error: "), line
        assert fragment in line, line
    assert imported == "[]"


def test_interrupted_train_says_how_to_continue(monkeypatch, capsys, tmp_path):
    """Ctrl-C (click's Abort) in `etgraph train`: exit 130 and the --resume command once the
    run has started (its run.json written); before that, no command."""

    def interrupted(*_, **__):
        raise click.exceptions.Abort

    from etgraph import cli_train

    monkeypatch.setattr(cli_train, "_train_model", interrupted)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text("{}")
    with pytest.raises(SystemExit, match="130"):
        cli_module.main(["train", "--out", str(tmp_path / "run"), "--epochs", "1"])
    assert capsys.readouterr().err.strip() == (
        "etgraph: interrupted: continue from the last checkpoint with "
        f"`etgraph train --resume {tmp_path / 'run'}`"
    )
    assert cli_module._resume_hint(["compile", "-o", "x"]) == ""
    run = tmp_path / "run"
    assert cli_module._resume_hint(["train", f"--resume={run}"]).endswith(f"--resume {run}`")
    assert cli_module._resume_hint(["train", "--out", str(tmp_path / "not-started")]) == ""
    # -o, the short option (was: no hint), and etgraph federate's runs (was: train's only)
    assert cli_module._resume_hint(["train", "-o", str(run)]).endswith(f"train --resume {run}`")
    assert cli_module._resume_hint(["train", f"-o{run}"]).endswith(f"train --resume {run}`")
    assert cli_module._resume_hint(["federate", "-o", str(run)]).endswith(
        f"`etgraph federate --resume {run}`"
    )


def test_internal_error_names_the_innermost_cause(monkeypatch, capsys, tmp_path):
    """A failed precondition inside onnx_ir's PassManager (wrapped twice in PassError) is an
    internal error: exit 3, one line naming the PreconditionError and its message."""

    def broken_build(target, **_):
        g = nx.DiGraph()
        g.add_node("t:a", node_type="tensor", index=3, name="a")
        run_passes(tensor_graph_pipeline(), g)

    monkeypatch.setattr(graph, "load_tensor_graph", broken_build)
    model = tmp_path / "x.onnx"
    model.write_bytes(b"")  # never read: the graph build above fails first
    with pytest.raises(SystemExit, match="3"):
        cli_module.main(["inspect", str(model)])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("etgraph: internal error: PreconditionError: tensor indices must be")
    assert "PassError" not in err[0] and "--debug" in err[0]


def test_internal_error_names_a_wrapped_cause_and_its_wrapper(monkeypatch, capsys, tmp_path):
    """A check that fails with an unexpected exception is wrapped by onnx_ir in a
    PreconditionError: both are named."""

    def broken_build(target, **_):
        g = nx.DiGraph()
        g.add_node("t:a", node_type="tensor", name="a")  # no index: KeyError in requires
        run_passes(tensor_graph_pipeline(), g)

    monkeypatch.setattr(graph, "load_tensor_graph", broken_build)
    model = tmp_path / "x.onnx"
    model.write_bytes(b"")  # never read: the graph build above fails first
    with pytest.raises(SystemExit, match="3"):
        cli_module.main(["inspect", str(model)])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert (
        "internal error: PreconditionError: Pre-condition for pass 'LinearizePass' failed: "
        "KeyError: 'index'" in err[0]
    )
