"""etgraph's training step vs PyTorch eager training exactly the same tensors (issue #16).

For each model (the paper's four, ``--size`` px, default 128) and two selections -- ``full``
(every trainable tensor) and ``dp`` (the tensors ``etgraph compile --rho 0.5`` selects, read
from its ``plan.json``) -- time one training step on both sides, round robin in one process:

- etgraph: ORT training artifacts from :class:`etgraph.artifacts.ArtifactCache` for the
  selection, :class:`etgraph.sessions.TrainingSession` (the "train" role's session options,
  ``--threads`` intra-op threads), ``train_step(x, y, 1e-4)`` = forward + backward + AdamW +
  gradient reset. Two etgraph sides on the same artifacts and checkpoint: ``etgraph`` (what
  training runs: the frozen parameters baked into the graphs as constants,
  :func:`etgraph.artifact_weights.bake_frozen`) and ``generated`` (the artifacts as
  ``generate_artifacts`` wrote them, ``bake=False``; skipped with ``--no-generated``), so the
  effect of the rewrite is measured in the same round robin.
- torch: the very module the ONNX was exported from (``models.zoo.build`` with seed 0, exported
  with ``models.export.export_onnx(module, ...)``), ``requires_grad`` True on exactly the
  selected tensors (matched by name: the ONNX initializer names are the torch parameter names;
  checked, values included), ``torch.optim.AdamW(lr=1e-4, weight_decay=0.01)`` over them,
  train mode, cross-entropy; a step = zero_grad + forward + loss + backward + optimizer step.
  ``torch.set_num_threads(--threads)``.

Batch-norm mode: with ``--frozen-bn train`` (default) every batch norm uses batch statistics on
both sides (torch train mode). With ``--frozen-bn inference`` (what ``etgraph compile`` plans by
default) batch norms whose gamma and beta are both unselected run on running statistics on both
sides (their torch modules put in eval mode).

Both sides get the same random batch. After ``--warmup`` steps each, ``--rounds`` rounds
alternate ``--steps`` steps of each side (the order reverses every round).
Reported: the median step ms per side over all measured steps (wall clock, and the process's
CPU time, which a loaded machine inflates far less: both sides' idle threads sleep), the ratio
etgraph / torch, and
the 1-minute load average before and after each model. Prints a markdown table and writes
``benchmarks/results/vs_torch.json`` (entries of other models already in it are kept).

On a loaded machine run it with ``OMP_WAIT_POLICY=PASSIVE`` (recorded in the JSON): torch's
OpenMP threads otherwise spin at every barrier, and with more runnable threads than cores a
MobileNetV2 step took 1.7-21 s instead of 0.35-0.42 s (load 15); etgraph's sessions run with
thread-pool spinning off, the same policy.

Usage::

    python benchmarks/vs_torch.py                               # all four, 128 px
    python benchmarks/vs_torch.py --models mobilenet_v2,resnet50 --rounds 5 --steps 20
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PAPER_MODELS = ("resnet50", "vgg16", "mobilenet_v2", "vit_b16")
NUM_CLASSES = 10
LR = 1e-4
WEIGHT_DECAY = 0.01
SEED = 0


def _models(values: tuple[str, ...]) -> list[str]:
    names = [n.strip() for v in values for n in v.split(",") if n.strip()]
    return names or list(PAPER_MODELS)


def _load1() -> float:
    return round(os.getloadavg()[0], 2)


def compiled_plan(name: str, size: int, work: Path, rho: float, batch: int, threads: int):
    """Export (unless done) and ``etgraph compile`` (unless done); returns (onnx, plan)."""
    from models import zoo
    from models.export import export_onnx

    d = work / f"{name}-{size}"
    onnx_path = d / "model.onnx"
    if not onnx_path.exists():
        module = zoo.build(name, NUM_CLASSES, input_size=size, seed=SEED)
        export_onnx(module, onnx_path, input_shape=(3, size, size), num_classes=NUM_CLASSES)
    out = d / f"compiled-rho{rho}-b{batch}-t{threads}"
    if not (out / "plan.json").exists():
        cmd = [sys.executable, "-m", "etgraph", "compile", str(onnx_path), "-o", str(out)]
        cmd += ["--rho", str(rho), "--batch-size", str(batch), "--threads", str(threads)]
        cmd += ["--input-shape", f"3x{size}x{size}"]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=ROOT)
        click.echo(f"  compiled {name} in {time.perf_counter() - t0:.0f} s", err=True)
    return onnx_path, json.loads((out / "plan.json").read_text())


def check_mapping(module, model) -> dict:
    """Every trainable ONNX tensor is a torch parameter of the same name, shape and value, and
    every torch parameter is one of them. Returns a summary; raises on a mismatch."""
    from onnx import numpy_helper

    params = dict(module.named_parameters())
    values = {i.name: i for i in model.proto.graph.initializer}
    missing = [n for n in model.names if n not in params]
    extra = [n for n in params if n not in set(model.names)]
    if missing or extra:
        raise RuntimeError(f"name mapping: not in torch {missing[:5]}, not in ONNX {extra[:5]}")
    worst = 0.0
    for n in model.names:
        a = numpy_helper.to_array(values[n])
        b = params[n].detach().numpy()
        if a.shape != b.shape:
            raise RuntimeError(f"{n}: ONNX shape {a.shape} != torch shape {b.shape}")
        worst = max(worst, float(np.abs(a - b).max()) if a.size else 0.0)
    if worst > 0:
        raise RuntimeError(f"ONNX and torch weights differ (max |diff| {worst})")
    return {"tensors": len(model.names), "max_abs_diff": worst}


class TorchSide:
    """The torch module trained on exactly ``selected`` (names); AdamW over them."""

    def __init__(self, module, selected: list[str], frozen_bn: str):
        import torch

        self.module = module
        chosen = set(selected)
        params = []
        for n, p in module.named_parameters():
            p.requires_grad_(n in chosen)
            if n in chosen:
                params.append(p)
        module.train()
        self.bn_eval = 0
        if frozen_bn == "inference":
            for m in module.modules():
                if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                    if not (m.weight.requires_grad or m.bias.requires_grad):
                        m.eval()
                        self.bn_eval += 1
        self.opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
        self.loss = torch.nn.CrossEntropyLoss()

    def step(self, x, y) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss(self.module(x), y)
        loss.backward()
        self.opt.step()
        return float(loss.detach())


def _timed(fn, n: int) -> list[tuple[float, float]]:
    """``n`` steps of ``fn``: (wall ms, process CPU ms) each."""
    out = []
    for _ in range(n):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        out.append(((time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3))
    return out


def run_model(name: str, size: int, opts: dict) -> list[dict]:
    import torch

    from etgraph.artifacts import ArtifactCache
    from etgraph.config_choice import TRAIN_CANDIDATES
    from etgraph.model import LoadedModel
    from etgraph.sessions import TrainingSession
    from models import zoo

    work, batch, threads = Path(opts["work_dir"]), opts["batch_size"], opts["threads"]
    onnx_path, plan = compiled_plan(name, size, work, opts["rho"], batch, threads)
    model = LoadedModel.load(onnx_path)
    module = zoo.build(name, NUM_CLASSES, input_size=size, seed=SEED)
    mapping = check_mapping(module, model)

    by_name = {t["name"]: t["selected"] for t in plan["tensors"]}
    if sorted(by_name) != sorted(model.names):
        raise RuntimeError(f"{name}: plan.json tensors differ from the model's")
    selections = {
        "full": np.ones(len(model.names), dtype=bool),
        f"dp rho={plan['rho']}": np.array([by_name[n] for n in model.names], dtype=bool),
    }

    rng = np.random.default_rng(SEED)
    x_np = rng.standard_normal((batch, 3, size, size), dtype=np.float32)
    y_np = rng.integers(0, NUM_CLASSES, size=batch).astype(np.int64)
    x_t, y_t = torch.from_numpy(x_np.copy()), torch.from_numpy(y_np.copy())
    cache = ArtifactCache(  # at the batch size, as etgraph.loop trains (static shapes)
        work / f"{name}-{size}" / "artifacts",
        static_batch=(batch, {model.input_names[0]: (3, size, size)}),
    )

    rows = []
    for label, mask in selections.items():
        selected, frozen = model.split(mask)
        paths, _ = cache.get(
            model.proto, selected, frozen, loss=model.task.loss, frozen_bn=opts["frozen_bn"]
        )
        sessions = {
            side: TrainingSession(
                paths.directory,
                paths.checkpoint,
                threads=threads,
                input_names=model.input_names,
                config=TRAIN_CANDIDATES[opts["spinning"]],
                bake=side == "etgraph",
            )
            for side in (("etgraph", "generated") if opts["generated"] else ("etgraph",))
        }
        tside = TorchSide(module, selected, opts["frozen_bn"])
        n_sel_params = sum(p.numel() for p in module.parameters() if p.requires_grad)

        steps = {side: (lambda s=s: s.train_step(x_np, y_np, LR)) for side, s in sessions.items()}
        steps["torch"] = lambda tside=tside: tside.step(x_t, y_t)
        load_before = _load1()
        for fn in steps.values():
            _timed(fn, opts["warmup"])
        times = {side: [] for side in steps}
        for r in range(opts["rounds"]):
            order = list(steps) if r % 2 == 0 else list(steps)[::-1]
            for side in order:
                times[side].extend(_timed(steps[side], opts["steps"]))
        load_after = _load1()
        wall = {side: [w for w, _ in v] for side, v in times.items()}
        cpu = {side: statistics.median(c for _, c in v) for side, v in times.items()}
        et, th = wall["etgraph"], wall["torch"]
        et_ms, th_ms = statistics.median(et), statistics.median(th)
        gen = wall.get("generated")
        gen_ms = statistics.median(gen) if gen else None
        gen_cpu = cpu.get("generated")
        rows.append(
            {
                "model": name,
                "input": size,
                "selection": label,
                "tensors": f"{int(mask.sum())}/{len(mask)}",
                "selected_params": n_sel_params,
                "frozen_bn": opts["frozen_bn"],
                "spinning": opts["spinning"],
                "torch_bn_eval": tside.bn_eval,
                "etgraph_ms": round(et_ms, 2),
                "torch_ms": round(th_ms, 2),
                "ratio": round(et_ms / th_ms, 3),
                "generated_ms": None if gen_ms is None else round(gen_ms, 2),
                "generated_ratio": None if gen_ms is None else round(gen_ms / th_ms, 3),
                "baked_over_generated": None if gen_ms is None else round(et_ms / gen_ms, 3),
                "etgraph_cpu_ms": round(cpu["etgraph"], 2),
                "torch_cpu_ms": round(cpu["torch"], 2),
                "cpu_ratio": round(cpu["etgraph"] / cpu["torch"], 3),
                "generated_cpu_ms": None if gen_cpu is None else round(gen_cpu, 2),
                "generated_cpu_ratio": None
                if gen_cpu is None
                else round(gen_cpu / cpu["torch"], 3),
                "etgraph_ms_iqr": [round(float(q), 2) for q in np.percentile(et, [25, 75])],
                "torch_ms_iqr": [round(float(q), 2) for q in np.percentile(th, [25, 75])],
                "load_before": load_before,
                "load_after": load_after,
                "plan_predicted_step_ms": round(plan["predicted_step_us"] / 1e3, 2),
                "plan_full_step_ms": round(plan["t_full_us"] / 1e3, 2),
                "name_mapping": mapping,
                "command": "python benchmarks/vs_torch.py " + " ".join(sys.argv[1:]),
            }
        )
        generated = "" if gen_ms is None else f", generated {gen_ms:.1f} ms"
        click.echo(
            f"  {name} {label}: etgraph {et_ms:.1f} ms{generated}, torch {th_ms:.1f} ms "
            f"(x{et_ms / th_ms:.2f}); CPU etgraph {cpu['etgraph']:.1f}, torch {cpu['torch']:.1f} "
            f"(x{cpu['etgraph'] / cpu['torch']:.2f}); load {load_before} -> {load_after}",
            err=True,
        )
        del sessions, steps
    return rows


def table(rows: list[dict]) -> str:
    head = (
        "| model | selection | BN frozen | tensors | etgraph ms | generated ms | torch ms | "
        "etgraph/torch | generated/torch | CPU etgraph/torch | CPU generated/torch | "
        "load before | load after |"
    )
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        gen = "-" if r.get("generated_ms") is None else f"{r['generated_ms']:.1f}"
        gen_ratio = "-" if r.get("generated_ratio") is None else f"{r['generated_ratio']:.2f}"
        gen_cpu = r.get("generated_cpu_ratio")
        gen_cpu = "-" if gen_cpu is None else f"{gen_cpu:.2f}"
        lines.append(
            f"| {r['model']} | {r['selection']} | {r['frozen_bn']} | {r['tensors']} | "
            f"{r['etgraph_ms']:.1f} | {gen} | {r['torch_ms']:.1f} | {r['ratio']:.2f} | "
            f"{gen_ratio} | {r['cpu_ratio']:.2f} | {gen_cpu} | {r['load_before']} | "
            f"{r['load_after']} |"
        )
    return "\n".join(lines)


@click.command()
@click.option(
    "--models",
    "models",
    multiple=True,
    help="Models, repeatable or comma-separated [resnet50,vgg16,mobilenet_v2,vit_b16].",
)
@click.option("--size", default=128, show_default=True, help="Input height = width (px).")
@click.option("--batch-size", default=4, show_default=True)
@click.option("--threads", default=2, show_default=True, help="ORT and torch intra-op threads.")
@click.option("--rho", default=0.5, show_default=True, help="The DP selection's rho.")
@click.option("--rounds", default=5, show_default=True)
@click.option("--steps", default=20, show_default=True, help="Steps per side per round.")
@click.option("--warmup", default=3, show_default=True, help="Warm-up steps per side.")
@click.option(
    "--frozen-bn",
    type=click.Choice(["train", "inference"]),
    default="train",
    show_default=True,
    help="Mode of batch norms whose gamma and beta are frozen.",
)
@click.option(
    "--spinning",
    type=click.Choice(["off", "on", "on+stop"]),
    default="off",
    show_default=True,
    help="etgraph's session options (etgraph.config_choice.TRAIN_CANDIDATES; a run measures which "
    "to use: on wins on a quiet machine, off on a loaded one).",
)
@click.option(
    "--generated/--no-generated",
    default=True,
    show_default=True,
    help="Also time the artifacts as generated (frozen parameters as graph inputs).",
)
@click.option(
    "--work-dir",
    default="/tmp/vs_torch",
    show_default=True,
    help="ONNX exports, compiled plans and artifacts (reused).",
)
@click.option("--out", "out", default=str(ROOT / "benchmarks/results/vs_torch.json"),
              show_default=True)  # fmt: skip
def main(
    models, size, batch_size, threads, rho, rounds, steps, warmup, frozen_bn, spinning, generated,
    work_dir, out,
):  # fmt: skip
    """etgraph's training step vs PyTorch eager on the same trainable tensors."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(SEED)
    opts = dict(
        batch_size=batch_size, threads=threads, rho=rho, rounds=rounds, steps=steps,
        warmup=warmup, frozen_bn=frozen_bn, work_dir=work_dir, generated=generated,
        spinning=spinning,
    )  # fmt: skip
    rows = []
    for name in _models(models):
        click.echo(f"{name} ({size} px) ...", err=True)
        rows.extend(run_model(name, size, opts))
    click.echo(table(rows))
    out = Path(out)
    old = json.loads(out.read_text()) if out.exists() else {"runs": []}

    def key(r: dict) -> tuple:
        return r["model"], r["input"], r["selection"], r["frozen_bn"], r.get("spinning", "off")

    done = {key(r) for r in rows}
    kept = [r for r in old.get("runs", []) if key(r) not in done]
    meta = {
        "command": "python benchmarks/vs_torch.py " + " ".join(sys.argv[1:]),
        "batch_size": batch_size,
        "threads": threads,
        "rounds": rounds,
        "steps": steps,
        "warmup": warmup,
        "torch": torch.__version__,
        # torch's OpenMP threads spin at barriers unless OMP_WAIT_POLICY=PASSIVE (etgraph's
        # sessions run with spinning off): on a loaded machine the spinning costs torch 5-50x
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "load_avg": [round(v, 2) for v in os.getloadavg()],
        "cpu_count": os.cpu_count(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "runs": kept + rows}, indent=1) + "\n")
    click.echo(f"wrote {out}", err=True)


if __name__ == "__main__":
    main()
