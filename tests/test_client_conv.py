"""Convolutions under vmap, per client with the dense kernels: the same numbers as each
client's own convolution and its autograd gradients, for every geometry."""
import pytest
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from fedcore.execution.client_conv import ClientConv2d, with_client_convs


def _net(conv: nn.Conv2d) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(conv, nn.ReLU(), nn.Flatten(), nn.LazyLinear(3))


@pytest.mark.parametrize("conv", [
    lambda: nn.Conv2d(2, 4, 3),
    lambda: nn.Conv2d(2, 4, 3, stride=2, padding=1, bias=False),
    lambda: nn.Conv2d(4, 4, 3, dilation=2, groups=2),
], ids=["plain", "stride_padding_nobias", "dilation_groups"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared_weights", "own_weights"])
def test_vmapped_client_convolutions_equal_each_clients_own(conv, shared):
    net = _net(conv())
    c, b = 3, 5
    x = torch.randn(c, b, net[0].in_channels, 9, 9)
    y = torch.randint(0, 3, (c, b))
    net(x[0])                                                # materialise the lazy layer
    vec = with_client_convs(net)
    assert isinstance(vec[0], ClientConv2d) and type(net[0]) is nn.Conv2d   # a copy; net untouched
    base = {n: p.detach() for n, p in net.named_parameters()}
    params = base if shared else {n: p + 0.1 * torch.randn((c,) + p.shape) for n, p in base.items()}

    def loss(p, xb, yb):
        return nn.functional.cross_entropy(functional_call(vec, p, (xb,)), yb)
    grads, losses = vmap(grad_and_value(loss), in_dims=(None if shared else 0, 0, 0))(params, x, y)
    for k in range(c):
        own = {n: (t if shared else t[k]).clone().requires_grad_() for n, t in params.items()}
        out = nn.functional.cross_entropy(functional_call(net, own, (x[k],)), y[k])
        out.backward()
        assert torch.allclose(losses[k], out.detach(), rtol=0, atol=1e-6)
        for n, p in own.items():
            assert torch.allclose(grads[n][k], p.grad, rtol=0, atol=1e-6), n


def test_models_without_plain_convolutions_are_used_as_they_are():
    mlp = nn.Sequential(nn.Linear(3, 2))
    assert with_client_convs(mlp) is mlp
    circular = nn.Sequential(nn.Conv2d(1, 1, 3, padding=1, padding_mode="circular"))
    assert with_client_convs(circular) is circular
