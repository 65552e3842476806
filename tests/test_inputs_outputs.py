"""Model inputs and outputs in general (issues #14, #15): several graph inputs of any dtype fed
by name, token inputs and embedding tables, per-input ``--input-shape``, ``--output NAME``,
``--loss ce|mse`` and ``--data FILE.npz``.

The text model is a tiny BERT-style encoder built in plain torch (``nn.Embedding`` for tokens
and token types, a learned position tensor, LayerNorm, one ``TransformerEncoderLayer``, a masked
mean-pool and a Linear head), exported with the TorchScript exporter at opset 17: three int64
inputs ``input_ids``, ``attention_mask``, ``token_type_ids`` ``[B, 8]``, logits ``[B, 3]``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import assert_user_error, make_model, random_initializer, run_cli_in_process
from onnx import TensorProto, helper

from etgraph import cli_options
from etgraph.arrays import load_npz_dataset
from etgraph.data import load_task_data
from etgraph.dumps import read_graph
from etgraph.errors import ConfigError, DataError
from etgraph.graph import build_tensor_graph, charges
from etgraph.io_specs import LOSSES, InputSpec, Task, input_shapes
from etgraph.model import LoadedModel
from etgraph.ops import data_path_values
from etgraph.sessions import evaluate_onnx

VOCAB, SEQ, CLASSES = 50, 8, 3
TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def export_tiny_bert(path: Path, seed: int = 0) -> Path:
    """The tiny BERT-style classifier of the module docstring, exported to ``path``."""
    import torch
    from torch import nn

    class TinyBert(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(VOCAB, 16)
            self.typ = nn.Embedding(2, 16)
            self.pos = nn.Parameter(torch.randn(1, SEQ, 16) * 0.02)
            self.norm = nn.LayerNorm(16)
            self.enc = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
            self.head = nn.Linear(16, CLASSES)

        def forward(self, input_ids, attention_mask, token_type_ids):
            h = self.norm(self.tok(input_ids) + self.typ(token_type_ids) + self.pos)
            h = self.enc(h, src_key_padding_mask=attention_mask == 0)
            m = attention_mask.unsqueeze(-1).to(h.dtype)
            return self.head((h * m).sum(1) / m.sum(1).clamp(min=1.0))

    torch.manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    ones, zeros = torch.ones(2, SEQ, dtype=torch.long), torch.zeros(2, SEQ, dtype=torch.long)
    torch.onnx.export(
        TinyBert(),
        (ids, ones, zeros),
        str(path),
        dynamo=False,
        opset_version=17,
        training=torch.onnx.TrainingMode.TRAINING,
        do_constant_folding=False,
        input_names=list(TEXT_INPUTS),
        output_names=["logits"],
        dynamic_axes={n: {0: "batch"} for n in (*TEXT_INPUTS, "logits")},
    )
    return path


def text_npz(path: Path, n: int = 40, **override) -> Path:
    """Token data for the tiny BERT: the class is the first token id mod 3."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (n, SEQ))
    mask = np.ones((n, SEQ), np.int64)
    mask[::3, 6:] = 0
    arrays = {
        "input_ids": ids,
        "attention_mask": mask,
        "token_type_ids": np.zeros((n, SEQ), np.int64),
        "labels": (ids[:, 0] % CLASSES).astype(np.int64),
    }
    arrays.update(override)
    np.savez(path, **{k: v for k, v in arrays.items() if v is not None})
    return path


@pytest.fixture(scope="module")
def bert_onnx(tmp_path_factory) -> Path:
    return export_tiny_bert(tmp_path_factory.mktemp("text") / "tiny_bert.onnx")


@pytest.fixture(scope="module")
def bert(bert_onnx) -> LoadedModel:
    return LoadedModel.load(bert_onnx)


