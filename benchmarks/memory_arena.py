"""Peak memory of a selection by ORT arena configuration and batch-norm mode (issue #17).

For each model (plain-torch zoo export at 128 px, ``models/export.py``) and each selection — a
few random masks (seed 0, as ``benchmarks/memory_model.py`` draws them) and suffixes — the
training artifacts are generated in both ``--frozen-bn`` modes, and a **fresh process** per
(selection, mode, arena) builds the sessions as ``etgraph train`` does (checkpoint, Module,
AdamW Optimizer), takes 3 steps and reports its RSS after each step and its peak (``VmHWM``):

* ``default``: ORT's per-session CPU arena (grows by powers of two);
* ``shared``: etgraph's shared arena (:func:`etgraph.ort_options.shared_arena`, kSameAsRequested).

Peak RSS does not depend on CPU load. Usage::

    python benchmarks/memory_arena.py --model mobilenet_v2 --random 5,13 --suffix 0 \\
        --json benchmarks/results/memory_arena_mobilenet_v2.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the models/ package lives beside etgraph/

from memory_model import export, random_masks  # noqa: E402

from etgraph.artifacts import ArtifactCache  # noqa: E402
from etgraph.model import LoadedModel  # noqa: E402

ARENAS = ("default", "shared")
MODES = ("train", "inference")

#: The measuring process: argv = [artifact dir, arena, C, H, W]; prints one JSON line.
CHILD = r"""
import json, sys
from pathlib import Path
import numpy as np
def status():
    d = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            k, v = line.split(":"); d[k] = int(v.split()[0]) / 1024
    return d
import etgraph.loop  # noqa: F401  (what etgraph train imports)
from etgraph.ort_options import OrtConfig, session_options
from etgraph.sessions import api
d, arena, *shape = sys.argv[1:]
so = session_options(2, config=OrtConfig(spinning=False, shared_arena=arena == "shared"))
state = api.CheckpointState.load_checkpoint(str(Path(d) / "checkpoint"))
m = api.Module(str(Path(d) / "training_model.onnx"), state, str(Path(d) / "eval_model.onnx"),
               session_options=so)
o = api.Optimizer(str(Path(d) / "optimizer_model.onnx"), m)
m.train()
out = {"session": status(), "steps": []}
x = np.random.default_rng(0).standard_normal((4, *map(int, shape))).astype(np.float32)
y = np.zeros(4, dtype=np.int64)
for _ in range(3):
    m(x, y); o.step(); m.lazy_reset_grad()
    out["steps"].append(status())
print(json.dumps(out))
"""


def measure(directory: Path, arena: str, shape) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(directory), arena, *map(str, shape)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


@click.command()
@click.option("--model", "name", default="mobilenet_v2", show_default=True)
@click.option("--input-size", default=128, show_default=True)
@click.option(
    "--random",
    "randoms",
    default="5,13",
    show_default=True,
    help="Indices of memory_model.py's random masks (seed 0, 20 drawn).",
)
@click.option(
    "--suffix",
    "suffixes",
    default="0",
    show_default=True,
    help="Earliest tensors of suffix selections.",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def main(name, input_size, randoms, suffixes, json_path) -> None:
    """Peak RSS per selection, batch-norm mode and arena; prints a table."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="etgraph-arena-") as tmp:
        path, shape = export(name, input_size, Path(tmp))
        model = LoadedModel.load(path)
        n = len(model.tensors)
        drawn = random_masks(n, 20, np.random.default_rng(0))
        cases = [(f"random {i}", drawn[int(i)]) for i in randoms.split(",") if i]
        for e in (int(v) for v in suffixes.split(",") if v):
            mask = np.zeros(n, dtype=bool)
            mask[e:] = True
            cases.append((f"suffix {e}", mask))
        model_b = model.with_batch(4, {model.inputs[0].name: shape})
        cache = ArtifactCache(Path(tmp) / "artifacts")
        for label, mask in cases:
            for mode in MODES:
                paths, _ = cache.get(model_b, *model.split(mask), frozen_bn=mode)
                for arena in ARENAS:
                    r = measure(paths.directory, arena, shape)
                    rows.append(
                        {
                            "selection": label,
                            "earliest": int(np.argmax(mask)),
                            "selected": int(mask.sum()),
                            "frozen_bn": mode,
                            "arena": arena,
                            "session_mb": r["session"]["VmRSS"],
                            "steps_mb": [s["VmRSS"] for s in r["steps"]],
                            "peak_mb": r["steps"][-1]["VmHWM"],
                        }
                    )
                    print(
                        f"{name} {label} {mode} {arena}: steps "
                        f"{' -> '.join(f'{v:.0f}' for v in rows[-1]['steps_mb'])}, "
                        f"peak {rows[-1]['peak_mb']:.0f} MiB",
                        flush=True,
                    )
    print()
    print(
        "| selection (earliest, tensors) | BN mode | ORT default: step 1 → 3, peak "
        "| shared arena: step 1 → 3, peak |"
    )
    print("|---|---|---|---|")
    for i in range(0, len(rows), 2):
        a, b = rows[i], rows[i + 1]
        cell = lambda r: f"{r['steps_mb'][0]:.0f} → {r['steps_mb'][-1]:.0f}, {r['peak_mb']:.0f}"  # noqa: E731
        print(
            f"| {a['selection']} ({a['earliest']}, {a['selected']}) | {a['frozen_bn']} "
            f"| {cell(a)} | {cell(b)} |"
        )
    if json_path:
        Path(json_path).write_text(
            json.dumps({"model": name, "input_size": input_size, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
