"""The model's own preprocessing (issue #14): presets, overrides, the arrays of a known image,
plan.json / run.json round trips, train reusing the plan, and one-line errors."""

from __future__ import annotations

import json
import logging
import re

import numpy as np
import pytest
from helpers import assert_user_error, run_cli_in_process
from PIL import Image

from etgraph import data
from etgraph.config import TrainConfig
from etgraph.data import load_dataset
from etgraph.errors import ConfigError, EtgraphError
from etgraph.images import PREPROCESS_PRESETS, Preprocess, make_preprocess
from etgraph.plan import read_plan, train_settings

#: One known pixel (R, G, B) in 0-255, the whole image that colour.
PIXEL = (200, 100, 50)


def _folder(root, pixel=PIXEL, classes=("a", "b")):
    for name in classes:
        (root / name).mkdir(parents=True)
        for j in range(2):
            Image.fromarray(np.full((6, 6, 3), pixel, dtype=np.uint8)).save(
                root / name / f"{j}.png"
            )
    return root


def _first_pixel(root, preprocess, channels=3):
    ds = load_dataset(root, input_shape=(channels, 6, 6), val_fraction=0.5, preprocess=preprocess)
    x, _ = next(ds.val_batches(1))
    assert x.dtype == np.float32 and x.shape == (1, channels, 6, 6)
    return x[0, :, 3, 3]


@pytest.mark.parametrize(
    ("preprocess", "expected"),
    [
        # torchvision: (p/255 - mean) / std, RGB
        (
            None,
            [(200 / 255 - 0.485) / 0.229, (100 / 255 - 0.456) / 0.224, (50 / 255 - 0.406) / 0.225],
        ),
        ("imagenet", None),  # same as the default, filled in below
        # Caffe: BGR, 0-255 minus the per-channel mean (B, G, R order)
        ("caffe", [50 - 103.939, 100 - 116.779, 200 - 123.68]),
        # Paddle: (p/255 - 0.5) / 0.5
        ("paddle", [(200 / 255 - 0.5) / 0.5, (100 / 255 - 0.5) / 0.5, (50 / 255 - 0.5) / 0.5]),
        ("none", [200 / 255, 100 / 255, 50 / 255]),
    ],
)
def test_known_image_under_each_preset(tmp_path, preprocess, expected):
    root = _folder(tmp_path / "ds")
    if expected is None:
        expected = _first_pixel(root, None)
    got = _first_pixel(root, make_preprocess(preprocess))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_overrides_replace_single_fields(tmp_path):
    root = _folder(tmp_path / "ds")
    pre = make_preprocess("imagenet", mean="0.5", std="0.25,0.5,1", channel_order="bgr")
    assert pre.preset is None and pre.scale == 255.0
    got = _first_pixel(root, pre)
    expected = [(50 / 255 - 0.5) / 0.25, (100 / 255 - 0.5) / 0.5, (200 / 255 - 0.5) / 1.0]
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    got = _first_pixel(root, make_preprocess("none", scale=1.0, mean="10"))
    np.testing.assert_allclose(got, [190, 90, 40], rtol=1e-6)
    # an override equal to the preset keeps the preset's name
    assert make_preprocess("caffe", channel_order="BGR") is PREPROCESS_PRESETS["caffe"]


def test_grey_model_averages_three_values(tmp_path):
    root = _folder(tmp_path / "ds", pixel=(90, 90, 90))
    got = _first_pixel(root, make_preprocess("imagenet"), channels=1)
    mean, std = np.mean([0.485, 0.456, 0.406]), np.mean([0.229, 0.224, 0.225])
    np.testing.assert_allclose(got, [(90 / 255 - mean) / std], rtol=1e-5)
    got = _first_pixel(root, make_preprocess("caffe"), channels=1)  # BGR means nothing for grey
    np.testing.assert_allclose(got, [90 - np.mean([103.939, 116.779, 123.68])], rtol=1e-5)


def test_digits_keep_their_own_normalisation():
    a = load_dataset(None, input_shape=(3, 16, 16))
    b = load_dataset(None, input_shape=(3, 16, 16), preprocess=make_preprocess("caffe"))
    np.testing.assert_array_equal(next(a.val_batches(4))[0], next(b.val_batches(4))[0])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"preset": "torch"}, "unknown --preprocess 'torch': choose one of imagenet, caffe"),
        ({"mean": "0.5,0.5"}, "--mean has 2 values: give 1"),
        ({"std": "1,2,3,4"}, "--std has 4 values"),
        ({"std": "0.2,0,0.2"}, "--std value 2 is 0.0: every value must be positive"),
        ({"std": "-1"}, "--std value 1 is -1.0"),
        ({"mean": "0.4,abc,0.3"}, "--mean '0.4,abc,0.3' is malformed"),
        ({"mean": "nan"}, "--mean 'nan' is malformed"),
        ({"scale": 0.0}, "--scale must be a positive number"),
        ({"channel_order": "rbg"}, "unknown --channel-order 'rbg': choose rgb or bgr"),
    ],
)
def test_bad_values_are_one_line_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)) as info:
        make_preprocess(**kwargs)
    assert isinstance(info.value, EtgraphError) and "\n" not in str(info.value)