def regression_model(two_outputs: bool = False) -> onnx.ModelProto:
    """x [N, 4] -> Gemm -> Relu -> Gemm -> y [N, 2] (and aux = Sigmoid(y) when asked)."""
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1", transB=1),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Gemm", ["r", "w2", "b2"], ["y"], name="fc2", transB=1),
    ]
    inits = [
        random_initializer("w1", (8, 4), 0, 0.5),
        random_initializer("b1", (8,), 1),
        random_initializer("w2", (2, 8), 2, 0.5),
        random_initializer("b2", (2,), 3),
    ]
    if two_outputs:
        nodes.append(helper.make_node("Sigmoid", ["y"], ["aux"], name="sig"))
    model = make_model(nodes, inits, in_shape=("N", 4), out_shape=("N", 2))
    if two_outputs:
        model.graph.output.append(helper.make_tensor_value_info("aux", TensorProto.FLOAT, ["N", 2]))
    return model


# ---- inputs: names, dtypes, the data path from token ids -------------------------------------


def test_token_inputs_are_specs_and_embeddings_are_tensors(bert):
    assert [(i.name, i.dtype, i.dims) for i in bert.inputs] == [
        (name, "int64", ("batch", SEQ)) for name in TEXT_INPUTS
    ]
    # valid ids: the rows of the table each input indexes; the mask indexes nothing
    assert [i.index_rows for i in bert.inputs] == [VOCAB, None, 2]
    kinds = {t.name: t.kind for t in bert.tensors}
    assert kinds["tok.weight"] == kinds["typ.weight"] == kinds["pos"] == "embedding"
    assert [t.name for t in bert.tensors][:2] == ["tok.weight", "typ.weight"]  # nearest the input
    assert len(bert.tensors) == 19 and bert.task == Task("ce", "logits", CLASSES)
    assert bert.input_shapes() == {name: (SEQ,) for name in TEXT_INPUTS}


def test_data_path_starts_at_integer_inputs_through_lookups():
    """ids -> Gather(table) is on the data path, so the table is found; a mask Cast to float is
    on it too; shape arithmetic on the ids is not; without the lookup nothing is."""
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["e"], name="lookup"),
        helper.make_node("Cast", ["ids"], ["f"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("Shape", ["ids"], ["s"], name="shape"),
        helper.make_node("ReduceMean", ["e"], ["y"], name="mean", axes=[1], keepdims=0),
    ]
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 4])
    model = make_model(
        nodes, [random_initializer("table", (10, 3))], inputs=[ids], out_shape=("N", 3)
    )
    carrying = data_path_values(model.graph, from_initializers=False)
    assert {"e", "f", "y"} <= carrying and not {"s", "ids"} & carrying
    loaded = LoadedModel.from_proto(model, source="m")
    assert [(t.name, t.kind) for t in loaded.tensors] == [("table", "embedding")]
    assert loaded.inputs == (InputSpec("ids", "int64", ("N", 4), 10),)


def test_op_without_gradient_on_token_ids_is_not_refused(tmp_path):
    """Position ids as a CumSum of the mask (GPT-2 style): CumSum has no gradient in ORT
    1.19.2, but no gradient flows into integer inputs, so it is no reason to refuse the model."""
    nodes = [
        helper.make_node("Constant", [], ["axis"], name="axis",
                         value=helper.make_tensor("a", TensorProto.INT64, [], [1])),
        helper.make_node("CumSum", ["mask", "axis"], ["pos"], name="cumsum"),
        helper.make_node("Gather", ["table", "pos"], ["e"], name="lookup"),
        helper.make_node("ReduceMean", ["e"], ["y"], name="mean", axes=[1], keepdims=0),
    ]  # fmt: skip
    mask = helper.make_tensor_value_info("mask", TensorProto.INT64, ["N", 4])
    model = make_model(nodes, [random_initializer("table", (10, 3))], inputs=[mask],
                       out_shape=("N", 3))  # fmt: skip
    onnx.save(model, str(tmp_path / "m.onnx"))
    loaded = LoadedModel.load(tmp_path / "m.onnx")
    assert [t.name for t in loaded.tensors] == ["table"]


