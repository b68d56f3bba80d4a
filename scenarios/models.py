"""Model builders. Each takes `(cfg, input_shape, num_classes)`; shapes come from the data.

The zoo models (lenet5, convnet2, resnet18, char_lstm) share one layout:
`encode(x)` returns the penultimate representation and `classifier` is the
final linear layer, so `forward(x) == classifier(encode(x))`. Algorithms
that need the representation (e.g. a projection head on top of it) reuse
`encode`; parameter names start with the block they belong to
(`features.`, `classifier.`, ...) for `federate.share_params` patterns.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from fedcore.kernel.config import declare, positive, validator
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.registry import components, models

__all__ = ["build_model", "logreg", "mlp", "LeNet5", "ConvNet2", "ResNet18", "CharLSTM",
           "count_parameters"]

declare("model.norm", str, "batch", "convnet2/resnet18: normalisation layers (group: GroupNorm, "
        "which needs no running statistics)", choices=("batch", "group", "none"))
declare("model.norm_groups", int, 2, "GroupNorm groups when model.norm=group",
        check=positive)
declare("model.dropout", float, 0.5, "convnet2: dropout probability before and after the hidden layer",
        check=lambda v: None if 0 <= v < 1 else "must be in [0, 1)")
declare("model.mlp_dropout", float, 0.0, "mlp: dropout probability after each hidden layer "
        "(0: no dropout layers)", check=lambda v: None if 0 <= v < 1 else "must be in [0, 1)")
declare("model.convnet2_hidden", int, 2048, "convnet2: width of the hidden fully connected layer",
        check=positive)
declare("model.lstm.embed", int, 8, "char_lstm: character embedding size", check=lambda v: positive(v))
declare("model.lstm.hidden", int, 256, "char_lstm: LSTM hidden size", check=lambda v: positive(v))
declare("model.lstm.layers", int, 2, "char_lstm: stacked LSTM layers", check=lambda v: positive(v))


@validator
def _check_hidden(cfg) -> None:
    """Layer widths are positive integers (a zero or negative width fails deep inside torch)."""
    widths = cfg["model.hidden"]
    if not all(isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in widths):
        raise ConfigError(f"model.hidden: {widths} must be a list of positive layer widths, "
                          "e.g. [64] or [128, 64]")


@components.register("model")
def build_model(cfg, input_shape, num_classes: int) -> nn.Module:
    """Build `model.type` in `model.dtype`, seeded by the run's seed."""
    torch.manual_seed(cfg["seed"])
    model = models.get(cfg["model.type"])(cfg, tuple(input_shape), num_classes)
    return model.to(getattr(torch, cfg["model.dtype"]))


def count_parameters(model: nn.Module) -> int:
    """Trainable parameters (the numbers quoted in docs/data.md)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@models.register("logreg")
def logreg(cfg, input_shape, num_classes: int) -> nn.Module:
    """Multinomial logistic regression (a linear layer on the flattened input)."""
    out = 1 if cfg["train.loss"] == "mse" else num_classes
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), out))


@models.register("mlp")
def mlp(cfg, input_shape, num_classes: int) -> nn.Module:
    """Fully connected ReLU network with `model.hidden` widths (and `model.mlp_dropout`)."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    dropout = cfg["model.mlp_dropout"]
    for h in cfg["model.hidden"]:
        layers += [nn.Linear(width, int(h)), nn.ReLU()] + ([nn.Dropout(dropout)] if dropout else [])
        width = int(h)
    layers.append(nn.Linear(width, 1 if cfg["train.loss"] == "mse" else num_classes))
    return nn.Sequential(*layers)


# ---------------------------------------------------------------- image models
def _image_shape(name: str, input_shape: tuple[int, ...], min_side: int) -> tuple[int, int, int]:
    if len(input_shape) != 3 or min(input_shape[1:]) < min_side:
        raise ConfigError(f"model.type: {name} needs image inputs (channels, height, width) of at "
                          f"least {min_side}x{min_side}; this data has shape {input_shape}")
    return input_shape  # type: ignore[return-value]


def _flat_size(features: nn.Module, shape: tuple[int, int, int]) -> int:
    with torch.no_grad():
        return int(features(torch.zeros(1, *shape)).numel())


