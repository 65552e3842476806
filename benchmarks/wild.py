"""Generality: real ONNX graphs no one here wrote go through ``etgraph compile`` and three
training steps of ``etgraph train`` on an image folder (issue #14).

The models:

* the nine model-zoo graphs the ``onnx`` wheel ships for its backend tests
  (``onnx/backend/test/data/light/light_*.onnx``: Caffe2-era exports, IR 3, opset 9,
  initializers listed as inputs, weights made by ConstantOfShape, inference BatchNormalization,
  Softmax heads, a fixed batch of 1). Their weights are constant fills ("light"), so losses
  are not meaningful and deep ones overflow;
* inference exports the way an older PyTorch user makes them: eval mode (BatchNorm folded into
  the convolutions), opset 11, a fixed batch of 1, a Softmax head, from etgraph's model zoo;
* etgraph's own training exports (``models/export.py``) of the paper's models;
* one model per exporter family this machine can build (issue 27; :data:`FAMILIES`): torch's
  default dynamo exporter (etgraph's torch, and torchvision's ResNet-18 with and without
  ``optimize=False``), timm's own export, transformers text and vision models through the
  TorchScript exporter, Keras through tf2onnx, JAX through jax2tf + tf2onnx, scikit-learn
  through skl2onnx, PaddlePaddle through paddle2onnx, and a pretrained model shipped inside a
  PyPI wheel. Each exporter runs in a venv of its own under ``--venv-root`` (created on first
  use with the packages in :data:`VENVS`; ``benchmarks/wild_export.py`` runs there), never in
  etgraph's;
* any ``--extra name=path.onnx[@CxHxW]`` (e.g. a paddle2onnx export; ``@`` gives the input
  shape of a model with symbolic spatial dims).

Each model runs in the CLI exactly as a user runs it (subprocesses of ``python -m etgraph``),
with a fresh profile cache, on data of its kind (an image folder, text with a tokenizer, the
arrays an exporter wrote). Prints a markdown table: model, origin, opset before -> after,
trainable tensors, ops, what legalisation rewrote, compiled, trained (the loss after three
steps) and exported (``model_trained.onnx`` runs in ORT), or the CLI's one-line error. Usage::

    python benchmarks/wild.py                       # everything (~15 min on 2 quiet cores)
    python benchmarks/wild.py --models light_resnet50,light_alexnet
    python benchmarks/wild.py --extra paddle_mobilenet=/tmp/paddle/mobilenet.onnx@3x224x224
    python benchmarks/wild.py --models "$(python benchmarks/wild.py --list-families)" \
        --venv-root ~/wild-venvs       # the exporter families (~6 GB of venvs on first use)
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LIGHT_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
LIGHT = [
    "resnet50",
    "densenet121",
    "inception_v1",
    "inception_v2",
    "shufflenet",
    "squeezenet",
    "vgg19",
    "bvlc_alexnet",
    "zfnet512",
]
TORCH_INFERENCE = ["mobilenet_v2", "resnet18s"]  # eval-mode opset-11 exports, batch 1
TORCH_TRAINING = ["resnet50", "mobilenet_v2", "vit_b16", "vgg16"]

#: Packages of each exporter venv (``--venv-root``/venv-KEY), installed on first use. torch
#: 2.14.1 with torchvision 0.29.1: PyPI's torchvision beside etgraph's torch 2.13 fails to
#: import; on x86_64 this pair is a CUDA build (~5.5 GB).
VENVS: dict[str, list[str]] = {
    "tv": ["torch==2.14.1", "torchvision==0.29.1", "timm", "onnx", "onnxscript"],
    "tf": ["tensorflow-cpu", "tf2onnx"],
    "jax": ["tensorflow-cpu", "tf2onnx", "jax", "jaxlib"],
    "skl": ["scikit-learn", "skl2onnx"],
    "paddle": ["paddlepaddle", "paddle2onnx", "packaging"],
    "wheels": ["--no-deps", "rapidocr-onnxruntime"],
}


@dataclass(frozen=True)
class Family:
    """One exporter family: the venv it exports in (None: etgraph's own), where the model
    comes from, the data it trains on (``images``: 3 classes, ``images2``: 2, ``text``: CSV
    + tokenizer, ``npz``: the arrays the export wrote beside the model) and compile options."""

    venv: str | None
    origin: str
    data: str = "images"
    args: tuple[str, ...] = ()


_TEXT_SHAPE = ("--input-shape", "input_ids=16", "--input-shape", "attention_mask=16")
_PADDLE = ("--preprocess", "paddle")
FAMILIES: dict[str, Family] = {
    "torch_dynamo": Family(None, "torch 2.13 dynamo exporter, optimize=False, zoo resnet18s"),
    "torchvision_dynamo": Family("tv", "torchvision ResNet-18, torch 2.14 dynamo, optimize=False"),
    "torchvision_dynamo_folded": Family("tv", "torchvision ResNet-18, torch 2.14 dynamo default"),
    "timm_resnet18d": Family("tv", "timm resnet18d (ceil_mode avg_down), timm's onnx_export"),
    "hf_distilbert": Family(
        None, "transformers DistilBERT, small config, TorchScript, dynamic axes", "text",
        _TEXT_SHAPE,
    ),
    "hf_vit": Family(None, "transformers ViT, small config, TorchScript, dynamic batch"),
    "keras_mobilenet_v2": Family("tf", "Keras MobileNetV2 (NHWC, 96 px), tf2onnx", args=_PADDLE),
    "keras_gmp_upsample": Family("tf", "Keras LayerNorm, UpSampling2D, GlobalMaxPool2D, tf2onnx"),
    "jax_cnn": Family("jax", "JAX CNN via jax2tf + tf2onnx"),
    "sklearn_mlp": Family("skl", "scikit-learn MLPClassifier via skl2onnx (ZipMap)", "npz"),
    "paddle_mobilenet_v2": Family(
        "paddle", "PaddlePaddle MobileNetV2 via paddle2onnx",
        args=("--input-shape", "3x224x224", *_PADDLE),
    ),
    "wheel_rapidocr_cls": Family(
        "wheels", "PP-OCR direction classifier, pretrained, in the rapidocr-onnxruntime wheel",
        "images2", ("--input-shape", "3x48x192", *_PADDLE),
    ),
}  # fmt: skip

DEFAULT_MODELS = (
    [f"light_{n}" for n in LIGHT]
    + [f"torch11_{n}" for n in TORCH_INFERENCE]
    + [f"etgraph_{n}" for n in TORCH_TRAINING]
    + list(FAMILIES)
)


def ensure_venv(root: Path, key: str) -> Path:
    """The Python of exporter venv ``key`` under ``root``, created with :data:`VENVS`'s
    packages when missing."""
    python = root / f"venv-{key}" / "bin" / "python"
    if not python.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(python.parents[1])], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *VENVS[key]], check=True)
    return python


def export_own(family: str, path: Path) -> None:
    """The families exported with etgraph's own torch (2.13) and transformers."""
    import torch

    torch.manual_seed(0)
    if family == "torch_dynamo":
        from models import zoo

        net = zoo.build("resnet18s", 10, input_size=128).eval()
        torch.onnx.export(net, (torch.randn(1, 3, 128, 128),), str(path), optimize=False)
        return
    import transformers as tf

    small = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    if family == "hf_vit":
        config = tf.ViTConfig(
            image_size=32, patch_size=8, num_labels=3, intermediate_size=64, **small
        )
        net, args, names = (
            tf.ViTForImageClassification(config),
            (torch.randn(1, 3, 32, 32),),
            ["pixel_values"],
        )
        axes = {"pixel_values": {0: "batch"}}
    else:
        config = tf.DistilBertConfig(
            vocab_size=100, dim=32, n_layers=2, n_heads=2, hidden_dim=64, num_labels=3
        )
        net, ids = tf.DistilBertForSequenceClassification(config), torch.randint(0, 100, (1, 16))
        args, names = (ids, torch.ones_like(ids)), ["input_ids", "attention_mask"]
        axes = {n: {0: "batch", 1: "sequence"} for n in names}
    torch.onnx.export(
        net.eval(), args, str(path), input_names=names, output_names=["logits"],
        dynamic_axes={**axes, "logits": {0: "batch"}}, opset_version=17, dynamo=False,
    )  # fmt: skip


def export_family(family: str, path: Path, venv_root: Path) -> Path:
    """The ONNX file of exporter family ``family``: exported with its own venv's Python
    (``benchmarks/wild_export.py``), or read from its wheel (``wheel_*``).

    Raises:
        RuntimeError: the export failed (the exporter's last line).
    """
    spec = FAMILIES[family]
    if spec.venv is None:
        export_own(family, path)
        return path
    python = ensure_venv(venv_root, spec.venv)
    if family == "wheel_rapidocr_cls":
        (found,) = python.parents[1].glob(
            "lib/python*/site-packages/rapidocr_onnxruntime/models/*cls*.onnx"
        )
        return found
    script = Path(__file__).resolve().parent / "wild_export.py"
    proc = subprocess.run(
        [str(python), str(script), family, str(path)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        lines = [
            line
            for line in proc.stderr.splitlines()
            if line.strip() and not line.startswith(("W0", "I0"))
        ]
        raise RuntimeError(lines[-1][:200] if lines else f"exit {proc.returncode}")
    return path


def export_torch_inference(name: str, path: Path, size: int) -> None:
    """An eval-mode export as older PyTorch tutorials make it: opset 11, batch fixed at 1,
    BatchNorm folded, a Softmax head, default value names."""
    import torch

    from models import zoo

    net = torch.nn.Sequential(zoo.build(name, 10, input_size=size), torch.nn.Softmax(dim=1))
    torch.onnx.export(
        net.eval(), torch.zeros(1, 3, size, size), str(path), opset_version=11, dynamo=False
    )


def export_etgraph(name: str, path: Path, size: int) -> None:
    from models.export import export_onnx

    export_onnx(name, path, input_shape=(3, size, size), num_classes=10)


def model_file(
    name: str, extra: dict[str, Path], work: Path, size: int, venv_root: Path
) -> tuple[Path, str]:
    """The ONNX file of ``name`` (exported into ``work`` if needed) and its origin.

    Raises:
        RuntimeError: an exporter family's export failed.
    """
    if name in extra:
        return extra[name], "--extra"
    if name in FAMILIES:
        return export_family(name, work / f"{name}.onnx", venv_root), FAMILIES[name].origin
    kind, _, base = name.partition("_")
    if kind == "light":
        return LIGHT_DIR / f"light_{base}.onnx", "onnx backend-test zoo (Caffe2, opset 9)"
    path = work / f"{name}.onnx"
    if kind == "torch11":
        export_torch_inference(base, path, size)
        return path, f"torch {_torch_version()} eval export, opset 11, batch 1, {size} px"
    if kind == "etgraph":
        export_etgraph(base, path, size)
        return path, f"etgraph models/export.py, {size} px"
    raise click.BadParameter(f"unknown model {name!r}", param_hint="--models")


def _torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]


def image_folder(root: Path, classes: int = 3, per_class: int = 8) -> Path:
    """Random 64x64 RGB PNGs in ``classes`` sub-folders (the loader resizes them); made once."""
    from PIL import Image

    if root.is_dir():
        return root
    rng = np.random.default_rng(0)
    for c in range(classes):
        folder = root / f"class_{c}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / f"{i}.png")
    return root


def _cli(*args: str, env: dict, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "etgraph", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout_s,
    )


def _error_line(proc: subprocess.CompletedProcess) -> str:
    if proc.returncode < 0:  # no line of its own: a signal (SIGKILL: the OOM killer)
        return f"killed by signal {-proc.returncode}" + (
            " (out of memory)" if proc.returncode == -9 else ""
        )
    lines = [line for line in proc.stderr.splitlines() if line.startswith("etgraph:")]
    if lines:
        return lines[-1]
    rest = proc.stderr.strip().splitlines()
    return rest[-1] if rest else "?"


def _ops(model: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph.node)


def _opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def rewrites(original: onnx.ModelProto, legal: onnx.ModelProto, plan: dict) -> str:
    """What legalisation changed, read off the two graphs: op types that disappeared, inference
    BatchNormalization made trainable, the head taken off."""
    before, after = _ops(original), _ops(legal)
    parts = [f"{op} x{n}" for op, n in sorted(before.items()) if op not in after]
    inference_bn = sum(
        1
        for n in original.graph.node
        if n.op_type == "BatchNormalization"
        and not any(a.name == "training_mode" and a.i == 1 for a in n.attribute)
        and len([o for o in n.output if o]) == 1
    )
    if inference_bn:
        parts.append(f"BN->training x{inference_bn}")
    if plan.get("removed_head"):
        parts.append(f"head {plan['removed_head']}")
    return ", ".join(parts) or "-"


def text_data(root: Path, rows: int = 36) -> tuple[Path, Path]:
    """A 3-class CSV of random words and a WordPiece tokenizer (vocabulary <= 100) for it."""
    from models.text import train_tokenizer

    rng = np.random.default_rng(0)
    words = "alpha beta gamma delta zeta eta theta iota kappa lambda mu nu xi".split()
    texts = [" ".join(rng.choice(words, size=int(rng.integers(3, 12)))) for _ in range(rows)]
    root.mkdir(parents=True, exist_ok=True)
    csv_path = root / "data.csv"
    csv_path.write_text("text,label\n" + "".join(f"{t},{i % 3}\n" for i, t in enumerate(texts)))
    train_tokenizer(texts, root / "tokenizer.json", vocab_size=100)
    return csv_path, root / "tokenizer.json"


def data_args(name: str, path: Path, work: Path) -> list[str]:
    """``--data ...`` (and ``--tokenizer``) for model ``name``: its family's kind of data."""
    kind = FAMILIES[name].data if name in FAMILIES else "images"
    if kind == "npz":
        return ["--data", str(path.with_suffix(".npz"))]
    if kind == "text":
        csv_path, tokenizer = text_data(work / "text")
        return ["--data", str(csv_path), "--tokenizer", str(tokenizer)]
    classes = 2 if kind == "images2" else 3
    return ["--data", str(image_folder(work / f"images{classes}", classes=classes))]


def exported_runs(path: Path) -> bool:
    """``model_trained.onnx`` opens in a plain ORT session."""
    import onnxruntime as ort

    ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return True


def run_one(
    name: str, path: Path, origin: str, data: list[str], work: Path, args: dict, options: list[str]
) -> dict:
    env = dict(os.environ, ETGRAPH_CACHE=str(work / "cache"))
    original = onnx.load(str(path), load_external_data=False)
    row = {
        "model": name,
        "origin": origin,
        "opset": f"{_opset(original)}",
        "tensors": "-",
        "ops": len(original.graph.node),
        "rewrites": "-",
        "compiled": "no",
        "trained": "-",
        "exported": "-",
    }
    out = work / name
    t0 = time.perf_counter()
    proc = _cli(
        "compile", str(path), "-o", str(out), "--rho", str(args["rho"]),
        "--batch-size", str(args["batch_size"]), *data, *options,
        env=env, timeout_s=args["timeout_s"],
    )  # fmt: skip
    row["compile_s"] = round(time.perf_counter() - t0, 1)
    if proc.returncode != 0:
        row["trained"] = _error_line(proc)
        return row
    legal = onnx.load(str(out / "model.onnx"), load_external_data=False)
    plan = json.loads((out / "plan.json").read_text())
    row.update(
        compiled="yes",
        opset=f"{_opset(original)} -> {_opset(legal)}",
        tensors=len(plan["tensors"]),
        rewrites=rewrites(original, legal, plan),
    )
    t0 = time.perf_counter()
    proc = _cli(
        "train", str(out), *data, "--epochs", "1", "--max-steps-per-epoch", "3",
        "--max-val-batches", "1", "--batch-size", str(args["batch_size"]),
        "--rho", str(args["rho"]), "--quiet", "--out", str(work / f"{name}_run"),
        env=env, timeout_s=args["timeout_s"],
    )  # fmt: skip
    row["train_s"] = round(time.perf_counter() - t0, 1)
    if proc.returncode != 0:
        row["trained"] = _error_line(proc)
        return row
    log_text = (work / f"{name}_run" / "log.jsonl").read_text()
    log = [json.loads(line) for line in log_text.splitlines() if line]
    row["trained"] = f"yes (loss {log[-1]['train_loss']:.3g})"
    try:
        row["exported"] = (
            "yes" if exported_runs(work / f"{name}_run" / "model_trained.onnx") else "no"
        )
    except Exception as exc:  # noqa: BLE001  (recorded in the table)
        row["exported"] = f"no: {str(exc).splitlines()[0][:120]}"
    return row


COLUMNS = [
    "model", "origin", "opset", "tensors", "ops", "rewrites", "compiled", "trained", "exported"
]  # fmt: skip


def print_table(rows: list[dict]) -> None:
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in COLUMNS) + " |")