def test_embedding_gradient_is_t_dw_only(bert):
    """GatherGrad (the scatter into the table) is the table's t_dw, charged by the embedding
    pass; nothing is charged to an embedding's t_dy but the op summing the token and type
    lookups' gradients (needed when either trains)."""
    graph = build_tensor_graph(bert.with_batch(2, bert.input_shapes()))
    rows = list(charges(graph).values())
    scatter = [c for c in rows if c.op_type == "GatherGrad"]
    assert sorted((c.kind, c.tensor, c.rule) for c in scatter) == [
        ("dw", "tok.weight", "embedding"),
        ("dw", "typ.weight", "embedding"),
    ]
    on_dy = [c for c in rows if c.kind == "dy" and c.tensor in ("tok.weight", "pos")]
    assert on_dy == []
    assert graph.graph["input_names"] == list(TEXT_INPUTS)


# ---- --input-shape per input -------------------------------------------------------------------


def symbolic_text_specs() -> list[InputSpec]:
    return [InputSpec("input_ids", "int64", ("batch", "seq"), 30), InputSpec("mask", "int64",
            ("batch", "seq"))]  # fmt: skip


def test_per_input_shapes():
    specs = symbolic_text_specs()
    assert input_shapes(specs, ["input_ids=1x16", "mask=16"]) == {"input_ids": (16,), "mask": (16,)}
    # one shape sets a named dim for every input that shares it (a transformer's sequence;
    # was: the others' shapes required, and unequal lengths failed in ORT's shape inference)
    assert input_shapes(specs, ["input_ids=16"]) == {"input_ids": (16,), "mask": (16,)}
    with pytest.raises(ConfigError, match=r"^--input-shape gives dim 'seq' length 16 for "
                       r"input_ids and 8 for mask: inputs that share it take one"):  # fmt: skip
        input_shapes(specs, ["input_ids=16", "mask=8"])
    unnamed = [specs[0], InputSpec("mask", "int64", ("batch", "?"))]
    with pytest.raises(ConfigError, match=r"^input 'mask' has symbolic dims \['batch', '\?'\]: "
                       r"pass its shape with --input-shape mask=DIMS"):  # fmt: skip
        input_shapes(unnamed, ["input_ids=16"])
    with pytest.raises(ConfigError, match="names no input, and the model has 2 inputs"):
        input_shapes(specs, "16")
    with pytest.raises(ConfigError, match=r"names 'ids', which is not an input of the model"):
        input_shapes(specs, ["ids=16", "mask=16"])
    with pytest.raises(ConfigError, match="does not fit input 'mask' of rank 2"):
        input_shapes(specs, ["input_ids=16", "mask=2x3x4"])


def test_changed_static_dim_another_input_shares_is_refused():
    # a static export: input_ids and the mask both [1, 16], with nothing that ties the two; one
    # --input-shape input_ids=8 left the mask at 16, and ORT's shape inference then failed with
    # "Incompatible dimensions", blamed on the batch size
    static = [InputSpec("input_ids", "int64", (1, 16), 30), InputSpec("mask", "int64", (1, 16))]
    with pytest.raises(ConfigError, match=r"^--input-shape changes dim 1 of 'input_ids' from the "
                       r"model's static 16 to 8, and input 'mask' is static 16 there too: give its "
                       r"shape as well \(--input-shape mask=8;"):  # fmt: skip
        input_shapes(static, ["input_ids=8"])
    assert input_shapes(static, ["input_ids=8", "mask=8"]) == {"input_ids": (8,), "mask": (8,)}
    assert input_shapes(static, ["input_ids=8", "mask=16"]) == {"input_ids": (8,), "mask": (16,)}
    assert input_shapes(static, ["input_ids=16"]) == {"input_ids": (16,), "mask": (16,)}
    other = [static[0], InputSpec("mask", "int64", (1, 12))]  # not the changed length: no tie
    assert input_shapes(other, ["input_ids=8"]) == {"input_ids": (8,), "mask": (12,)}


def test_symbolic_token_input_without_shape_is_one_line(tmp_path, cache_env):
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["e"], name="lookup"),
        helper.make_node("ReduceMean", ["e"], ["y"], name="mean", axes=[1], keepdims=0),
    ]
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", "T"])
    model = make_model(nodes, [random_initializer("table", (10, 3))], inputs=[ids],
                       out_shape=("N", 3))  # fmt: skip
    onnx.save(model, str(tmp_path / "m.onnx"))
    done = run_cli_in_process("compile", tmp_path / "m.onnx", "-o", tmp_path / "out", env=cache_env)
    assert_user_error(done, "input 'ids' has symbolic dims", "--input-shape")


