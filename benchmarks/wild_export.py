"""Exports for ``benchmarks/wild.py``'s exporter families, each as its framework's users write it.

Run by ``wild.py`` with the Python of the family's own venv (never etgraph's: TensorFlow, Paddle,
torchvision/timm and scikit-learn pin their own torch, numpy and protobuf)::

    VENV/bin/python benchmarks/wild_export.py FAMILY OUT.onnx

Weights are random (no hub downloads); a family that brings its own data writes it beside the
model (``OUT.npz``). Families:

* ``torchvision_dynamo`` / ``torchvision_dynamo_folded``: torchvision ResNet-18 through torch's
  default exporter (``dynamo=True``), with ``optimize=False`` (batch norms kept, README "Your own
  model") and as the tutorial calls it (folded);
* ``timm_resnet18d``: timm's ResNet-18-D (AveragePool ``ceil_mode=1`` in its shortcut) through
  timm's own ``timm.utils.onnx.onnx_export``;
* ``keras_mobilenet_v2``: Keras MobileNetV2 (alpha 0.35, 96 px, channels last) through tf2onnx
  (``from_function``: Keras 3 breaks ``from_keras``);
* ``keras_gmp_upsample``: a small Keras net with LayerNormalization, UpSampling2D and
  GlobalMaxPooling2D through tf2onnx;
* ``jax_cnn``: a JAX CNN (lax.conv, max over space) through ``jax2tf`` and tf2onnx (JAX 0.10
  always serialises to StableHLO in an ``XlaCallModule``, which tf2onnx 1.17 cannot convert);
* ``sklearn_mlp``: scikit-learn's MLPClassifier on digits 0-4 through skl2onnx's defaults
  (ZipMap output); its data beside it;
* ``paddle_mobilenet_v2``: :mod:`paddle_export`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def torchvision_dynamo(out: str, optimize: bool = False) -> None:
    import torch
    import torchvision

    torch.manual_seed(0)
    net = torchvision.models.resnet18(num_classes=10).eval()
    torch.onnx.export(net, (torch.randn(1, 3, 128, 128),), out, optimize=optimize)


def timm_resnet18d(out: str) -> None:
    import timm
    import torch
    from timm.utils.onnx import onnx_export

    torch.manual_seed(0)
    net = timm.create_model("resnet18d", pretrained=False, num_classes=10)
    onnx_export(net, out, input_size=(3, 128, 128), batch_size=1, opset=17, check=False)


def _tf2onnx(model, out: str) -> None:
    import tensorflow as tf
    import tf2onnx

    spec = (tf.TensorSpec((None, *model.input_shape[1:]), tf.float32, name="input"),)
    fn = tf.function(lambda x: model(x, training=False), input_signature=spec)
    tf2onnx.convert.from_function(fn, input_signature=spec, opset=17, output_path=out)


def keras_mobilenet_v2(out: str) -> None:
    import tensorflow as tf

    tf.random.set_seed(0)
    _tf2onnx(
        tf.keras.applications.MobileNetV2(
            input_shape=(96, 96, 3), weights=None, classes=3, alpha=0.35
        ),
        out,
    )


def keras_gmp_upsample(out: str) -> None:
    import tensorflow as tf

    tf.random.set_seed(0)
    layers = tf.keras.layers
    model = tf.keras.Sequential(
        [
            tf.keras.Input((32, 32, 3)),
            layers.Conv2D(8, 3, strides=2, activation="relu"),
            layers.LayerNormalization(),
            layers.UpSampling2D(2),
            layers.Conv2D(16, 3, padding="same"),
            layers.BatchNormalization(),
            layers.Activation("relu"),
            layers.GlobalMaxPooling2D(),
            layers.Dense(3, activation="softmax"),
        ]
    )
    _tf2onnx(model, out)


def jax_cnn(out: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import tensorflow as tf
    import tf2onnx
    from jax.experimental import jax2tf

    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {
        "w1": jax.random.normal(keys[0], (3, 3, 3, 16)) * 0.2,  # HWIO
        "w2": jax.random.normal(keys[1], (3, 3, 16, 32)) * 0.1,
        "w3": jax.random.normal(keys[2], (32, 3)) * 0.1,
        "b3": jnp.zeros(3),
    }

    def predict(p, x):  # x: [B, 32, 32, 3]
        dims = ("NHWC", "HWIO", "NHWC")
        h = jax.nn.relu(
            jax.lax.conv_general_dilated(x, p["w1"], (1, 1), "SAME", dimension_numbers=dims)
        )
        h = jax.nn.relu(
            jax.lax.conv_general_dilated(h, p["w2"], (2, 2), "SAME", dimension_numbers=dims)
        )
        return jnp.max(h, axis=(1, 2)) @ p["w3"] + p["b3"]

    variables = {k: tf.Variable(np.asarray(v), name=k) for k, v in params.items()}
    converted = jax2tf.convert(
        predict, with_gradient=False, polymorphic_shapes=[None, "(b, 32, 32, 3)"]
    )
    spec = (tf.TensorSpec((None, 32, 32, 3), tf.float32, name="input"),)
    fn = tf.function(lambda x: converted(variables, x), input_signature=spec, autograph=False)
    try:
        tf2onnx.convert.from_function(fn, input_signature=spec, opset=17, output_path=out)
    except ValueError as exc:  # the XlaCallModule node's attributes
        raise SystemExit(
            f"tf2onnx {tf2onnx.__version__} cannot convert jax2tf's XlaCallModule (JAX "
            f"{jax.__version__} serialises to StableHLO only): {exc}"
        ) from exc


def sklearn_mlp(out: str) -> None:
    import numpy as np
    from skl2onnx import to_onnx
    from sklearn.datasets import load_digits
    from sklearn.neural_network import MLPClassifier

    x, y = load_digits(return_X_y=True)
    keep = y < 5
    x, y = (x[keep] / 16.0).astype(np.float32), y[keep].astype(np.int64)
    model = MLPClassifier(hidden_layer_sizes=(32,), max_iter=30, random_state=0).fit(x, y)
    Path(out).write_bytes(to_onnx(model, x[:1], target_opset=17).SerializeToString())
    np.savez(Path(out).with_suffix(".npz"), X=x, labels=y)


def paddle_mobilenet_v2(out: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from paddle_export import main

    main(out)


FAMILIES = {
    "torchvision_dynamo": torchvision_dynamo,
    "torchvision_dynamo_folded": lambda out: torchvision_dynamo(out, optimize=True),
    "timm_resnet18d": timm_resnet18d,
    "keras_mobilenet_v2": keras_mobilenet_v2,
    "keras_gmp_upsample": keras_gmp_upsample,
    "jax_cnn": jax_cnn,
    "sklearn_mlp": sklearn_mlp,
    "paddle_mobilenet_v2": paddle_mobilenet_v2,
}


if __name__ == "__main__":
    family, path = sys.argv[1:3]
    FAMILIES[family](path)
    print(f"wrote {path}")
