"""Check that every zoo model exports, builds ORT training artifacts and trains one step.

For each model (the paper's four and the small ones), in a fresh subprocess so peak RSS is per
model: export to ONNX at ``--input-size`` (default 128 px; the paper uses 224), generate
onnxruntime-training artifacts with ALL tensors trainable (every float initializer except
BatchNorm running mean/var, which go to ``frozen_params``), create the training session, and
run ``--steps`` training steps at ``--batch-size`` (paper: 4). Prints a markdown table:

    model | input | params | trainable tensors | export s | artifacts s | session s |
    step ms | peak RSS MB

``step ms`` is the median over the measured steps (forward + backward + AdamW + grad reset),
after one warm-up step. Usage::

    python benchmarks/zoo_check.py                       # all models, 128 px
    python benchmarks/zoo_check.py --models resnet50 --input-size 224
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_MODELS = (
    "tiny_cnn",
    "tiny_vit",
    "resnet18s",
    "default_cnn",
    "mobilenet_v2",
    "resnet50",
    "vgg16",
    "vit_b16",
)


def check_one(name: str, input_size: int, num_classes: int, batch_size: int, steps: int) -> dict:
    """Export, generate artifacts, train; returns the measurements of one model."""
    import numpy as np
    import onnx

    from etgraph import artifacts, ort_options
    from models import zoo
    from models.export import export_onnx

    with tempfile.TemporaryDirectory(prefix=f"zoo_check_{name}_") as tmp:
        t0 = time.perf_counter()
        path = export_onnx(
            name, Path(tmp) / f"{name}.onnx", input_shape=(3, input_size, input_size),
            num_classes=num_classes,
        )  # fmt: skip
        export_s = time.perf_counter() - t0
        model = onnx.load(str(path))
        running = {
            n.input[i]
            for n in model.graph.node
            if n.op_type == "BatchNormalization"
            for i in (3, 4)
        }
        floats = [i.name for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT]
        requires_grad = [n for n in floats if n not in running]
        frozen = [n for n in floats if n in running]
        n_params = sum(
            int(np.prod(i.dims)) for i in model.graph.initializer if i.name in set(requires_grad)
        )
        t0 = time.perf_counter()
        paths = artifacts.generate(model, requires_grad, frozen, Path(tmp) / "artifacts")
        artifacts_s = time.perf_counter() - t0
        del model

        from onnxruntime.training import api

        t0 = time.perf_counter()
        state = api.CheckpointState.load_checkpoint(str(paths.checkpoint))
        module = api.Module(
            str(paths.training_model),
            state,
            str(paths.eval_model),
            session_options=ort_options.session_options(None),  # as etgraph trains
        )
        optimizer = api.Optimizer(str(paths.optimizer_model), module)
        session_s = time.perf_counter() - t0
        rng = np.random.default_rng(0)
        x = rng.standard_normal((batch_size, 3, input_size, input_size)).astype(np.float32)
        y = rng.integers(0, num_classes, batch_size).astype(np.int64)
        module.train()
        step_ms, losses = [], []
        for _ in range(steps + 1):
            t0 = time.perf_counter()
            out = module(x, y)
            optimizer.step()
            module.lazy_reset_grad()
            step_ms.append((time.perf_counter() - t0) * 1e3)
            losses.append(float(np.asarray(out[0] if isinstance(out, (tuple, list)) else out)))
        if not np.all(np.isfinite(losses)):
            raise RuntimeError(f"{name}: non-finite loss {losses}")
        return {
            "model": name,
            "paper_model": name in zoo.PAPER_MODELS,
            "input": input_size,
            "params": n_params,
            "trainable_tensors": len(requires_grad),
            "frozen_tensors": len(frozen),
            "export_s": export_s,
            "artifacts_s": artifacts_s,
            "session_s": session_s,
            "step_ms": float(np.median(step_ms[1:])),
            "loss": losses[-1],
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }


def format_table(rows: list[dict]) -> str:
    head = (
        "| model | input | params | trainable tensors | export s | artifacts s | session s "
        "| step ms | peak RSS MB |\n|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['input']} | failed: {r['error']} ||||||| |")
            continue
        lines.append(
            f"| {r['model']} | {r['input']} | {r['params'] / 1e6:.2f}M | {r['trainable_tensors']} "
            f"| {r['export_s']:.1f} | {r['artifacts_s']:.1f} | {r['session_s']:.2f} "
            f"| {r['step_ms']:.1f} | {r['peak_rss_mb']:.0f} |"
        )
    return "\n".join(lines)


@click.command()
@click.option("--models", "names", default=",".join(DEFAULT_MODELS), show_default=True,
              help="Comma-separated zoo names.")  # fmt: skip
@click.option("--input-size", default=128, show_default=True, help="Input height = width (px).")
@click.option("--num-classes", default=10, show_default=True)
@click.option("--batch-size", default=4, show_default=True)
@click.option("--steps", default=3, show_default=True, help="Measured steps after one warm-up.")
@click.option("--timeout-s", default=900, show_default=True, help="Per-model time limit.")
@click.option("--json-out", type=click.Path(dir_okay=False), help="Also write rows as JSON.")
@click.option("--single", hidden=True, help="Internal: check one model in this process.")
def main(names, input_size, num_classes, batch_size, steps, timeout_s, json_out, single):
    """Export + artifacts + training steps for zoo models; prints a markdown table."""
    if single:
        row = check_one(single, input_size, num_classes, batch_size, steps)
        click.echo("ROW " + json.dumps(row))
        return
    rows = []
    for name in [n.strip() for n in names.split(",") if n.strip()]:
        cmd = [sys.executable, __file__, "--single", name, "--input-size", str(input_size)]
        cmd += ["--num-classes", str(num_classes), "--batch-size", str(batch_size)]
        cmd += ["--steps", str(steps)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            found = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
            if proc.returncode == 0 and found:
                rows.append(json.loads(found[-1][4:]))
            else:
                err = (proc.stderr.strip().splitlines() or ["no output"])[-1][:120]
                rows.append({"model": name, "input": input_size, "error": err})
        except subprocess.TimeoutExpired:
            rows.append({"model": name, "input": input_size, "error": f"timeout {timeout_s}s"})
        click.echo(format_table(rows[-1:]).splitlines()[-1], err=True)
    click.echo(format_table(rows))
    if json_out:
        Path(json_out).write_text(json.dumps(rows, indent=2) + "\n")
    if any("error" in r for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
