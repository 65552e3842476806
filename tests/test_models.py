"""Model zoo, ONNX export and the embedded default: real exports, real ORT training steps."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from etgraph import artifacts
from models import zoo
from models.export import MAX_IR_VERSION, export_onnx

BATCH = 4


def trainable_and_frozen(model: onnx.ModelProto) -> tuple[list[str], list[str]]:
    """All float initializers: BatchNormalization running mean/var (inputs 3, 4) are frozen,
    everything else is trainable."""
    running = {
        n.input[i] for n in model.graph.node if n.op_type == "BatchNormalization" for i in (3, 4)
    }
    floats = [i.name for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT]
    return [n for n in floats if n not in running], [n for n in floats if n in running]


def open_training(paths: artifacts.ArtifactPaths):
    from onnxruntime.training import api

    state = api.CheckpointState.load_checkpoint(str(paths.checkpoint))
    module = api.Module(str(paths.training_model), state, str(paths.eval_model))
    optimizer = api.Optimizer(str(paths.optimizer_model), module)
    return state, module, optimizer


def batch(shape, num_classes, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, *shape)).astype(np.float32)
    y = rng.integers(0, num_classes, BATCH).astype(np.int64)
    return x, y


def loss_of(out) -> float:
    return float(np.asarray(out[0] if isinstance(out, (tuple, list)) else out))


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["tiny_cnn_onnx", "resnet18s_onnx", "tiny_vit_onnx"])
def test_small_model_exports_and_trains_one_step(fixture, request, tmp_path):
    path = request.getfixturevalue(fixture)
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    assert model.ir_version <= MAX_IR_VERSION
    assert [i.name for i in model.graph.input] == ["input"]
    assert [o.name for o in model.graph.output] == ["logits"]
    batch_dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    assert batch_dim.dim_param and not batch_dim.HasField("dim_value"), "batch axis must be dynamic"
    for node in model.graph.node:
        if node.op_type == "LayerNormalization":
            assert len(node.output) == 3, node.name
        if node.op_type == "Dropout":
            assert len(node.output) == 2, node.name

    requires_grad, frozen = trainable_and_frozen(model)
    n_bn = sum(n.op_type == "BatchNormalization" for n in model.graph.node)
    assert len(frozen) == 2 * n_bn
    paths = artifacts.generate(model, requires_grad, frozen, tmp_path / "art")
    state, module, optimizer = open_training(paths)
    trainable = [n for n in requires_grad if state.parameters[n].requires_grad]
    assert sorted(trainable) == sorted(requires_grad)
    before = {n: state.parameters[n].data.copy() for n in requires_grad}

    module.train()
    loss = loss_of(module(*batch((3, 32, 32), 10)))
    optimizer.step()
    module.lazy_reset_grad()
    assert np.isfinite(loss) and loss > 0
    changed = [n for n in requires_grad if not np.array_equal(state.parameters[n].data, before[n])]
    assert len(changed) == len(requires_grad), "every trainable tensor must be updated by a step"

    module.eval()
    logits = module(*batch((3, 32, 32), 10))
    logits = logits[1] if isinstance(logits, (tuple, list)) and len(logits) > 1 else logits
    assert np.all(np.isfinite(np.asarray(logits, dtype=np.float32)))


def test_tiny_vit_graph_has_transformer_ops(tiny_vit_onnx):
    model = onnx.load(str(tiny_vit_onnx))
    ops = {n.op_type for n in model.graph.node}
    assert {"LayerNormalization", "MatMul", "Softmax", "Erf", "Concat", "Conv", "Gemm"} <= ops
    inits = {i.name for i in model.graph.initializer}
    consumers = {}
    for node in model.graph.node:
        for x in node.input:
            consumers.setdefault(x, node.op_type)
    kernels = [n for n in inits if n.endswith(".kernel")]
    assert kernels and all(consumers[k] == "MatMul" for k in kernels), "Dense kernels feed MatMul"
    assert "cls_token" in inits and "pos_embed" in inits


def test_build_is_deterministic_and_seeded():
    a = zoo.build("tiny_cnn", 7, seed=3).state_dict()
    b = zoo.build("tiny_cnn", 7, seed=3).state_dict()
    c = zoo.build("tiny_cnn", 7, seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["fc.weight"], c["fc.weight"])
    assert a["fc.weight"].shape == (7, 64)


def test_build_rejects_unknown_name_and_bad_sizes():
    with pytest.raises(KeyError, match="resnet50"):
        zoo.build("resnet51", 10)
    with pytest.raises(ValueError, match="vgg16 needs an input size divisible by 32, got 100"):
        zoo.build("vgg16", 10, input_size=100)
    with pytest.raises(ValueError, match="opset 18 > 17 is not supported"):
        export_onnx("tiny_cnn", "unused.onnx", opset=18)


@pytest.mark.parametrize(
    ("name", "input_size", "params"),
    [
        ("resnet50", 224, 25_557_032),  # torchvision resnet50, 1000 classes
        ("vgg16", 224, 138_357_544),  # torchvision vgg16 (no BN)
        ("mobilenet_v2", 224, 3_504_872),  # torchvision mobilenet_v2
        ("vit_b16", 224, 86_567_656),  # torchvision vit_b_16
    ],
)
def test_paper_models_match_reference_parameter_counts(name, input_size, params):
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        model = zoo.build(name, 1000, input_size=input_size)
    assert zoo.count_params(model) == params


def test_export_adds_optional_outputs(tiny_vit_onnx):
    """The exporter runs etgraph's AddOptionalOutputsPass: every LayerNormalization has its
    Mean and InvStdDev outputs (ORT's gradient builder reads them)."""
    model = onnx.load(str(tiny_vit_onnx))
    norms = [n for n in model.graph.node if n.op_type == "LayerNormalization"]
    assert norms and all(len(n.output) == 3 and all(n.output) for n in norms)


@pytest.mark.slow
def test_export_cli(tmp_path):
    out = tmp_path / "m.onnx"
    cmd = [sys.executable, "-m", "models.export", "tiny_cnn", "-o", str(out)]
    cmd += ["--input-size", "32", "--num-classes", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    model = onnx.load(str(out))
    fc = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}["fc.weight"]
    assert fc.shape == (3, 64)


# ----------------------------------------------------------------------------- default model


def test_default_model_metadata(default_model_path):
    from etgraph.data import DEFAULT_MODEL_INFO_PATH

    info = json.loads(DEFAULT_MODEL_INFO_PATH.read_text())
    assert info["input_shape"] == [3, 32, 32]
    assert info["num_classes"] == 5
    assert info["dataset"] == "digits"
    assert info["pretrain_val_accuracy"] >= 0.95
    model = onnx.load(str(default_model_path))
    assert model.graph.output[0].type.tensor_type.shape.dim[1].dim_value == 5


@pytest.mark.slow
def test_default_model_fine_tunes_on_digits(default_model_path, tmp_path):
    from etgraph.data import load_dataset

    model = onnx.load(str(default_model_path))
    requires_grad, frozen = trainable_and_frozen(model)
    paths = artifacts.generate(model, requires_grad, frozen, tmp_path / "art")
    _, module, optimizer = open_training(paths)
    optimizer.set_learning_rate(1e-3)
    ds = load_dataset(None, input_shape=(3, 32, 32), num_classes=5)
    x_val, y_val = next(ds.val_batches(64))

    def val_loss() -> float:
        module.eval()
        out = module(x_val, y_val)
        module.train()
        return loss_of(out)

    module.eval()
    logits = np.asarray(module(x_val, y_val)[1])
    assert logits.shape == (64, 5)
    start = val_loss()
    losses = []
    for x, y in ds.train_batches(8, seed=0):
        losses.append(loss_of(module(x, y)))
        optimizer.step()
        module.lazy_reset_grad()
        if len(losses) == 40:
            break
    end = val_loss()
    assert np.isfinite(losses).all()
    assert np.mean(losses[-10:]) < 0.7 * np.mean(losses[:5])
    assert end < 0.7 * start, (start, end)


def test_mobilenet_v2_loads_torchvision_imagenet_weights_strictly():
    """The zoo's MobileNetV2 has torchvision's parameter names: the ImageNet weights of the
    benchmarks' vision task load strictly and are genuine (matplotlib's sample photo of Grace
    Hopper -> 'military uniform', ImageNet class 652)."""
    import matplotlib
    from PIL import Image

    from models import pretrained_vision

    try:
        model = pretrained_vision.imagenet_mobilenet_v2()
    except FileNotFoundError:
        pytest.skip(f"needs the vision task's packages: {pretrained_vision.INSTALL}")
    photo = Image.open(f"{matplotlib.get_data_path()}/sample_data/grace_hopper.jpg")
    x = np.asarray(photo.convert("RGB").resize((224, 224)), dtype=np.float32) / 255.0
    x = (x - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]
    with torch.no_grad():
        logits = model(torch.tensor(x.transpose(2, 0, 1)[None], dtype=torch.float32))
    assert int(logits.argmax()) == 652
    head = pretrained_vision.pretrained_mobilenet_v2(10).classifier[1]
    assert head.out_features == 10 and float(head.bias.abs().max()) == 0.0


def test_animal_mnist_arrays_are_read_without_its_loader():
    from models import pretrained_vision

    try:
        images, labels = pretrained_vision.animal_arrays()
    except FileNotFoundError:
        pytest.skip(f"needs the vision task's packages: {pretrained_vision.INSTALL}")
    assert images.shape == (10_000, 28, 28) and images.dtype == np.uint8
    np.testing.assert_array_equal(np.bincount(labels), [1000] * 10)


def test_learning_rate_scale_keeps_the_function_and_scales_adamw_steps():
    """LearningRateScale: same outputs; under one AdamW learning rate the wrapped layer's
    effective weights move `scale` times as far as the plain layer's (AdamW is invariant to the
    gradient's scale; the decoupled weight decay, lr * wd per step, is not scaled)."""
    torch.manual_seed(0)
    plain = torch.nn.Linear(6, 3)
    wrapped = zoo.LearningRateScale(copy.deepcopy(plain), 10.0)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    torch.testing.assert_close(wrapped(x), plain(x))
    before = plain.weight.detach().clone()
    for module in (plain, wrapped):
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3, eps=1e-12, weight_decay=0.01)
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(module(x), y).backward()
            opt.step()
    moved_plain = plain.weight.detach() - before
    moved_wrapped = wrapped.layer.weight.detach() * 10.0 - before
    torch.testing.assert_close(moved_wrapped, 10.0 * moved_plain, rtol=0.05, atol=1e-6)
    with pytest.raises(ValueError, match="scale must be positive"):
        zoo.LearningRateScale(torch.nn.Linear(2, 2), 0.0)