def _norm(kind: str, channels: int, groups: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":
        if channels % groups:
            raise ConfigError(f"model.norm_groups: {groups} does not divide {channels} channels")
        return nn.GroupNorm(groups, channels)
    return nn.Identity()


class _Encoded(nn.Module):
    """forward = classifier(encode(x))."""

    classifier: nn.Linear

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encode(x))


class LeNet5(_Encoded):
    """LeNet-5 with ReLU and max pooling; conv1 pads by 2 so 28x28 inputs act like the original 32x32."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int):
        super().__init__()
        c = input_shape[0]
        conv = nn.Sequential(nn.Conv2d(c, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())
        flat = _flat_size(conv, input_shape)
        self.features = nn.Sequential(*conv, nn.Linear(flat, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU())
        self.classifier = nn.Linear(84, num_classes)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)


class ConvNet2(_Encoded):
    """Two 5x5 conv layers (32, 64 channels, each norm/ReLU/2x2 max-pool), a dropout-wrapped hidden layer."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, hidden: int = 2048,
                 dropout: float = 0.5, norm: str = "batch", groups: int = 2):
        super().__init__()
        c = input_shape[0]
        conv = nn.Sequential(nn.Conv2d(c, 32, 5, padding=2), _norm(norm, 32, groups), nn.ReLU(),
                             nn.MaxPool2d(2),
                             nn.Conv2d(32, 64, 5, padding=2), _norm(norm, 64, groups), nn.ReLU(),
                             nn.MaxPool2d(2), nn.Flatten())
        flat = _flat_size(conv.eval(), input_shape)
        self.features = nn.Sequential(*conv.train(), nn.Dropout(dropout), nn.Linear(flat, hidden),
                                      nn.ReLU(), nn.Dropout(dropout))
        self.classifier = nn.Linear(hidden, num_classes)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, norm: str, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = _norm(norm, cout, groups)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = _norm(norm, cout, groups)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          _norm(norm, cout, groups))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet18(_Encoded):
    """ResNet-18, CIFAR variant: a 3x3 stride-1 stem and no max-pool, then 4 stages of 2 basic blocks."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, norm: str = "batch",
                 groups: int = 2):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(input_shape[0], 64, 3, 1, 1, bias=False),
                                  _norm(norm, 64, groups), nn.ReLU())
        stages, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            stages.append(nn.Sequential(_BasicBlock(cin, cout, stride, norm, groups),
                                        _BasicBlock(cout, cout, 1, norm, groups)))
            cin = cout
        self.layers = nn.Sequential(*stages)
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(512, num_classes)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.layers(self.stem(x)))


class CharLSTM(_Encoded):
    """LEAF's Shakespeare model: character embedding, stacked LSTM, next character from the last step."""

    def __init__(self, vocab: int, embed: int = 8, hidden: int = 256, layers: int = 2):
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True)
        self.classifier = nn.Linear(hidden, vocab)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embedding(x))
        return out[:, -1]


@models.register("lenet5")
def lenet5(cfg, input_shape, num_classes: int) -> nn.Module:
    return LeNet5(_image_shape("lenet5", input_shape, 12), num_classes)


@models.register("convnet2")
def convnet2(cfg, input_shape, num_classes: int) -> nn.Module:
    return ConvNet2(_image_shape("convnet2", input_shape, 4), num_classes, cfg["model.convnet2_hidden"],
                    cfg["model.dropout"], cfg["model.norm"], cfg["model.norm_groups"])


@models.register("resnet18")
def resnet18(cfg, input_shape, num_classes: int) -> nn.Module:
    return ResNet18(_image_shape("resnet18", input_shape, 8), num_classes, cfg["model.norm"],
                    cfg["model.norm_groups"])


@models.register("char_lstm")
def char_lstm(cfg, input_shape, num_classes: int) -> nn.Module:
    """Inputs are sequences of character indices and the classes are the vocabulary."""
    if len(input_shape) != 1:
        raise ConfigError(f"model.type: char_lstm needs sequences of character indices "
                          f"(e.g. data.type=leaf_shakespeare); this data has shape {input_shape}")
    return CharLSTM(num_classes, cfg["model.lstm.embed"], cfg["model.lstm.hidden"],
                    cfg["model.lstm.layers"])