# ---- --output and --loss -----------------------------------------------------------------------


def test_several_outputs_need_output(tmp_path, cache_env):
    path = tmp_path / "two.onnx"
    onnx.save(regression_model(two_outputs=True), str(path))
    done = run_cli_in_process("compile", path, "-o", tmp_path / "out", "--loss", "mse",
                              env=cache_env)  # fmt: skip
    assert_user_error(done, "has 2 outputs ['y', 'aux']", "--output NAME")
    done = run_cli_in_process("compile", path, "-o", tmp_path / "out", "--output", "z",
                              env=cache_env)  # fmt: skip
    assert_user_error(done, "has no output 'z'", "choose --output from ['y', 'aux']")
    loaded = LoadedModel.load(path, output="y", loss="mse")
    assert [o.name for o in loaded.proto.graph.output] == ["y"]
    assert "sig" not in {n.name for n in loaded.proto.graph.node}
    assert loaded.task == Task("mse", "y", 2) and loaded.num_classes is None


def test_inspect_a_model_of_several_outputs(tmp_path):
    path = tmp_path / "two.onnx"
    onnx.save(regression_model(two_outputs=True), str(path))
    done = run_cli_in_process("inspect", path, "--out", tmp_path / "g")
    assert_user_error(done, "has 2 outputs", "--output NAME")
    done = run_cli_in_process("inspect", path, "--output", "y", "--loss", "mse", "--out",
                              tmp_path / "g", "--format", "json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    dumped = json.loads((tmp_path / "g" / "graph.json").read_text())["graph"]
    assert (dumped["output_name"], dumped["loss"], dumped["input_names"]) == ("y", "mse", ["x"])


def test_profile_a_model_of_several_outputs(tmp_path, cache_env):
    path = tmp_path / "two.onnx"
    onnx.save(regression_model(two_outputs=True), str(path))
    done = run_cli_in_process("profile", path, "--loss", "mse", env=cache_env)
    assert_user_error(done, "has 2 outputs", "--output NAME")
    out = tmp_path / "p.json"
    args = ("--output", "y", "--loss", "mse", "--batch-size", "2", "--repeats", "1", "-o", out)
    done = run_cli_in_process("profile", path, *args, "--warmup", "0", env=cache_env)
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert data["loss"] == "mse" and len(data["tensor_timings"]) == 4


def test_loss_fits_the_output(tmp_path):
    path = tmp_path / "m.onnx"
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], name="conv")]
    onnx.save(make_model(nodes, [random_initializer("w", (4, 3, 3, 3))], out_shape=(1, 4, 6, 6)),
              str(path))  # fmt: skip
    with pytest.raises(Exception, match=r"--loss mse trains an output \[B, D\]"):
        LoadedModel.load(path, loss="mse")
    with pytest.raises(ConfigError, match="unknown loss 'l1': choose one of ce, mse"):
        LoadedModel.load(path, loss="l1")


def test_cli_losses_are_the_models():
    assert cli_options.CLI_LOSSES == LOSSES


# ---- --data FILE.npz -----------------------------------------------------------------------------


def test_npz_dataset_batches_by_input_name(tmp_path, bert):
    ds = load_task_data(text_npz(tmp_path / "d.npz"), inputs=bert.inputs,
                        shapes=bert.input_shapes(), task=bert.task, seed=1)  # fmt: skip
    assert (ds.n_train, ds.n_val) == (32, 8) and ds.num_classes == CLASSES
    # stratified: every class is in the validation part
    assert set(ds.labels[ds.val_index]) == {0, 1, 2}
    x, y = next(ds.train_batches(4, seed=0))
    assert sorted(x) == sorted(TEXT_INPUTS) and x["input_ids"].shape == (4, SEQ)
    assert x["input_ids"].dtype == np.int64 and y.dtype == np.int64 and y.shape == (4,)
    sizes = [len(yb) for _, yb in ds.val_batches(3)]
    assert sizes == [3, 3, 2]


