"""The compile-time time model against the artifacts `etgraph compile` emits, stepped by ORT's
documented loop with its default options (issue 31).

    python benchmarks/emitted_artifacts.py [--model mobilenet_v2] [--input-size 128]
                                           [--rhos 0.3,0.4,0.5,0.6,0.7] [--rounds 10] [--steps 8]
                                           [--repeats 3] [--options default,nospin,etgraph]
                                           [--suffix S]

The model (a zoo name exported at --input-size with 5 classes, or an .onnx file) is compiled
(``etgraph.pipeline.compile_model``, profile cached) at rho 1 (every tensor: the full step) and
at each of ``--rhos``. Each compiled directory's ``artifacts/`` (frozen parameters baked in,
``plan.json`` ``artifacts_form``) is stepped as a user's own loop would: ``CheckpointState``,
``Module`` and ``Optimizer`` with ORT's default ``SessionOptions``, ``module(x, y)``,
``optimizer.step()``, ``lazy_reset_grad()`` (``--options``: ``default``; ``nospin``, with
thread-pool spinning off, as etgraph's own loop runs on a shared machine; ``etgraph``, etgraph's
``TrainingSession`` on the same directory: the speed of etgraph's loop, printed against ORT's
loop with its defaults round by round) — round robin with the full artifacts, one session
alive at a time (opened, two untimed steps, ``--steps`` timed, released), ``--rounds`` rounds.
The measured ratio to the full step is the median over rounds of each round's median step over
the same round's full step (on the 2-core test machine one session's median step differed from
the next session's of the same artifacts by up to 1.5x under any options, so a round's ratio is
noisy and the rounds' interquartile range is printed beside it); it is compared with the plan's
predicted ratio (``predicted_step_us / t_full_us``). Each of ``--repeats`` compiles afresh (a
new profile: its noise is part of the time model's error). Results:
``benchmarks/results/emitted_artifacts_<model>_<size><suffix>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.training import api

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
#: How the artifacts are stepped: ORT's loop (:class:`_Loop`) or etgraph's session (:func:`_open`).
OPTIONS = {
    "default": "ORT's default options",
    "nospin": "spinning off",
    "etgraph": "etgraph's TrainingSession",
}
sys.path.insert(0, str(ROOT))

from etgraph.host import usable_threads  # noqa: E402
from etgraph.pipeline import compile_model  # noqa: E402
from etgraph.sessions import TrainingSession  # noqa: E402


class _Loop:
    """ORT's documented training loop on one artifacts directory, with ORT's default session
    options (``options`` "default") or those with thread-pool spinning off ("nospin", one
    line a user adds: ``session.intra_op.allow_spinning`` "0")."""

    def __init__(self, directory: Path, options: str = "default"):
        so = ort.SessionOptions()
        if options == "nospin":
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.state = api.CheckpointState.load_checkpoint(str(directory / "checkpoint"))
        self.module = api.Module(
            str(directory / "training_model.onnx"),
            self.state,
            str(directory / "eval_model.onnx"),
            session_options=so,
        )
        self.optimizer = api.Optimizer(str(directory / "optimizer_model.onnx"), self.module)
        self.module.train()

    def step(self, x, y) -> None:
        self.module(x, y)
        self.optimizer.step()
        self.module.lazy_reset_grad()


def _open(directory: Path, kind: str, input_name: str):
    """What steps ``directory`` under ``kind``: ORT's loop (:class:`_Loop`), or for "etgraph"
    etgraph's own ``TrainingSession`` (the train role's session options, the threads a run
    uses; the graphs are already baked)."""
    if kind != "etgraph":
        return _Loop(directory, kind)
    threads = usable_threads(os.cpu_count() or 1)
    return TrainingSession(
        directory, directory / "checkpoint", threads, bake=False, input_names=[input_name]
    )


def _timed_step(loop, x, y) -> float:
    t0 = time.perf_counter()
    loop.step(x, y)
    return time.perf_counter() - t0


def _measure(dirs: dict[float, Path], options: list[str], size: int, rounds: int, steps: int,
             input_name: str):  # fmt: skip
    """Each round, the median step (s) of every artifacts directory under every session
    options kind, by (kind, rho); one session alive at a time, the order reversed every round."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, size, size)).astype(np.float32)
    y = rng.integers(0, 5, 4).astype(np.int64)
    keys = [(kind, rho) for kind in options for rho in dirs]
    medians: dict[tuple, list[float]] = {key: [] for key in keys}
    for r in range(rounds):
        for kind, rho in keys if r % 2 == 0 else keys[::-1]:
            # one session alive at a time, as in a user's loop: an idle session's spinning
            # pool (ORT's default) takes the cores from the one stepping
            loop = _open(dirs[rho], kind, input_name)
            loop.step(x, y)
            loop.step(x, y)  # the first steps allocate
            times = [_timed_step(loop, x, y) for _ in range(steps)]
            medians[kind, rho].append(float(np.median(times)))
            del loop
    return medians


