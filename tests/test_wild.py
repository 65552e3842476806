"""Models as users export them (issue 27): transformers families through torch's TorchScript
exporter with dynamic batch and sequence axes, and a native crash of ORT kept out of the
process (:func:`etgraph.sessions.run_isolated`, :func:`etgraph.sessions.check_sessions`)."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch
from helpers import assert_user_error, run_cli
from PIL import Image

from etgraph.sessions import run_isolated

SEQ_LEN = 16
WORDS = "alpha beta gamma delta eps zeta eta theta iota kappa lam mu nu xi".split()


# ---- run_isolated ------------------------------------------------------------------------


def _raise():
    raise RuntimeError("a Python error")


@pytest.mark.parametrize(
    ("fn", "status", "detail"),
    [
        (lambda: None, "ok", ""),
        (_raise, "error", "RuntimeError: a Python error"),
        (lambda: os.kill(os.getpid(), signal.SIGSEGV), "crashed", "SIGSEGV"),
        (lambda: (os.write(2, b"bfc_arena.cc:95 h < chunks_.size()\n"), os.abort()), "crashed",
         "SIGABRT: bfc_arena.cc:95 h < chunks_.size()"),
        (lambda: os.kill(os.getpid(), signal.SIGKILL), "killed", "SIGKILL"),
    ],
)  # fmt: skip
def test_run_isolated_reports_how_the_child_ended(fn, status, detail):
    outcome = run_isolated(fn)
    assert (outcome.status, outcome.detail) == (status, detail)


def test_run_isolated_stops_a_hung_child():
    import time

    outcome = run_isolated(lambda: time.sleep(30), timeout_s=0.5)
    assert outcome.status == "timeout"


# ---- a model whose training step crashes ORT -----------------------------------------------


class DataLengthPositions(torch.nn.Module):
    """Token + position embeddings whose positions are sliced to a length computed from the
    data: ORT's gradient builder cannot see that the [1, T] positions broadcast over the batch,
    does not sum their gradient, and GatherGrad writes past its buffer."""

    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(100, 32)
        self.pos = torch.nn.Embedding(64, 32)
        self.register_buffer("ids", torch.arange(64)[None])
        self.fc = torch.nn.Linear(32, 3)

    def forward(self, x):
        t = (x >= 0).sum(dim=1).max()
        h = self.tok(x) + self.pos(self.ids[:, :t])
        return self.fc(h.mean(1))


@pytest.mark.slow
def test_native_crash_is_one_line(tmp_path, cache_env):
    path = tmp_path / "crash.onnx"
    torch.onnx.export(
        DataLengthPositions().eval(),
        torch.zeros(2, SEQ_LEN, dtype=torch.long),
        str(path),
        input_names=["ids"],
        output_names=["logits"],
        dynamic_axes={"ids": {0: "b"}, "logits": {0: "b"}},
        opset_version=17,
        dynamo=False,
    )
    done = run_cli("compile", path, "-o", tmp_path / "out", env=cache_env)
    assert_user_error(done, "crash.onnx: ONNX Runtime", "crashed (SIG", "caught in a child process")


# ---- transformers families, exported as users export them -----------------------------------


def _export_family(family: str, path):
    """A sequence (or image) classifier of ``family`` from a small config, random weights,
    exported as the transformers docs show: eval mode, TorchScript exporter, opset 17, dynamic
    batch (and sequence) axes."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    if family == "distilbert":
        config = transformers.DistilBertConfig(
            vocab_size=100, dim=32, n_layers=2, n_heads=2, hidden_dim=64, num_labels=3
        )
        model = transformers.DistilBertForSequenceClassification(config)
    elif family == "vit":
        config = transformers.ViTConfig(image_size=32, patch_size=8, num_labels=3, **small)
        model = transformers.ViTForImageClassification(config)
    else:
        configs = {
            "bert": (transformers.BertConfig, transformers.BertForSequenceClassification, {}),
            "roberta": (
                transformers.RobertaConfig,
                transformers.RobertaForSequenceClassification,
                {"max_position_embeddings": 70},
            ),
            "albert": (
                transformers.AlbertConfig,
                transformers.AlbertForSequenceClassification,
                {"embedding_size": 16},
            ),
        }
        config_cls, model_cls, extra = configs[family]
        model = model_cls(config_cls(vocab_size=100, num_labels=3, **{**small, **extra}))
    model.eval()
    if family == "vit":
        args, names = (torch.randn(1, 3, 32, 32),), ["pixel_values"]
        axes = {"pixel_values": {0: "batch"}}
    else:
        ids = torch.randint(0, 100, (1, SEQ_LEN))
        args, names = (ids, torch.ones_like(ids)), ["input_ids", "attention_mask"]
        axes = {n: {0: "batch", 1: "sequence"} for n in names}
    torch.onnx.export(
        model,
        args,
        str(path),
        input_names=names,
        output_names=["logits"],
        dynamic_axes={**axes, "logits": {0: "batch"}},
        opset_version=17,
        dynamo=False,
    )
    return path


