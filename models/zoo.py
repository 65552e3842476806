"""Model zoo in plain torch: the paper's four architectures and small models for tests.

The paper (§8) evaluates ResNet50, VGG16, MobileNetV2 and ViT (B/16), pre-trained on ImageNet.
torchvision cannot be installed beside the CPU torch build used here, so the architectures are
written out in plain torch, following the torchvision / timm definitions layer for layer:

- ``resnet50``: ResNet-50 v1.5 (stride in the 3x3 conv of the bottleneck), BatchNorm.
- ``vgg16``: plain VGG16 (configuration "D", **no** BatchNorm, as in the paper), with the
  original 4096-4096 classifier on the flattened last feature map (its first layer's width
  depends on the input size: ``512 * (input_size // 32) ** 2`` inputs), Dropout 0.5.
- ``mobilenet_v2``: MobileNetV2 width 1.0 (inverted residuals, ReLU6, depthwise conv,
  1280-channel last conv, Dropout 0.2 before the classifier), with torchvision's parameter
  names, so its ImageNet weights load as they are (:mod:`models.pretrained_vision`).
- ``vit_b16``: ViT-B/16 (patch 16, width 768, depth 12, 12 heads, MLP 3072, pre-norm,
  class token, learned position embedding for ``(input_size // 16) ** 2 + 1`` tokens).

Small models for tests, and the embedded default's architecture:

- ``resnet18s``: ResNet-18 layout (BasicBlock x [2, 2, 2, 2]) with narrow widths 16-32-64-128.
- ``tiny_cnn``: three conv-BN-ReLU blocks, global average pool, linear head.
- ``tiny_vit``: patch-embedding conv (patch 8), class token, position embedding, two pre-norm
  encoder blocks (LayerNorm, multi-head attention via MatMul/Softmax, GELU MLP), head.
- ``default_cnn``: five conv-BN-ReLU blocks, global average pool, linear head (~120k params);
  pretrained on digits 0-4 it becomes the embedded default model.

Weights are random but deterministic: :func:`build` seeds a private torch RNG state. Linear
layers applied to token sequences (3-D inputs) use :class:`Dense`, whose kernel is stored as
``[in, out]`` so the exported graph is ``MatMul(x, kernel) + bias`` with the initializers
consumed directly (``nn.Linear`` would export an extra ``Transpose`` of the kernel when constant
folding is off). Linear layers on 2-D inputs use ``nn.Linear`` (exported as ``Gemm``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

# ----------------------------------------------------------------------------- building blocks


def conv_bn_relu(c_in: int, c_out: int, kernel: int = 3, stride: int = 1) -> nn.Sequential:
    """Conv (no bias) -> BatchNorm -> ReLU, 'same' padding."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=False),
    )


class Dense(nn.Module):
    """Affine map on the last axis, ``y = x @ kernel + bias``; kernel shape ``[in, out]``.

    Exported as ``MatMul`` + ``Add`` reading the initializers directly (see module docstring).
    """

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        bound = 1.0 / math.sqrt(in_features)
        self.kernel = nn.Parameter(torch.empty(in_features, out_features).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.kernel + self.bias


class LearningRateScale(nn.Module):
    """``layer`` trained at ``scale`` times the optimizer's learning rate, exactly, for AdamW
    with one learning rate (ORT's): the output is ``scale * layer'(x)`` where ``layer'`` holds
    ``layer``'s parameters divided by ``scale``, so the function is unchanged at export.

    AdamW's step is invariant to the gradient's scale (``m / sqrt(v)``; up to eps), so each
    parameter ``p' = p / scale`` moves by about ``lr`` per step and ``p = scale * p'`` by
    ``scale * lr``; the decoupled weight decay shrinks ``p`` by ``lr * weight_decay`` as before.
    Only for layers whose output is linear in all their parameters jointly (Linear, Dense,
    a bias-free Conv): ``layer(x; p / s) * s == layer(x; p)``. Exported as the layer's own
    nodes (its initializers consumed directly) and one ``Mul`` on its output.
    """

    def __init__(self, layer: nn.Module, scale: float):
        super().__init__()
        if not scale > 0:
            raise ValueError(f"scale must be positive, got {scale}")
        with torch.no_grad():
            for p in layer.parameters():
                p.div_(scale)
        self.layer, self.scale = layer, float(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) * self.scale


# ----------------------------------------------------------------------------- ResNet


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, c_in: int, width: int, stride: int = 1):
        super().__init__()
        c_out = width * self.expansion
        self.conv1 = nn.Conv2d(c_in, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU()
        self.downsample = _downsample(c_in, c_out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int = 1):
        super().__init__()
        c_out = width * self.expansion
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, c_out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU()
        self.downsample = _downsample(c_in, c_out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


def _downsample(c_in: int, c_out: int, stride: int) -> nn.Module | None:
    if stride == 1 and c_in == c_out:
        return None
    return nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))


