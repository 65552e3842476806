"""Text data (etgraph/text.py) and the class-name mapping (etgraph/labels.py): tokenization to
the model's token inputs, stratified split, label mapping and every bad input's one-line error."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from etgraph.data import load_task_data
from etgraph.errors import DataError
from etgraph.io_specs import InputSpec, Task
from etgraph.labels import (
    METADATA_KEY,
    load_class_names,
    map_labels,
    read_onnx_class_names,
    save_class_names,
    stamp_onnx,
)
from etgraph.text import (
    check_text_options,
    is_text_file,
    load_text_data,
    load_tokenizer,
    read_text_file,
    tokenize,
)
from tests.helpers import assert_user_error, run_cli_in_process

WORDS = ["good", "bad", "great", "awful", "film", "the", "was", "plot", "acting", "fine"]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
VOCAB = len(SPECIAL) + len(WORDS)


def make_tokenizer(path, words=WORDS) -> Tokenizer:
    """A word-level BERT-like tokenizer: [PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3, then ``words``."""
    vocab = {tok: i for i, tok in enumerate([*SPECIAL, *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    tok.save(str(path))
    return tok


def write_csv(path, rows, header=("text", "label")):
    import csv

    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


ROWS = [
    ("the film was good", "pos"),
    ("great acting", "pos"),
    ("the plot was fine", "pos"),
    ("good good good", "pos"),
    ("the film was bad", "neg"),
    ("awful acting", "neg"),
    ("bad plot", "neg"),
    ("awful awful film was the bad plot acting", "neg"),
]


@pytest.fixture
def tok_path(tmp_path):
    path = tmp_path / "tokenizer.json"
    make_tokenizer(path)
    return path


def test_is_text_file():
    assert is_text_file("a/b.csv") and is_text_file("x.JSONL")
    assert not is_text_file("images/") and not is_text_file(None) and not is_text_file("a.npz")


def test_csv_tokenized_to_model_inputs(tmp_path, tok_path):
    data = load_text_data(
        write_csv(tmp_path / "d.csv", ROWS),
        tok_path,
        input_names=["input_ids", "attention_mask", "token_type_ids"],
        seq_len=6,
        vocab_rows=len(SPECIAL) + len(WORDS),
        num_classes=2,
    )
    assert data.class_names == ["neg", "pos"]  # sorted string labels
    assert data.labels.tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    ids = data.inputs["input_ids"]
    assert ids.dtype == np.int64 and ids.shape == (8, 6)
    # "the film was good" -> [CLS] the film was good [SEP]
    assert ids[0].tolist() == [2, 9, 8, 10, 4, 3]
    # "great acting" -> [CLS] great acting [SEP] [PAD] [PAD]
    assert ids[1].tolist() == [2, 6, 12, 3, 0, 0]
    assert data.inputs["attention_mask"][1].tolist() == [1, 1, 1, 1, 0, 0]
    assert data.inputs["token_type_ids"].sum() == 0
    # truncated to T tokens, still ending with [SEP]
    assert ids[7].tolist()[-1] == 3 and data.inputs["attention_mask"][7].sum() == 6
    assert list(data.inputs) == ["input_ids", "attention_mask", "token_type_ids"]


def test_jsonl_and_integer_labels(tmp_path, tok_path):
    path = tmp_path / "d.jsonl"
    lines = [json.dumps({"text": t, "label": int(lab == "pos") * 2}) for t, lab in ROWS]
    path.write_text("\n".join(lines) + "\n\n")
    data = load_text_data(path, tok_path, input_names=["input_ids"], seq_len=8, num_classes=3)
    assert data.class_names == ["0", "1", "2"]  # indices as themselves, K names
    assert set(data.labels.tolist()) == {0, 2}
    assert list(data.inputs) == ["input_ids"]


def test_existing_mapping_is_applied(tmp_path, tok_path):
    data = load_text_data(
        write_csv(tmp_path / "d.csv", ROWS),
        tok_path,
        input_names=["input_ids"],
        seq_len=4,
        class_names=["pos", "neg", "neutral"],
        num_classes=3,
    )
    assert data.class_names == ["pos", "neg", "neutral"]
    assert data.labels.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


def test_pad_id_from_tokenizer(tmp_path):
    path = tmp_path / "tok.json"
    tok = make_tokenizer(path, WORDS)
    tok.enable_padding(pad_id=7, pad_token="film")  # a tokenizer that pads with its own id
    tok.save(str(path))
    out = tokenize(Tokenizer.from_file(str(path)), ["good"], 5, ["input_ids"])
    assert out["input_ids"].tolist() == [[2, 4, 3, 7, 7]]


# ----------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    ("header", "missing"), [(("sentence", "label"), "'text'"), (("text", "y"), "'label'")]
)
def test_csv_without_columns(tmp_path, header, missing):
    path = write_csv(tmp_path / "d.csv", ROWS, header=header)
    with pytest.raises(DataError, match=rf"has no {missing} column .*needs 'text' and 'label'"):
        read_text_file(path)


def test_jsonl_without_columns(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"sentence": "good", "label": "pos"}) + "\n")
    with pytest.raises(DataError, match=r"has no 'text' column \(columns: sentence, label\)"):
        read_text_file(path)


def test_row_without_label(tmp_path):
    path = write_csv(tmp_path / "d.csv", [("good", "pos"), ("bad", "")])
    with pytest.raises(DataError, match=r"d.csv:3: the row has no label"):
        read_text_file(path)


def test_jsonl_list_or_object_is_not_a_text_or_label(tmp_path):
    """str() of it was trained on: "['good', 'film']", brackets and quotes."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a", "label": 1}\n{"text": ["good", "film"], "label": 0}\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: the row's 'text' is a JSON list, not one"):
        read_text_file(path)
    path.write_text('{"text": "a", "label": {"id": 1}}\n')
    with pytest.raises(DataError, match=r"d.jsonl:1: the row's 'label' is a JSON object"):
        read_text_file(path)