@pytest.fixture(scope="module")
def text_data(tmp_path_factory):
    """A 3-class CSV of random words and a WordPiece tokenizer trained on it."""
    text = pytest.importorskip("models.text", reason="transformers is in the test extra")
    root = tmp_path_factory.mktemp("text")
    rng = np.random.default_rng(0)
    rows = [(" ".join(rng.choice(WORDS, size=int(rng.integers(3, 12)))), i % 3) for i in range(36)]
    csv_path = root / "data.csv"
    csv_path.write_text("text,label\n" + "".join(f"{t},{label}\n" for t, label in rows))
    text.train_tokenizer([t for t, _ in rows], root / "tokenizer.json", vocab_size=100)
    return csv_path, root / "tokenizer.json"


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for c in range(3):
        (root / f"class_{c}").mkdir()
        for i in range(6):
            pixels = rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"class_{c}" / f"{i}.png")
    return root


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "distilbert", "roberta", "albert", "vit"])
def test_transformers_family_compiles_with_data(
    tmp_path, cache_env, text_data, image_folder, family
):
    """``compile --data``: the importance probe's session at the run's static shape (a
    DistilBERT's probe at symbolic shapes crashed the process: SIGSEGV or bfc_arena.cc:95)."""
    path = _export_family(family, tmp_path / f"{family}.onnx")
    if family == "vit":
        data = ["--data", image_folder]
    else:
        csv_path, tokenizer = text_data
        data = ["--data", csv_path, "--tokenizer", tokenizer]
        data += ["--input-shape", f"input_ids={SEQ_LEN}"]
        data += ["--input-shape", f"attention_mask={SEQ_LEN}"]
    done = run_cli("compile", path, *data, "-o", tmp_path / "out", env=cache_env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tensors selected" in done.stdout


@pytest.mark.slow
def test_probe_session_has_static_shapes(tmp_path, text_data):
    """The importance probe's graphs at the run's batch shape, as every other session's: at
    symbolic shapes ORT's gradient builder takes DistilBERT's [1, T] positions to match the
    [B, T] tokens, leaves their gradient [B, T, D] and GatherGrad writes past its buffer."""
    import onnx

    from etgraph.importance import probe_importance
    from etgraph.model import LoadedModel

    model = LoadedModel.load(_export_family("distilbert", tmp_path / "distilbert.onnx"))
    shapes = model.input_shapes([f"input_ids={SEQ_LEN}", f"attention_mask={SEQ_LEN}"])
    csv_path, tokenizer = text_data
    importance = probe_importance(
        model, str(csv_path), batch_size=4, input_shapes=shapes, tokenizer=str(tokenizer),
        cache_dir=tmp_path / "cache",
    )  # fmt: skip
    assert importance.shape == (len(model.tensors),) and np.isfinite(importance).all()
    (graph,) = (tmp_path / "cache").glob("*/training_model.onnx")
    dims = {
        i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim]
        for i in onnx.load(str(graph)).graph.input
        if i.name in model.input_names
    }
    assert dims == {"input_ids": [4, SEQ_LEN], "attention_mask": [4, SEQ_LEN]}
