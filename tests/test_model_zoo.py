"""Model zoo: forward shapes on each dataset's input shape and documented parameter counts."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fedcore.kernel.errors import ConfigError
from fedcore.scenarios.models import build_model, count_parameters
from tests.conftest import small_cfg


def make(model_type: str, shape, classes: int, **over) -> nn.Module:
    return build_model(small_cfg(model__type=model_type, **over), shape, classes)


def test_lenet5_parameter_count_for_28x28_by_hand():
    conv1 = 1 * 6 * 25 + 6
    conv2 = 6 * 16 * 25 + 16
    fcs = (16 * 5 * 5 * 120 + 120) + (120 * 84 + 84) + (84 * 10 + 10)
    assert count_parameters(make("lenet5", (1, 28, 28), 10)) == conv1 + conv2 + fcs == 61_706


def test_convnet2_parameter_count_by_hand():
    convs = (1 * 32 * 25 + 32) + (32 * 64 * 25 + 64)
    fcs = (64 * 7 * 7 * 2048 + 2048) + (2048 * 62 + 62)
    model = make("convnet2", (1, 28, 28), 62, model__norm="none")
    assert count_parameters(model) == convs + fcs
    assert count_parameters(make("convnet2", (1, 28, 28), 62)) == convs + fcs + 2 * (32 + 64)  # BN


def test_char_lstm_parameter_count_by_hand():
    embed, hidden, vocab = 8, 256, 80
    lstm = sum(4 * hidden * (inp + hidden) + 8 * hidden for inp in (embed, hidden))
    assert count_parameters(make("char_lstm", (80,), vocab)) == vocab * embed + lstm + hidden * vocab + vocab


@pytest.mark.parametrize("model_type,shape,classes,over", [
    ("logreg", (1, 8, 8), 10, {}), ("mlp", (60,), 10, {}),
    ("lenet5", (1, 28, 28), 62, {}), ("lenet5", (3, 32, 32), 10, {}),
    ("convnet2", (1, 28, 28), 10, {}), ("convnet2", (3, 32, 32), 100, {"model__norm": "group"}),
    ("resnet18", (3, 32, 32), 10, {}), ("resnet18", (3, 32, 32), 10, {"model__norm": "group"}),
])
def test_image_and_vector_forward_shapes(model_type, shape, classes, over):
    model = make(model_type, shape, classes, **over)
    out = model(torch.rand(2, *shape))
    assert out.shape == (2, classes)
    if hasattr(model, "encode"):
        model.eval()  # dropout off: forward must equal classifier(encode(x))
        assert torch.allclose(model.classifier(model.encode(torch.zeros(2, *shape))),
                              model(torch.zeros(2, *shape)))


def test_resnet18_cifar_size_and_norm_choice():
    bn = make("resnet18", (3, 32, 32), 10)
    assert count_parameters(bn) == 11_173_962
    assert bn.stem[0].kernel_size == (3, 3) and bn.stem[0].stride == (1, 1)
    assert any(isinstance(m, nn.BatchNorm2d) for m in bn.modules())
    gn = make("resnet18", (3, 32, 32), 10, model__norm="group", model__norm_groups=2)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in gn.modules())
    assert not [n for n, _ in gn.named_buffers()]  # nothing but parameters to aggregate
    assert count_parameters(gn) == count_parameters(bn)  # GroupNorm has the same affine parameters


def test_char_lstm_predicts_next_character_from_indices():
    model = make("char_lstm", (80,), 80)
    out = model(torch.randint(0, 80, (3, 80)))
    assert out.shape == (3, 80)


@pytest.mark.parametrize("model_type,shape", [("lenet5", (1, 8, 8)), ("lenet5", (64,)),
                                              ("resnet18", (60,)), ("char_lstm", (1, 28, 28))])
def test_wrong_input_shape_is_a_config_error(model_type, shape):
    with pytest.raises(ConfigError, match="model.type"):
        make(model_type, shape, 10)


def test_group_norm_groups_must_divide_channels():
    with pytest.raises(ConfigError, match="model.norm_groups"):
        make("convnet2", (1, 28, 28), 10, model__norm="group", model__norm_groups=5)