def test_csv_row_of_more_fields_than_the_header(tmp_path):
    """An unquoted comma: the text was cut there and the rest dropped, silently (label first),
    or the label taken from the text."""
    path = tmp_path / "d.csv"
    path.write_text('label,text\npos,"quoted, fine"\nneg,great, really\n')
    with pytest.raises(DataError, match=r"d.csv:3: the row has 3 fields, the header 2: quote"):
        read_text_file(path)


def test_bad_jsonl_line_and_suffix(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a", "label": 1}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: not a JSON object"):
        read_text_file(path)
    path.write_text('{"text": "a", "label": 1}\n{oops\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: not JSON"):
        read_text_file(path)
    other = tmp_path / "d.txt"
    other.write_text("text,label\n")
    with pytest.raises(DataError, match=r"must be a .csv or .jsonl file"):
        read_text_file(other)
    with pytest.raises(DataError, match=r"does not exist"):
        read_text_file(tmp_path / "nope.csv")
    empty = write_csv(tmp_path / "e.csv", [])
    with pytest.raises(DataError, match=r"has no rows"):
        read_text_file(empty)


def test_tokenizer_vocabulary_must_fit_embedding(tmp_path, tok_path):
    size = len(SPECIAL) + len(WORDS)
    assert load_tokenizer(tok_path, vocab_rows=size).get_vocab_size() == size
    load_tokenizer(tok_path, vocab_rows=size + 64)  # a padded table is fine
    with pytest.raises(DataError, match=rf"vocabulary of {size} tokens but the model's embedding"):
        load_tokenizer(tok_path, vocab_rows=size - 1)  # ids would index past the table
    with pytest.raises(DataError, match=r"embedding table has 30522 rows: use the tokenizer"):
        load_tokenizer(tok_path, vocab_rows=30522)  # another model's tokenizer
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a tokenizer"}')
    with pytest.raises(DataError, match=r"is not a tokenizers tokenizer.json"):
        load_tokenizer(bad)
    with pytest.raises(DataError, match=r"does not exist: give the model's tokenizer.json"):
        load_tokenizer(tmp_path / "missing.json")


def test_labels_outside_head(tmp_path, tok_path):
    csv_path = write_csv(tmp_path / "d.csv", ROWS)
    with pytest.raises(DataError, match=r"2 distinct labels but the model outputs 1 classes"):
        load_text_data(csv_path, tok_path, input_names=["input_ids"], seq_len=4, num_classes=1)
    ints = write_csv(tmp_path / "i.csv", [("good", "0"), ("bad", "5")])
    with pytest.raises(DataError, match=r"label 5 is outside the model's 3 classes \(0..2\)"):
        load_text_data(ints, tok_path, input_names=["input_ids"], seq_len=4, num_classes=3)
    with pytest.raises(DataError, match=r"label 'neg' is not one of the model's classes"):
        load_text_data(
            csv_path, tok_path, input_names=["input_ids"], seq_len=4, class_names=["pos", "x"]
        )


def test_non_token_input(tok_path):
    with pytest.raises(DataError, match=r"model input 'pixel_values' is not a token input"):
        tokenize(load_tokenizer(tok_path), ["good"], 4, ["input_ids", "pixel_values"])


# ----------------------------------------------------------------------------- labels module


def test_map_labels_rules():
    assert map_labels(["b", "a", "b"]) == (["a", "b"], pytest.approx(np.array([1, 0, 1])))
    names, y = map_labels(["1", "0"], num_classes=4)
    assert names == ["0", "1", "2", "3"] and y.tolist() == [1, 0]
    # a float column's integers are indices as well: 1.0 and 3.0 trained outputs 0 and 1
    names, y = map_labels(["1.0", "3.0"], num_classes=4)
    assert names == ["0", "1", "2", "3"] and y.tolist() == [1, 3]
    assert map_labels(["1.5", "3.0"])[0] == ["1.5", "3.0"]
    names, y = map_labels(["1", "x"])  # not all integers: strings
    assert names == ["1", "x"] and y.dtype == np.int64
    with pytest.raises(DataError, match=r"has no labelled examples"):
        map_labels([])
    with pytest.raises(DataError, match=r"3 class names but the model outputs 2"):
        map_labels(["a"], class_names=["a", "b", "c"], num_classes=2)


def test_class_names_saved_and_stamped(tmp_path):
    assert load_class_names(tmp_path) is None
    save_class_names(tmp_path, ["neg", "pos"])
    assert load_class_names(tmp_path) == ["neg", "pos"]
    (tmp_path / "classes.json").write_text("[1]")
    with pytest.raises(DataError, match=r"is not a class-name mapping"):
        load_class_names(tmp_path)

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    path = tmp_path / "m.onnx"
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
        str(path),
    )
    assert read_onnx_class_names(path) is None
    stamp_onnx(path, ["neg", "pos"])
    stamp_onnx(path, ["négatif", "pos"])  # replaced, not duplicated; non-ASCII kept
    model = onnx.load(str(path))
    assert [p.key for p in model.metadata_props] == [METADATA_KEY]
    assert read_onnx_class_names(path) == ["négatif", "pos"]
    import onnxruntime as ort

    meta = ort.InferenceSession(str(path)).get_modelmeta().custom_metadata_map
    assert json.loads(meta[METADATA_KEY]) == ["négatif", "pos"]


