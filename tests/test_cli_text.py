"""Text end to end through the CLI: a BERT-style encoder from transformers (three token inputs),
``--data FILE.csv --tokenizer tokenizer.json`` for compile and train, the class names kept with
the run and in the trained model's metadata, and a wrong tokenizer's one-line error."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
from tokenizers import Tokenizer, models

from etgraph.labels import METADATA_KEY
from etgraph.text import load_tokenizer, tokenize
from tests.helpers import assert_user_error, run_cli_in_process

text = pytest.importorskip("models.text", reason="transformers is in the test extra")

ROWS = [
    ("the striker scored twice in the final", "sport"),
    ("the team lost the match at home", "sport"),
    ("shares fell after the profit warning", "business"),
    ("the bank raised interest rates again", "business"),
    ("the new phone has a faster chip", "tech"),
    ("software update fixes the security flaw", "tech"),
] * 4


@pytest.fixture(scope="module")
def text_task(tmp_path_factory):
    """(csv, tokenizer.json, model.onnx): a 3-input tiny BERT sized to a trained tokenizer."""
    root = tmp_path_factory.mktemp("text")
    csv_path = root / "news.csv"
    csv_path.write_text("text,label\n" + "".join(f"{t},{lab}\n" for t, lab in ROWS))
    tok = text.train_tokenizer([t for t, _ in ROWS], root / "tokenizer.json", vocab_size=200)
    module = text.tiny_bert(3, vocab_size=tok.get_vocab_size(), hidden=32, layers=1, seed=0)
    model = text.export_text_onnx(module, root / "bert.onnx", n_inputs=3, seq_len=12)
    return csv_path, root / "tokenizer.json", model


@pytest.mark.slow
def test_compile_and_train_text(tmp_path, text_task):
    # rho 0.8: on an encoder this small the forward pass is a large share of the step, and a
    # short profile on a loaded machine can put rho 0.5 below what the forward pass costs
    csv_path, tok_path, model = text_task
    env = {"ETGRAPH_CACHE": str(tmp_path / "cache")}
    done = run_cli_in_process(
        "compile", model, "-o", tmp_path / "c", "--data", csv_path, "--tokenizer", tok_path,
        "--repeats", "2", "--rho", "0.8", env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    done = run_cli_in_process(
        "train", tmp_path / "c", "--data", csv_path, "--tokenizer", tok_path, "--epochs", "2",
        "--period", "1", "--rho", "0.8", "--out", tmp_path / "run", "--quiet", env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    names = ["business", "sport", "tech"]
    assert json.loads((tmp_path / "run" / "classes.json").read_text()) == {"class_names": names}
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["config"]["tokenizer"] == str(tok_path)
    session = ort.InferenceSession(str(tmp_path / "run" / "model_trained.onnx"))
    meta = session.get_modelmeta().custom_metadata_map
    assert json.loads(meta[METADATA_KEY]) == names
    feeds = tokenize(load_tokenizer(tok_path), ["the bank raised rates"], 12, text.TOKEN_INPUTS)
    (logits,) = session.run(None, feeds)
    assert json.loads(meta[METADATA_KEY])[int(np.argmax(logits[0]))] in names

    # another model's tokenizer (a vocabulary larger than the table): one line, exit 1
    big = tmp_path / "big.json"
    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(998)}}
    Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(str(big))
    done = run_cli_in_process(
        "train", tmp_path / "c", "--data", csv_path, "--tokenizer", big, "--epochs", "1",
        "--out", tmp_path / "run2", "--quiet", env=env,
    )  # fmt: skip
    assert_user_error(done, "vocabulary of 1000 tokens but the model's embedding table has")
    # text data without --tokenizer
    done = run_cli_in_process(
        "train", tmp_path / "c", "--data", csv_path, "--epochs", "1", "--out",
        tmp_path / "run3", "--quiet", env=env,
    )  # fmt: skip
    assert_user_error(done, "needs the model's tokenizer: pass --tokenizer tokenizer.json")