def _repeat(
    path: Path, work: Path, rhos: list[float], options: list[str], input_name: str, args
) -> dict:
    """Compile at rho 1 and at each of ``rhos`` (a fresh profile) and measure the artifacts
    under each session options kind."""
    plans, dirs = {}, {}
    for rho in [1.0, *rhos]:
        out = work / f"rho{rho}"
        compile_model(path, out, rho=rho, cache_dir=work / "cache")
        plans[rho] = json.loads((out / "plan.json").read_text())
        dirs[rho] = out / "artifacts"
    medians = _measure(dirs, options, args.input_size, args.rounds, args.steps, input_name)
    result = {"profiled_full_ms": plans[1.0]["t_full_us"] / 1e3, "options": {}}
    for kind in options:
        full = np.asarray(medians[kind, 1.0])
        rows = []
        for rho in rhos:
            plan = plans[rho]
            # the ratio measured side by side: each round's step over the same round's full one
            ratios = np.asarray(medians[kind, rho]) / full
            predicted = plan["predicted_step_us"] / plan["t_full_us"]
            measured = float(np.median(ratios))
            q1, q3 = np.percentile(ratios, [25, 75])
            rows.append({
                "rho": rho,
                "form": plan.get("artifacts_form", "inputs"),
                "selected": sum(t["selected"] for t in plan["tensors"]),
                "tensors": len(plan["tensors"]),
                "step_ms": 1e3 * float(np.median(medians[kind, rho])),
                "predicted_step_ms": plan["predicted_step_us"] / 1e3,
                "measured_ratio": measured,
                "ratio_iqr": [float(q1), float(q3)],
                "predicted_ratio": predicted,
                "error": abs(measured / predicted - 1.0),
            })  # fmt: skip
        errors = [row["error"] for row in rows]
        # each step against ORT's loop with its defaults on the same artifacts, same round
        versus = [
            v / d
            for rho in dirs
            for v, d in zip(medians[kind, rho], medians.get(("default", rho), []), strict=False)
        ]
        result["options"][kind] = {
            "vs_default": versus,
            "full_step_ms": 1e3 * float(np.median(full)),
            "full_step_ms_rounds": [1e3 * v for v in full],
            "rows": rows,
            "mean_error": float(np.mean(errors)),
            "max_error": float(np.max(errors)),
        }
    result["load_average"] = os.getloadavg()[0]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mobilenet_v2")
    ap.add_argument("--input-size", type=int, default=128)
    ap.add_argument("--rhos", default="0.3,0.4,0.5,0.6,0.7")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--options",
        default="default",
        help="comma-separated: default (ORT's loop, its options), nospin (spinning off), "
        "etgraph (etgraph's TrainingSession with its own options on the same artifacts)",
    )
    ap.add_argument("--suffix", default="", help="appended to the results file's name")
    args = ap.parse_args()
    rhos = [float(r) for r in args.rhos.split(",")]
    options = args.options.split(",")
    if not set(options) <= set(OPTIONS):
        ap.error(f"--options: one or more of {', '.join(OPTIONS)}")
    size = args.input_size
    repeats = []
    with tempfile.TemporaryDirectory(prefix="emitted-") as tmp:
        if args.model.endswith(".onnx"):
            path = Path(args.model)
        else:
            from models.export import export_onnx

            path = export_onnx(args.model, Path(tmp) / "m.onnx", input_shape=(3, size, size),
                               num_classes=5)  # fmt: skip
        input_name = onnx.load(str(path), load_external_data=False).graph.input[0].name
        for k in range(args.repeats):
            r = _repeat(path, Path(tmp) / f"repeat{k}", rhos, options, input_name, args)
            repeats.append(r)
            for kind, o in r["options"].items():
                rounds = o["full_step_ms_rounds"]
                print(f"\nrepeat {k + 1}, {OPTIONS[kind]}: {Path(args.model).stem} {size} px, "
                      f"load average {r['load_average']:.2f} on {os.cpu_count()} cores; full "
                      f"step {o['full_step_ms']:.1f} ms (per round {min(rounds):.0f}-"
                      f"{max(rounds):.0f}), {r['profiled_full_ms']:.1f} ms profiled")  # fmt: skip
                print("| rho | form | tensors | step ms | predicted ms | measured ratio "
                      "(rounds' IQR) | predicted ratio | error |")  # fmt: skip
                print("|---|---|---|---|---|---|---|---|")
                for row in o["rows"]:
                    q1, q3 = row["ratio_iqr"]
                    print(f"| {row['rho']} | {row['form']} | {row['selected']}/{row['tensors']} "
                          f"| {row['step_ms']:.1f} | {row['predicted_step_ms']:.1f} | "
                          f"{row['measured_ratio']:.3f} ({q1:.3f}-{q3:.3f}) | "
                          f"{row['predicted_ratio']:.3f} | "
                          f"{100 * row['error']:.1f}% |")  # fmt: skip
                print(f"error of the ratio: mean {100 * o['mean_error']:.1f}%, "
                      f"max {100 * o['max_error']:.1f}%", flush=True)  # fmt: skip
    print()
    for kind in options:
        versus = [v for r in repeats for v in r["options"][kind]["vs_default"]]
        if kind != "default" and versus:
            q1, q3 = np.percentile(versus, [25, 75])
            print(f"{OPTIONS[kind]}: step {np.median(versus):.2f}x ORT's loop with its defaults on "
                  f"the same artifacts, same round (IQR {q1:.2f}-{q3:.2f}, "
                  f"{len(versus)} sessions)")  # fmt: skip
    for kind in options:
        means = [100 * r["options"][kind]["mean_error"] for r in repeats]
        maxes = [100 * r["options"][kind]["max_error"] for r in repeats]
        print(f"{OPTIONS[kind]}, {len(repeats)} repeats: mean error {np.mean(means):.1f} +- "
              f"{np.std(means):.1f}%, max error {np.mean(maxes):.1f} +- {np.std(maxes):.1f}% "
              f"(worst {max(maxes):.1f}%)")  # fmt: skip
    out = RESULTS / f"emitted_artifacts_{Path(args.model).stem}_{size}{args.suffix}.json"
    out.write_text(json.dumps({"args": vars(args), "repeats": repeats}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