# ----------------------------------------------------------------------------- load_task_data


def _token_model(n_inputs=2, seq_len=6, rows=VOCAB, width=2):
    names = ["input_ids", "attention_mask", "token_type_ids"][:n_inputs]
    specs = [
        InputSpec(name, "int64", ("batch", seq_len), rows if name == "input_ids" else None)
        for name in names
    ]
    return specs, {name: (seq_len,) for name in names}, Task("ce", "logits", width)


def test_load_task_data_text(tmp_path, tok_path):
    specs, shapes, task = _token_model()
    ds = load_task_data(
        write_csv(tmp_path / "d.csv", ROWS),
        inputs=specs,
        shapes=shapes,
        task=task,
        tokenizer=tok_path,
        val_fraction=0.25,
        seed=0,
    )
    assert ds.class_names == ["neg", "pos"] and ds.num_classes == 2
    # stratified: one of each class in validation
    assert sorted(ds.labels[ds.val_index].tolist()) == [0, 1] and ds.n_train == 6
    x, y = next(ds.train_batches(3, seed=1))
    assert sorted(x) == ["attention_mask", "input_ids"] and x["input_ids"].shape == (3, 6)
    assert y.dtype == np.int64


def test_text_of_one_label_is_refused(tmp_path, tok_path):
    """As an image folder of one class: it trained to 100 % accuracy on nothing."""
    specs, shapes, task = _token_model()
    one = write_csv(tmp_path / "d.csv", [r for r in ROWS if r[1] == "pos"])
    with pytest.raises(DataError, match=r"d.csv has one label \('pos'\): a classifier learns"):
        load_task_data(one, inputs=specs, shapes=shapes, task=task, tokenizer=tok_path)


