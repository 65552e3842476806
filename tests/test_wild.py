"""Models as users export them (issue 27): transformers families through torch's TorchScript
exporter with dynamic batch and sequence axes, and a native crash of ORT kept out of the
process (:func:`etgraph.isolation.run_isolated`, :func:`etgraph.isolation.check_sessions`)."""

from __future__ import annotations

import os
import signal

import numpy as np
import onnx
import pytest
import torch
from helpers import assert_user_error, run_cli, run_cli_in_process
from PIL import Image

from etgraph.isolation import run_isolated

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
@pytest.mark.parametrize("dynamic", [True, False])
def test_native_crash_is_one_line(tmp_path, cache_env, dynamic):
    """Exported with a dynamic batch, or at batch 2 (the crash is not mistaken for the fixed
    export batch's failure at batch 4)."""
    path = tmp_path / "crash.onnx"
    axes = {"ids": {0: "b"}, "logits": {0: "b"}} if dynamic else None
    torch.onnx.export(
        DataLengthPositions().eval(),
        torch.zeros(2, SEQ_LEN, dtype=torch.long),
        str(path),
        input_names=["ids"],
        output_names=["logits"],
        dynamic_axes=axes,
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


# ---- scikit-learn through skl2onnx, as it writes a classifier -------------------------------


def skl_mlp(zipmap: bool, tail: str = "Identity", probabilities: str = "softmax"):
    """An MLPClassifier (8 features, 16 hidden, 3 classes) the way skl2onnx 1.20 writes it:
    ``Softmax -> Identity -> probabilities`` beside ``ArgMax -> ArrayFeatureExtractor ->
    label`` (``options={'zipmap': False}``), or with its default ZipMap output (a sequence of
    {class: probability} maps). ``tail``: the op after the Softmax (Identity, Cast, Flatten);
    ``probabilities="manual"``: the Softmax written as Exp / ReduceSum / Div."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.3, (8, 16)).astype(np.float32), "coefficient"),
        numpy_helper.from_array(rng.normal(0, 0.1, 16).astype(np.float32), "intercepts"),
        numpy_helper.from_array(rng.normal(0, 0.3, (16, 3)).astype(np.float32), "coefficient1"),
        numpy_helper.from_array(rng.normal(0, 0.1, 3).astype(np.float32), "intercepts1"),
        numpy_helper.from_array(np.arange(3, dtype=np.int64), "classes"),
        numpy_helper.from_array(np.array([-1], np.int64), "shape_tensor"),
        numpy_helper.from_array(np.array([1], np.int64), "axes"),
    ]
    nodes = [
        helper.make_node("Cast", ["X"], ["cast_input"], name="Cast", to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["cast_input", "coefficient"], ["mul_result"], name="MatMul"),
        helper.make_node("Add", ["mul_result", "intercepts"], ["add_result"], name="Add"),
        helper.make_node("Relu", ["add_result"], ["next_activations"], name="Relu"),
        helper.make_node("MatMul", ["next_activations", "coefficient1"], ["mul1"], name="MatMul1"),
        helper.make_node("Add", ["mul1", "intercepts1"], ["add1"], name="Add1"),
    ]
    if probabilities == "softmax":
        nodes.append(helper.make_node("Softmax", ["add1"], ["out_activations_result"], axis=1))
    else:
        nodes += [
            helper.make_node("Exp", ["add1"], ["exp"], name="Exp"),
            helper.make_node("ReduceSum", ["exp", "axes"], ["total"], name="ReduceSum"),
            helper.make_node("Div", ["exp", "total"], ["out_activations_result"], name="Div"),
        ]
    nodes.append(helper.make_node("ArgMax", ["out_activations_result"], ["argmax"], axis=1))
    nodes.append(
        helper.make_node(
            "ArrayFeatureExtractor", ["classes", "argmax"], ["afe"], domain="ai.onnx.ml"
        )
    )
    nodes.append(helper.make_node("Reshape", ["afe", "shape_tensor"], ["reshaped"]))
    outputs = []
    if zipmap:
        nodes.append(helper.make_node("Cast", ["reshaped"], ["output_label"], to=7))
        nodes.append(
            helper.make_node(
                "ZipMap", ["out_activations_result"], ["output_probability"],
                classlabels_int64s=[0, 1, 2], domain="ai.onnx.ml",
            )
        )  # fmt: skip
        maps = helper.make_sequence_type_proto(
            helper.make_map_type_proto(
                TensorProto.INT64, helper.make_tensor_type_proto(TensorProto.FLOAT, [])
            )
        )
        outputs = [
            helper.make_tensor_value_info("output_label", TensorProto.INT64, [None]),
            helper.make_value_info("output_probability", maps),
        ]
    else:
        nodes.append(helper.make_node("Cast", ["reshaped"], ["label"], to=7))
        attrs = {"to": TensorProto.FLOAT} if tail == "Cast" else {}
        nodes.append(helper.make_node(tail, ["out_activations_result"], ["probabilities"], **attrs))
        outputs = [
            helper.make_tensor_value_info("label", TensorProto.INT64, [None]),
            helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, [None, 3]),
        ]
    for i, node in enumerate(nodes):
        node.name = node.name or f"{node.op_type}_{i}"
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 8])],
        outputs, initializer=inits,
    )  # fmt: skip
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 1)]
    )
    model.ir_version = 8
    model.producer_name = "skl2onnx"
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize("tail", ["Identity", "Cast", "Flatten"])
def test_head_is_seen_through_no_ops(tmp_path, tail):
    """skl2onnx's ``Softmax -> Identity -> probabilities``: the Softmax is the head (taken off
    for the loss, restored on export), the float output beside the int64 label is the one
    trained; an Identity hid the Softmax and cross-entropy trained on probabilities."""
    from etgraph.model import LoadedModel

    path = tmp_path / "mlp.onnx"
    onnx.save(skl_mlp(zipmap=False, tail=tail), str(path))
    model = LoadedModel.load(path)
    assert model.head == "Softmax(axis=1)"
    assert model.task.output == "probabilities" and model.task.width == 3
    assert [n.op_type for n in model.proto.graph.node][-1] == "Add"


def test_zipmap_output_trains_its_tensor(tmp_path):
    from etgraph.model import LoadedModel
    from etgraph.onnx_io import original_outputs

    path = tmp_path / "mlp.onnx"
    onnx.save(skl_mlp(zipmap=True), str(path))
    model = LoadedModel.load(path)
    assert model.task.output == "out_activations_result" and model.head == "Softmax(axis=1)"
    assert original_outputs(model.proto) == (["output_label", "output_probability"], str(path))
    model = LoadedModel.load(path, output="output_probability")  # the ZipMap stands for it
    assert model.task.output == "out_activations_result"


def test_ml_op_refusal_names_the_op_and_converter(tmp_path):
    from onnx import TensorProto, helper

    from etgraph.errors import UnsupportedOpError
    from etgraph.model import LoadedModel

    node = helper.make_node(
        "LinearClassifier", ["X"], ["label", "probabilities"], name="LinearClassifier",
        domain="ai.onnx.ml", coefficients=[0.1] * 24, intercepts=[0.0] * 3,
        classlabels_ints=[0, 1, 2], multi_class=1, post_transform="SOFTMAX",
    )  # fmt: skip
    graph = helper.make_graph(
        [node], "logreg", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 8])],
        [helper.make_tensor_value_info("label", TensorProto.INT64, [None]),
         helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, [None, 3])],
    )  # fmt: skip
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 1)]
    )
    model.ir_version, model.producer_name = 8, "skl2onnx"
    onnx.save(model, str(tmp_path / "logreg.onnx"))
    with pytest.raises(UnsupportedOpError) as refused:
        LoadedModel.load(tmp_path / "logreg.onnx")
    message = str(refused.value)
    assert "ai.onnx.ml LinearClassifier 'LinearClassifier' (classical machine-learning" in message
    assert message.endswith(
        "use a neural-network estimator (MLPClassifier, MLPRegressor) in the scikit-learn model "
        "and convert it again with skl2onnx"
    )
    assert "do_constant_folding" not in message and "torch" not in message


@pytest.fixture(scope="module")
def features_npz(tmp_path_factory):
    """48 examples of 8 features, 3 classes, labels learnable from the features."""
    rng = np.random.default_rng(0)
    labels = np.arange(48) % 3
    x = rng.normal(0, 1, (48, 8)).astype(np.float32) + labels[:, None].astype(np.float32)
    path = tmp_path_factory.mktemp("npz") / "features.npz"
    np.savez(path, X=x, labels=labels.astype(np.int64))
    return path


@pytest.mark.slow
def test_hidden_probabilities_are_refused(tmp_path, cache_env, features_npz):
    """A Softmax written out (Exp / ReduceSum / Div) is no head etgraph can take off; the
    output checked on a batch is probabilities, and cross-entropy on it is refused."""
    path = tmp_path / "mlp.onnx"
    onnx.save(skl_mlp(zipmap=False, probabilities="manual"), str(path))
    done = run_cli_in_process(
        "compile", path, "--data", features_npz, "--rho", "1", "-o", tmp_path / "o", env=cache_env
    )
    assert_user_error(done, "output 'probabilities' holds probabilities, not logits", "Div <-")


@pytest.mark.slow
def test_zipmap_model_trains_and_exports_with_its_zipmap(tmp_path, cache_env, features_npz):
    import onnxruntime as ort

    path = tmp_path / "mlp.onnx"
    onnx.save(skl_mlp(zipmap=True), str(path))
    out = tmp_path / "run"
    args = ["--data", features_npz, "--epochs", "2", "--period", "1", "--rho", "1"]
    done = run_cli_in_process("train", path, *args, "--out", out, "--quiet", env=cache_env)
    assert done.returncode == 0, done.stderr[-3000:]
    session = ort.InferenceSession(str(out / "model_trained.onnx"))
    names = [o.name for o in session.get_outputs()]
    assert names[:2] == ["output_label", "output_probability"]
    x = np.load(features_npz)["X"][:4]
    label, maps, probabilities = session.run(None, {"X": x})
    assert set(maps[0]) == {0, 1, 2} and np.allclose(probabilities.sum(axis=1), 1, atol=1e-5)
    assert (label == probabilities.argmax(axis=1)).all()


# ---- torch's default exporter (dynamo=True since torch 2.9) ---------------------------------


class SmallResNet(torch.nn.Module):
    """Conv-BN-ReLU stem, two residual blocks, global pool, linear head (3 classes)."""

    def __init__(self):
        super().__init__()

        def conv_bn(c_in, c_out):
            return [
                torch.nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
                torch.nn.BatchNorm2d(c_out),
            ]

        self.stem = torch.nn.Sequential(*conv_bn(3, 8), torch.nn.ReLU())
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(*conv_bn(8, 8), torch.nn.ReLU(), *conv_bn(8, 8)) for _ in range(2)
        )
        self.head = torch.nn.Sequential(
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 3)
        )

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = torch.relu(x + block(x))
        return self.head(x)


@pytest.fixture(scope="module")
def dynamo_exports(tmp_path_factory):
    """The README's recipe and the tutorial's default: torch's default (dynamo) exporter at
    batch 2, ``optimize=False`` (batch norms kept) and as is (folded)."""
    root = tmp_path_factory.mktemp("dynamo")
    torch.manual_seed(0)
    net = SmallResNet().eval()
    x = torch.randn(2, 3, 16, 16)
    paths = {}
    for name, options in (("kept", {"optimize": False}), ("folded", {})):
        paths[name] = root / f"{name}.onnx"
        torch.onnx.export(net, (x,), str(paths[name]), **options)
    return paths


@pytest.mark.slow
def test_dynamo_default_export_is_noted_as_folded(dynamo_exports, caplog):
    from etgraph.model import LoadedModel

    with caplog.at_level("WARNING", logger="etgraph.model"):
        model = LoadedModel.load(dynamo_exports["folded"])
    assert not any(t.kind in ("gamma", "beta") for t in model.tensors)
    (note,) = [r.getMessage() for r in caplog.records]
    assert "5 convolutions and no normalisation layer" in note
    assert "optimize=False" in note


@pytest.mark.slow
def test_dynamo_export_with_optimize_false_keeps_batch_norms_and_trains(
    tmp_path, dynamo_exports, cache_env, image_folder, caplog
):
    """``torch.onnx.export(model, (x,), path, optimize=False)``: every BatchNormalization
    kept (a CastLike makes each conv's zero bias; the Flatten is a Reshape to [2, 8] with
    allowzero=1, freed to any batch), trains at batch 4 and exports."""
    from etgraph.model import LoadedModel

    with caplog.at_level("WARNING", logger="etgraph.model"):
        model = LoadedModel.load(dynamo_exports["kept"])
    assert not caplog.records
    kinds = [t.kind for t in model.tensors]
    assert kinds.count("gamma") == kinds.count("beta") == 5 and kinds.count("kernel") == 6
    out = tmp_path / "run"
    args = ["--data", image_folder, "--epochs", "2", "--period", "1", "--batch-size", "4"]
    done = run_cli_in_process(
        "train", dynamo_exports["kept"], *args, "--out", out, "--quiet", env=cache_env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "model_trained.onnx").is_file()


# ---- compile --data, then train DIR ------------------------------------------------------


@pytest.mark.slow
def test_train_dir_uses_the_compiled_data(tmp_path, tiny_cnn_onnx, image_folder, cache_env):
    """``etgraph compile model.onnx --data DIR -o RUN`` then the printed ``etgraph train RUN``:
    the run trains on DIR (plan.json records it), not on the default digits."""
    import json

    run = tmp_path / "run"
    done = run_cli_in_process(
        "compile", tiny_cnn_onnx, "--data", image_folder, "-o", run, env=cache_env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"next: etgraph train {run}" in done.stdout
    plan = json.loads((run / "plan.json").read_text())
    assert plan["data"] == str(image_folder.resolve()) and plan["tokenizer"] is None
    out = tmp_path / "train"
    done = run_cli_in_process("train", run, "--epochs", "1", "--out", out, "--quiet", env=cache_env)
    assert done.returncode == 0, done.stderr[-3000:]
    config = json.loads((out / "run.json").read_text())["config"]
    assert config["data"] == str(image_folder.resolve())
    classes = json.loads((out / "classes.json").read_text())["class_names"]
    assert classes == ["class_0", "class_1", "class_2"]


# ---- channels-last image models (Keras through tf2onnx) -----------------------------------


class ChannelsLast(torch.nn.Module):
    """A Keras-style classifier: input ``[B, 32, 32, 3]``, transposed to channels first for
    the convolutions as tf2onnx writes it, 3 classes."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 3),
        )  # fmt: skip

    def forward(self, x):
        return self.body(x.permute(0, 3, 1, 2))