def test_image_data_for_a_text_model_is_one_line(bert):
    with pytest.raises(DataError, match=r"this model has inputs \['input_ids', .*--data FILE.npz"):
        load_task_data("digits", inputs=bert.inputs, shapes=bert.input_shapes(), task=bert.task)


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        ({"attention_mask": None}, ["no array 'attention_mask'", "keyed by input name"]),
        ({"input_ids": np.zeros((40, SEQ), np.float32)}, ["'input_ids' is float32",
                                                          "save it as int64"]),
        ({"token_type_ids": np.zeros((40, 4), np.int64)}, ["'token_type_ids' has shape [40, 4]",
                                                           "[N, 8]"]),
        ({"labels": None}, ["no 'labels' array", "int class indices"]),
        ({"labels": np.full(40, 7, np.int64)}, ["labels range over 7..7",
                                                "has 3 classes", "labels 0..2"]),
        ({"labels": np.zeros(40, np.float32)}, ["--loss ce takes int class indices"]),
        ({"input_ids": np.full((40, SEQ), VOCAB, np.int64)}, ["ids up to 50",
                                                              "table has 50 rows", "tokenizer"]),
        ({"labels": np.zeros(39, np.int64)}, ["'labels' has 39 rows, the inputs 40"]),
        ({"input_ids": np.full((40, SEQ), -1, np.int64)}, ["negative ids (down to -1)",
                                                            "pad id"]),
    ],
)  # fmt: skip
def test_bad_npz_is_one_line(tmp_path, bert, override, fragments):
    path = text_npz(tmp_path / "bad.npz", **override)
    with pytest.raises(DataError) as info:
        load_npz_dataset(path, inputs=bert.inputs, shapes=bert.input_shapes(), task=bert.task)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(path))
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_mse_targets_of_the_wrong_width(tmp_path):
    specs, task = [InputSpec("x", "float32", ("N", 4))], Task("mse", "y", 2)
    x = np.zeros((10, 4), np.float32)
    np.savez(tmp_path / "r.npz", x=x, labels=np.zeros((10, 3), np.float32))
    with pytest.raises(DataError, match=r"'labels' has shape \[10, 3\], but the model's output "
                       r"'y' is \[B, 2\]: give targets \[N, 2\]"):  # fmt: skip
        load_npz_dataset(tmp_path / "r.npz", inputs=specs, shapes={"x": (4,)}, task=task)
    np.savez(tmp_path / "i.npz", x=x, labels=np.zeros(10, np.int64))
    with pytest.raises(DataError, match="--loss mse takes float targets"):
        load_npz_dataset(tmp_path / "i.npz", inputs=specs, shapes={"x": (4,)}, task=task)
    x_nan = x.copy()
    x_nan[3, 1] = np.nan
    np.savez(tmp_path / "nan.npz", x=x_nan, labels=np.ones((10, 2), np.float32))
    with pytest.raises(DataError, match="array 'x' holds 1 NaN or infinite values: clean or drop"):
        load_npz_dataset(tmp_path / "nan.npz", inputs=specs, shapes={"x": (4,)}, task=task)
    np.savez(tmp_path / "inf.npz", x=x, labels=np.full((10, 2), np.inf, np.float32))
    with pytest.raises(DataError, match="'labels' holds 20 NaN or infinite targets"):
        load_npz_dataset(tmp_path / "inf.npz", inputs=specs, shapes={"x": (4,)}, task=task)
    np.savez(tmp_path / "ok.npz", x=x, labels=np.ones((10, 2), np.float64))
    ds = load_npz_dataset(tmp_path / "ok.npz", inputs=specs, shapes={"x": (4,)}, task=task)
    assert ds.labels.dtype == np.float32 and (ds.n_train, ds.n_val) == (8, 2)


def test_missing_npz_and_missing_input_through_the_cli(tmp_path, bert_onnx, cache_env):
    done = run_cli_in_process("compile", bert_onnx, "-o", tmp_path / "out", "--data",
                              tmp_path / "none.npz", "--repeats", "1", env=cache_env)  # fmt: skip
    assert_user_error(done, "none.npz does not exist", "numpy.savez")