@pytest.mark.parametrize(("ids", "mask"), [("int32", "float32"), ("int64", "bool")])
def test_text_data_takes_each_inputs_dtype(tmp_path, tok_path, ids, mask):
    """A float or bool attention mask, int32 ids: fed in the model's dtypes (int64 made ORT's
    TrainStep fail with 'Unexpected input data type')."""
    specs = [
        InputSpec("input_ids", ids, ("batch", 6), VOCAB),
        InputSpec("attention_mask", mask, ("batch", 6), None),
    ]
    shapes = {"input_ids": (6,), "attention_mask": (6,)}
    ds = load_task_data(write_csv(tmp_path / "d.csv", ROWS), inputs=specs, shapes=shapes,
                        task=Task("ce", "logits", 2), tokenizer=tok_path)  # fmt: skip
    x, _ = next(ds.train_batches(3, seed=1))
    assert (x["input_ids"].dtype, x["attention_mask"].dtype) == (np.dtype(ids), np.dtype(mask))
    assert x["attention_mask"].any() and not x["attention_mask"].all()  # padding kept


def test_load_task_data_text_errors(tmp_path, tok_path):
    csv_path = write_csv(tmp_path / "d.csv", ROWS)
    specs, shapes, task = _token_model()
    with pytest.raises(DataError, match=r"needs the model's tokenizer: pass --tokenizer"):
        load_task_data(csv_path, inputs=specs, shapes=shapes, task=task)
    with pytest.raises(DataError, match=r"--tokenizer applies to text data"):
        load_task_data("digits", inputs=specs, shapes=shapes, task=task, tokenizer=tok_path)
    with pytest.raises(DataError, match=r"--loss mse needs --data FILE.npz"):
        load_task_data(
            csv_path,
            inputs=specs,
            shapes=shapes,
            task=Task("mse", "logits", 2),
            tokenizer=tok_path,
        )
    with pytest.raises(DataError, match=r"token inputs \[B, T\] of one length T"):
        load_task_data(
            csv_path,
            inputs=specs,
            shapes={"input_ids": (6,), "attention_mask": (5,)},
            task=task,
            tokenizer=tok_path,
        )
    # the model's embedding table (index_rows) is checked against the tokenizer
    specs, shapes, task = _token_model(rows=30522)
    with pytest.raises(DataError, match=r"embedding table has 30522 rows"):
        load_task_data(csv_path, inputs=specs, shapes=shapes, task=task, tokenizer=tok_path)
    specs, shapes, task = _token_model(width=1)
    with pytest.raises(DataError, match=r"2 distinct labels but the model outputs 1 classes"):
        load_task_data(csv_path, inputs=specs, shapes=shapes, task=task, tokenizer=tok_path)


def test_text_options_checked_before_profiling(tmp_path, tok_path):
    csv_path = write_csv(tmp_path / "d.csv", ROWS)
    check_text_options(csv_path, tok_path)
    check_text_options(None, None)
    check_text_options("images/", None)
    with pytest.raises(DataError, match=r"needs the model's tokenizer: pass --tokenizer"):
        check_text_options(csv_path, None)
    with pytest.raises(DataError, match=r"--tokenizer applies to text data"):
        check_text_options(None, tok_path)
    with pytest.raises(DataError, match=r"tokenizer .*missing.json does not exist"):
        check_text_options(csv_path, tmp_path / "missing.json")
    with pytest.raises(DataError, match=r"text file .*nope.jsonl does not exist"):
        check_text_options(tmp_path / "nope.jsonl", tok_path)


def test_cli_text_options_fail_fast(tmp_path, tok_path):
    # the model is never loaded nor profiled (it would fail: not ONNX): the error comes first,
    # one line, exit 1
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a model")
    done = run_cli_in_process(
        "train", junk, "--data", write_csv(tmp_path / "d.csv", ROWS),
        "--out", tmp_path / "run",
    )  # fmt: skip
    assert_user_error(done, "needs the model's tokenizer: pass --tokenizer tokenizer.json")
    done = run_cli_in_process("compile", junk, "-o", tmp_path / "c", "--tokenizer", tok_path)
    assert_user_error(done, "--tokenizer applies to text data (.csv or .jsonl), not digits")