def test_image_layout():
    from etgraph.images import image_layout

    assert image_layout((96, 96, 3)) == "NHWC" and image_layout((28, 28, 1)) == "NHWC"
    assert image_layout((3, 96, 96)) == "NCHW" and image_layout((3, 3, 3)) == "NCHW"


@pytest.mark.slow
def test_channels_last_model_trains_on_an_image_folder(tmp_path, cache_env, image_folder):
    from etgraph.data import load_task_data
    from etgraph.model import LoadedModel

    path = tmp_path / "nhwc.onnx"
    torch.onnx.export(
        ChannelsLast().train(), torch.zeros(1, 32, 32, 3), str(path), dynamo=False,
        training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
        input_names=["input"], output_names=["logits"], opset_version=17,
    )  # fmt: skip
    model = LoadedModel.load(path)
    data = load_task_data(
        str(image_folder), inputs=model.inputs, shapes=model.input_shapes(), task=model.task
    )
    x, y = data.probe_batch(4, seed=0)
    assert x.shape == (4, 32, 32, 3) and y.shape == (4,)
    out = tmp_path / "run"
    args = ["--data", image_folder, "--epochs", "1", "--rho", "1"]
    done = run_cli_in_process("train", path, *args, "--out", out, "--quiet", env=cache_env)
    assert done.returncode == 0, done.stderr[-3000:]