@click.command()
@click.option("--models", "names", default=",".join(DEFAULT_MODELS), show_default=True)
@click.option("--extra", multiple=True, help="NAME=PATH[@CxHxW] of another ONNX file to try.")
@click.option("--size", default=128, show_default=True, help="Input px of the torch exports.")
@click.option("--rho", default=0.6, show_default=True)
@click.option("--batch-size", default=4, show_default=True)
@click.option("--timeout-s", default=1200, show_default=True, help="Per command.")
@click.option("--json-out", type=click.Path(dir_okay=False), help="Also write the rows as JSON.")
@click.option(
    "--venv-root",
    default=str(Path(tempfile.gettempdir()) / "etgraph-wild-venvs"),
    show_default=True,
    type=click.Path(file_okay=False),
    help="Where the exporter families' venvs live (venv-KEY, created on first use).",
)
@click.option("--list-families", is_flag=True, help="Print the exporter families and exit.")
def main(names, extra, size, rho, batch_size, timeout_s, json_out, venv_root, list_families):
    if list_families:
        click.echo(",".join(FAMILIES))
        return
    extras, shapes = {}, {}
    for item in extra:
        key, _, value = item.partition("=")
        value, _, shape = value.partition("@")
        extras[key], shapes[key] = Path(value), shape or None
    selected = [n for n in names.split(",") if n] + [k for k in extras if k not in names]
    args = {"rho": rho, "batch_size": batch_size, "timeout_s": timeout_s}
    rows = []
    with tempfile.TemporaryDirectory(prefix="wild_") as tmp:
        work = Path(tmp)
        for name in selected:
            try:
                path, origin = model_file(name, extras, work, size, Path(venv_root))
            except RuntimeError as exc:
                row = {c: "-" for c in COLUMNS} | {"model": name, "compiled": "no"}
                row["origin"] = FAMILIES[name].origin if name in FAMILIES else "?"
                row["trained"] = f"export failed: {exc}"
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
                continue
            options = list(FAMILIES[name].args) if name in FAMILIES else []
            if shapes.get(name):
                options += ["--input-shape", shapes[name]]
            try:
                data = data_args(name, path, work)
                row = run_one(name, path, origin, data, work, args, options)
            except subprocess.TimeoutExpired:
                row = {c: "-" for c in COLUMNS} | {"model": name, "origin": origin}
                row["trained"] = f"timeout after {timeout_s} s"
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print_table(rows)
    if json_out:
        Path(json_out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