def test_json_round_trips_and_train_config_carries_it():
    pre = make_preprocess("paddle", channel_order="bgr")
    assert Preprocess.from_json(json.loads(json.dumps(pre.to_json()))) == pre
    config = TrainConfig(preprocess=pre, frozen_bn="train")
    back = TrainConfig.from_json(json.loads(json.dumps(config.to_json())))
    assert back == config and back.digest() == config.digest()
    assert TrainConfig.from_json({}).preprocess == data.DEFAULT_PREPROCESS
    with pytest.raises(ConfigError, match="preprocessing record .* is malformed"):
        Preprocess.from_json({"mean": [0.5]})


def test_train_settings_reuse_the_plan_and_say_when_overridden(caplog):
    plan = {"preprocess": PREPROCESS_PRESETS["caffe"].to_json(), "frozen_bn": "train"}
    with caplog.at_level(logging.WARNING):
        assert train_settings(plan) == (PREPROCESS_PRESETS["caffe"], "train")
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        pre, mode = train_settings(plan, scale=255.0, frozen_bn="inference")
    assert pre.channel_order == "bgr" and pre.scale == 255.0 and mode == "inference"
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "differs from the compiled plan's (caffe: bgr" in text
    assert "--frozen-bn inference differs from the compiled plan's train" in text
    # no plan (or one written before issue #14): the defaults
    assert train_settings(None) == (data.DEFAULT_PREPROCESS, "inference")
    with pytest.raises(ConfigError, match="unknown frozen batch-norm mode 'eval'"):
        train_settings(None, frozen_bn="eval")


def test_read_plan(tmp_path):
    assert read_plan(tmp_path) is None
    (tmp_path / "plan.json").write_text("{not json")
    with pytest.raises(ConfigError, match="plan.json is not readable JSON"):
        read_plan(tmp_path)
    (tmp_path / "plan.json").write_text("[]")  # JSON, not an object: was an internal error
    with pytest.raises(ConfigError, match=r"plan.json is not readable JSON \(not an object\)"):
        read_plan(tmp_path)


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--std", "0.2,0,0.2"], ["--std value 2 is 0.0"]),
        (["--mean", "1,2"], ["--mean has 2 values"]),
    ],
)
def test_cli_bad_values_one_line(tmp_path, args, fragments):
    done = run_cli_in_process("train", "--out", tmp_path / "run", *args)
    assert_user_error(done, *fragments)


def test_cli_resume_takes_no_preprocessing_or_other_settings(tmp_path):
    done = run_cli_in_process("train", "--resume", tmp_path, "--frozen-bn", "train", "--std", "1")
    assert_user_error(done, "continues a run as configured: drop --std, --frozen-bn")
    # nor any other setting of the run, which it would silently ignore
    done = run_cli_in_process("train", "m.onnx", "--resume", tmp_path, "--lr", "2", "--quiet")
    assert_user_error(done, "continues a run as configured: drop MODEL, --lr (or start")


def test_cli_unknown_order_is_a_usage_error(tmp_path):
    done = run_cli_in_process("compile", "-o", tmp_path / "c", "--channel-order", "rbg")
    assert_user_error(done, "--channel-order", "rbg", code=2)


@pytest.mark.slow
def test_compile_records_and_train_reuses_the_plan(tmp_path, cache_env):
    """plan.json round trip: compile records the preprocessing and --frozen-bn, train on the
    compiled directory reuses them (run.json), and an override is said in one warning line."""
    out = tmp_path / "compiled"
    done = run_cli_in_process(
        "compile", "-o", out, "--preprocess", "caffe", "--scale", "2", "--frozen-bn", "train",
        "--repeats", "2", env=cache_env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    plan = json.loads((out / "plan.json").read_text())
    recorded = Preprocess.from_json(plan["preprocess"])
    assert recorded == make_preprocess("caffe", scale=2.0) and plan["frozen_bn"] == "train"
    quick = ["--epochs", "1", "--max-steps-per-epoch", "2", "--max-val-batches", "1", "--quiet"]
    done = run_cli_in_process("train", out, "--out", tmp_path / "run", *quick, env=cache_env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "differs" not in done.stderr
    config = TrainConfig.from_json(
        json.loads((tmp_path / "run" / "run.json").read_text())["config"]
    )
    assert config.preprocess == recorded and config.frozen_bn == "train"
    done = run_cli_in_process(
        "train", out, "--out", tmp_path / "run2", "--frozen-bn", "inference", *quick, env=cache_env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--frozen-bn inference differs from the compiled plan's train" in done.stderr