# ---- end to end ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_text_model_compiles_and_trains_end_to_end(tmp_path, bert_onnx, cache_env):
    """`etgraph compile` profiles the embeddings (t_dw > 0; no backward op on the first one's t_dy);
    `etgraph train` on the compiled directory with an npz trains, and the exported model keeps
    the three inputs."""
    out = tmp_path / "bert"
    data = text_npz(tmp_path / "d.npz")
    # rho 1: the tiny model's step is mostly forward, and a noisy profile can put rho 0.5
    # below it (InfeasibleBudgetError)
    done = run_cli_in_process("compile", bert_onnx, "-o", out, "--data", data, "--repeats", "2",
                              "--rho", "1", env=cache_env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["input_shapes"] == {name: [SEQ] for name in TEXT_INPUTS}
    assert plan["task"] == {"loss": "ce", "output": "logits", "width": CLASSES}
    rows = {r["name"]: r for r in plan["tensors"]}
    for table in ("tok.weight", "typ.weight"):
        assert rows[table]["kind"] == "embedding" and rows[table]["t_dw_us"] > 0
    # nothing upstream of the first lookup needs a gradient: no backward op on its t_dy (the
    # profile may still move a share of the lookup's forward time there, as for every layer)
    graph_charges = charges(read_graph(out / "graph.json")).values()
    assert not [c for c in graph_charges if c.kind == "dy" and c.tensor == "tok.weight"]
    run = tmp_path / "run"
    done = run_cli_in_process("train", out, "--data", data, "--epochs", "2", "--period", "1",
                              "--rho", "1", "--out", run, "--quiet", env=cache_env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "val accuracy" in done.stdout
    trained = run / "model_trained.onnx"
    session = ort.InferenceSession(str(trained), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == list(TEXT_INPUTS)
    assert [o.name for o in session.get_outputs()] == ["logits"]
    summary = json.loads((run / "summary.json").read_text())
    assert 0.0 <= summary["inference_val_acc"] <= 1.0


@pytest.mark.slow
def test_regression_with_mse_trains_and_reports_mse(tmp_path, cache_env):
    """A two-output regression model: --output y --loss mse; the validation MSE falls and the
    exported model's MSE is the one the run reports."""
    path = tmp_path / "reg.onnx"
    onnx.save(regression_model(two_outputs=True), str(path))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4)).astype(np.float32)
    t = np.stack([x[:, 0] - x[:, 1], 0.5 * x[:, 2]], 1).astype(np.float32)
    np.savez(tmp_path / "r.npz", x=x, labels=t)
    run = tmp_path / "run"
    done = run_cli_in_process("train", path, "--output", "y", "--loss", "mse", "--data",
                              tmp_path / "r.npz", "--epochs", "6", "--period", "3", "--lr",
                              "1e-2", "--rho", "1", "--out", run, "--quiet",
                              env=cache_env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "val loss (MSE)" in done.stdout and "accuracy" not in done.stdout
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert log[-1]["val_loss"] < 0.7 * log[0]["val_loss"]
    assert json.loads((run / "run.json").read_text())["task"]["output"] == "y"
    ds = load_npz_dataset(tmp_path / "r.npz", inputs=[InputSpec("x", "float32", ("N", 4))],
                          shapes={"x": (4,)}, task=Task("mse", "y", 2))  # fmt: skip
    mse, metric = evaluate_onnx(run / "model_trained.onnx", ds.val_batches(4), 4, loss="mse",
                                output="y")  # fmt: skip
    assert mse == pytest.approx(log[-1]["val_loss"], rel=1e-4) and metric == mse
    # the exported model is the original one, both outputs, with the trained weights
    session = ort.InferenceSession(str(run / "model_trained.onnx"))
    assert [o.name for o in session.get_outputs()] == ["y", "aux"]
    y, aux = session.run(None, {"x": x[:4]})
    np.testing.assert_allclose(aux, 1 / (1 + np.exp(-y)), rtol=1e-5)
    before = ort.InferenceSession(str(path)).run(["y"], {"x": x[:4]})[0]
    assert not np.allclose(y, before)