def test_data_mismatch_is_an_error_before_profiling(tmp_path, tiny_cnn_onnx):
    """compile --data whose classes the model cannot output: the error comes before anything
    is measured (no profile written to the cache)."""
    from etgraph.errors import DataError
    from etgraph.pipeline import compile_model

    folder = tmp_path / "images"
    for c in range(11):  # tiny_cnn outputs 10 classes
        (folder / f"c{c}").mkdir(parents=True)
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(folder / f"c{c}" / "0.png")
    with pytest.raises(DataError, match="has 11 classes but the model outputs 10"):
        compile_model(tiny_cnn_onnx, tmp_path / "out", data=str(folder), cache_dir=tmp_path / "c")
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


# ---- what to do, for the model's exporter --------------------------------------------------


def test_remedy_follows_the_exporter_and_the_package():
    from etgraph.exporters import exporter_of, package_of, remedy

    assert exporter_of("pytorch") == "torch" and exporter_of("tf2onnx") == "tf2onnx"
    assert exporter_of("PaddlePaddle") == "" and exporter_of("paddle2onnx") == "paddle2onnx"
    assert remedy("fix it", producer_name="pytorch", torch="x.flatten(1)") == (
        "fix it (x.flatten(1)) and re-export"
    )
    assert remedy("fix it", producer_name="tf2onnx", torch="x.flatten(1)") == (
        "fix it in the TensorFlow/Keras (or JAX through jax2tf) model and convert it again "
        "with tf2onnx"
    )
    assert remedy("fix it", producer_name="", torch="x") == "fix it and re-export"
    wheel = "/venv/lib/python3.11/site-packages/rapidocr_onnxruntime/models/cls.onnx"
    assert package_of(wheel) == "rapidocr_onnxruntime" and package_of("/tmp/m.onnx") is None
    assert remedy("fix it", producer_name="pytorch", source=wheel, needed="a rewrite of X") == (
        "the model ships in the package 'rapidocr_onnxruntime' and cannot be re-exported: "
        "etgraph would need a rewrite of X to train it"
    )


def test_no_op_before_the_head_is_dropped_so_legalisation_is_idempotent(tmp_path):
    """paddle2onnx ends a classifier ``Add -> Identity -> Softmax``: once the Softmax is off,
    the Identity ends the output; it is dropped then too, or the compiled model.onnx would
    legalise into another graph (another hash: ``train DIR`` refused its own profile)."""
    from onnx import TensorProto, helper

    from etgraph.onnx_io import legalize, model_hash

    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"], name="matmul"),
        helper.make_node("Add", ["mm", "b"], ["logits"], name="add"),
        helper.make_node("Identity", ["logits"], ["kept"], name="scale"),
        helper.make_node("Softmax", ["kept"], ["probs"], name="softmax", axis=1),
    ]
    inits = [
        onnx.numpy_helper.from_array(np.ones((8, 3), np.float32), "w"),
        onnx.numpy_helper.from_array(np.zeros(3, np.float32), "b"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["N", 3])], initializer=inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    once = legalize(model)
    assert [n.op_type for n in once.graph.node] == ["MatMul", "Add"]
    assert model_hash(legalize(once)) == model_hash(once)