class ResNet(nn.Module):
    """ResNet with a 7x7/2 stem and max pool (ImageNet layout), global average pool, linear."""

    def __init__(self, block, layers: list[int], widths: list[int], num_classes: int):
        super().__init__()
        c = widths[0]
        self.stem = nn.Sequential(
            nn.Conv2d(3, c, 7, 2, 3, bias=False),
            nn.BatchNorm2d(c),
            nn.ReLU(),
            nn.MaxPool2d(3, 2, 1),
        )
        stages = []
        for i, (n, w) in enumerate(zip(layers, widths, strict=True)):
            blocks = []
            for j in range(n):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(block(c, w, stride))
                c = w * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.stages(self.stem(x)))
        return self.fc(torch.flatten(x, 1))


# ----------------------------------------------------------------------------- VGG16

_VGG16_CFG = [
    64,
    64,
    "M",
    128,
    128,
    "M",
    256,
    256,
    256,
    "M",
    512,
    512,
    512,
    "M",
    512,
    512,
    512,
    "M",
]


class VGG16(nn.Module):
    """Plain VGG16 (configuration D, no BatchNorm) with the 4096-4096 classifier."""

    def __init__(self, num_classes: int, input_size: int):
        super().__init__()
        if input_size % 32:
            raise ValueError(f"vgg16 needs an input size divisible by 32, got {input_size}")
        layers: list[nn.Module] = []
        c = 3
        for v in _VGG16_CFG:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(c, v, 3, padding=1), nn.ReLU()]
                c = v
        self.features = nn.Sequential(*layers)
        s = input_size // 32
        self.classifier = nn.Sequential(
            nn.Linear(512 * s * s, 4096),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(4096, 4096),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


# ----------------------------------------------------------------------------- MobileNetV2


def conv_bn_relu6(
    c_in: int, c_out: int, kernel: int = 3, stride: int = 1, groups: int = 1
) -> nn.Sequential:
    """Conv (no bias) -> BatchNorm -> ReLU6, 'same' padding (torchvision's Conv2dNormActivation
    as MobileNetV2 uses it: parameters ``0.weight``, ``1.weight``, ``1.bias``)."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU6(),
    )


class InvertedResidual(nn.Module):
    """torchvision's block: ``conv`` = [1x1 expand (if expand != 1)], 3x3 depthwise, 1x1
    project conv, BatchNorm; a residual connection when shape is kept."""

    def __init__(self, c_in: int, c_out: int, stride: int, expand: int):
        super().__init__()
        hidden = c_in * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers.append(conv_bn_relu6(c_in, hidden, 1))
        layers += [
            conv_bn_relu6(hidden, hidden, 3, stride, groups=hidden),
            nn.Conv2d(hidden, c_out, 1, bias=False),
            nn.BatchNorm2d(c_out),
        ]
        self.conv = nn.Sequential(*layers)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(x)
        return x + out if self.residual else out


class MobileNetV2(nn.Module):
    """MobileNetV2, width multiplier 1.0, in torchvision's layout and parameter names: its
    ImageNet weights (``mobilenet_v2-b0353104.pth``) load with ``load_state_dict(strict=True)``
    into ``MobileNetV2(1000)`` (:mod:`models.pretrained_vision`)."""

    # (expansion t, channels c, repeats n, stride s)
    CFG = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
           (6, 160, 3, 2), (6, 320, 1, 1)]  # fmt: skip

    def __init__(self, num_classes: int):
        super().__init__()
        c = 32
        layers: list[nn.Module] = [conv_bn_relu6(3, c, 3, 2)]
        for t, c_out, n, s in self.CFG:
            for i in range(n):
                layers.append(InvertedResidual(c, c_out, s if i == 0 else 1, t))
                c = c_out
        layers.append(conv_bn_relu6(c, 1280, 1))
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


# ----------------------------------------------------------------------------- ViT


class Attention(nn.Module):
    """Multi-head self-attention: fused qkv Dense, MatMul, scale, Softmax, MatMul, projection."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        if dim % heads:
            raise ValueError(f"width {dim} is not divisible by {heads} heads")
        self.heads = heads
        self.head_dim = dim // heads
        self.scale = self.head_dim**-0.5
        self.qkv = Dense(dim, 3 * dim)
        self.proj = Dense(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # [B, heads, N, head_dim]
        attn = torch.softmax((q @ k.transpose(-2, -1)) * self.scale, dim=-1)
        out = (attn @ v).transpose(1, 2).reshape(b, n, d)
        return self.proj(out)


class EncoderBlock(nn.Module):
    """Pre-norm transformer encoder block: x + MHA(LN(x)); x + MLP(LN(x)) with GELU."""

    def __init__(self, dim: int, heads: int, mlp_dim: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.fc1 = Dense(dim, mlp_dim)
        self.act = nn.GELU()
        self.fc2 = Dense(mlp_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class ViT(nn.Module):
    """Vision Transformer: patch embedding conv, class token, position embedding, encoder, head
    on the class token."""

    def __init__(
        self,
        num_classes: int,
        input_size: int,
        patch: int,
        dim: int,
        depth: int,
        heads: int,
        mlp_dim: int,
    ):
        super().__init__()
        if input_size % patch:
            raise ValueError(f"input size {input_size} is not divisible by patch {patch}")
        n_tokens = (input_size // patch) ** 2 + 1
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim).normal_(std=0.02))
        self.pos_embed = nn.Parameter(torch.zeros(1, n_tokens, dim).normal_(std=0.02))
        self.blocks = nn.Sequential(*(EncoderBlock(dim, heads, mlp_dim) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # [B, N, dim]
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


# ----------------------------------------------------------------------------- tiny CNN


class TinyCNN(nn.Module):
    """conv-BN-ReLU x3 (widths ``widths``, the 2nd and 3rd with stride 2), global average pool,
    linear head."""

    def __init__(self, num_classes: int, widths: tuple[int, int, int] = (16, 32, 64)):
        super().__init__()
        a, b, c = widths
        self.features = nn.Sequential(
            conv_bn_relu(3, a), conv_bn_relu(a, b, stride=2), conv_bn_relu(b, c, stride=2)
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


class DefaultCNN(nn.Module):
    """The embedded default model's architecture: five conv-BN-ReLU blocks (widths
    24-32-64-64-96, the 3rd and 5th with stride 2), global average pool, linear head (~120k
    parameters; 3x32x32 input). Pretrained on digits 0-4 by ``models/pretrain_default.py``."""

    WIDTHS = (24, 32, 64, 64, 96)
    STRIDES = (1, 1, 2, 1, 2)

    def __init__(self, num_classes: int):
        super().__init__()
        blocks, c = [], 3
        for w, s in zip(self.WIDTHS, self.STRIDES, strict=True):
            blocks.append(conv_bn_relu(c, w, stride=s))
            c = w
        self.features = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


# ----------------------------------------------------------------------------- registry

_BUILDERS: dict[str, Callable[[int, int], nn.Module]] = {
    "resnet50": lambda k, s: ResNet(Bottleneck, [3, 4, 6, 3], [64, 128, 256, 512], k),
    "vgg16": lambda k, s: VGG16(k, s),
    "mobilenet_v2": lambda k, s: MobileNetV2(k),
    "vit_b16": lambda k, s: ViT(k, s, patch=16, dim=768, depth=12, heads=12, mlp_dim=3072),
    "resnet18": lambda k, s: ResNet(BasicBlock, [2, 2, 2, 2], [64, 128, 256, 512], k),
    "resnet18s": lambda k, s: ResNet(BasicBlock, [2, 2, 2, 2], [16, 32, 64, 128], k),
    "tiny_cnn": lambda k, s: TinyCNN(k),
    "tiny_vit": lambda k, s: ViT(k, s, patch=8, dim=64, depth=2, heads=2, mlp_dim=128),
    "default_cnn": lambda k, s: DefaultCNN(k),
}

#: Every model name :func:`build` accepts; the first four are the paper's (§8).
NAMES: tuple[str, ...] = tuple(_BUILDERS)
#: The paper's four evaluated architectures.
PAPER_MODELS: tuple[str, ...] = ("resnet50", "vgg16", "mobilenet_v2", "vit_b16")
#: Small models used by the test suite.
SMALL_MODELS: tuple[str, ...] = ("resnet18s", "tiny_cnn", "tiny_vit")
#: Architecture of the embedded default model (``etgraph/assets/default_model.onnx``).
DEFAULT_MODEL: str = "default_cnn"


def build(name: str, num_classes: int, *, input_size: int = 224, seed: int = 0) -> nn.Module:
    """Build a zoo model with deterministic random weights, in training mode.

    Args:
        name: one of :data:`NAMES`.
        num_classes: width of the output layer (logits ``float32 [B, num_classes]``).
        input_size: side of the square RGB input ``[B, 3, input_size, input_size]`` in pixels;
            the size-dependent layers (VGG16's first classifier layer, ViT's position
            embedding) are sized for it. Other models accept any size >= 32.
        seed: seed of the torch RNG used for initialisation (the global RNG is left untouched).

    Returns:
        The ``torch.nn.Module`` (``.train()`` mode).

    Raises:
        KeyError: unknown ``name`` (the message lists :data:`NAMES`).
        ValueError: ``input_size`` incompatible with the architecture (patch / stride).
    """
    if name not in _BUILDERS:
        raise KeyError(f"unknown model {name!r}; choose one of {', '.join(NAMES)}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _BUILDERS[name](num_classes, input_size)
    return model.train()


def count_params(model: nn.Module) -> int:
    """Number of trainable scalar parameters of ``model``."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
