"""Convolutions under `vmap` as one dense convolution per client, for the vectorized executor.

`vmap` turns a convolution whose weights differ per client into one grouped
convolution over all clients (their channels side by side). On CPU the grouped
kernels are slower per multiply-add than the dense ones a client's own
convolution uses, by more than batching saves elsewhere. `ClientConv2d` is a
`Conv2d` whose batching rule runs, for each client, the dense convolution (and,
backwards, the dense convolution gradient) that the sequential trainer runs for
that client; the rest of the model stays batched. `with_client_convs` gives a
copy of a model with its convolutions so replaced, for `functional_call`.
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["ClientConv2d", "with_client_convs"]


def _per_client(t: torch.Tensor | None, dim: int | None, n: int) -> list:
    """The n clients' slices of `t` along `dim` (the same tensor n times when not batched)."""
    if t is None or dim is None:
        return [t] * n
    return list(t.movedim(dim, 0).unbind(0))


class _Geometry:
    __slots__ = ("stride", "padding", "dilation", "groups")

    def __init__(self, conv: nn.Conv2d):
        self.stride, self.padding = list(conv.stride), list(conv.padding)
        self.dilation, self.groups = list(conv.dilation), conv.groups


def _conv_grads(g, x, w, has_bias: bool, geo: _Geometry, need_x: bool):
    gx, gw, gb = torch.ops.aten.convolution_backward(
        g, x, w, [w.shape[0]] if has_bias else None, geo.stride, geo.padding, geo.dilation,
        False, [0, 0], geo.groups, [need_x, True, has_bias])
    return (gx if gx is not None else torch.zeros_like(x)), gw, \
        (gb if gb is not None else torch.zeros(0, dtype=w.dtype))


class _ConvGrads(torch.autograd.Function):
    """The gradients of a convolution (input, weight, bias), per client under `vmap`."""

    @staticmethod
    def forward(g, x, w, has_bias, geo, need_x):
        return _conv_grads(g, x, w, has_bias, geo, need_x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("second derivatives of a client convolution are not supported")

    @staticmethod
    def vmap(info, in_dims, g, x, w, has_bias, geo, need_x):
        n = info.batch_size
        outs = [_conv_grads(a, b, c, has_bias, geo, need_x)
                for a, b, c in zip(_per_client(g, in_dims[0], n), _per_client(x, in_dims[1], n),
                                   _per_client(w, in_dims[2], n))]
        return tuple(torch.stack(parts) for parts in zip(*outs)), (0, 0, 0)


class _ClientConv(torch.autograd.Function):
    @staticmethod
    def forward(x, w, b, geo):
        return F.conv2d(x, w, b, geo.stride, geo.padding, geo.dilation, geo.groups)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, b, geo = inputs
        ctx.save_for_backward(x, w)
        ctx.geo, ctx.has_bias = geo, b is not None

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0]
        gx, gw, gb = _ConvGrads.apply(g, x, w, ctx.has_bias, ctx.geo, need_x)
        return (gx if need_x else None), gw, (gb if ctx.has_bias else None), None

    @staticmethod
    def vmap(info, in_dims, x, w, b, geo):
        n = info.batch_size
        outs = [F.conv2d(xi, wi, bi, geo.stride, geo.padding, geo.dilation, geo.groups)
                for xi, wi, bi in zip(_per_client(x, in_dims[0], n), _per_client(w, in_dims[1], n),
                                      _per_client(b, in_dims[2], n))]
        return torch.stack(outs), 0


class ClientConv2d(nn.Conv2d):
    """A `Conv2d` that, under `vmap`, convolves each client with its own dense kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ClientConv.apply(x, self.weight, self.bias, _Geometry(self))


def _replaceable(m: nn.Module) -> bool:
    return type(m) is nn.Conv2d and m.padding_mode == "zeros" and not isinstance(m.padding, str)


def with_client_convs(model: nn.Module) -> nn.Module:
    """`model` itself when it has no plain `Conv2d`; else a copy whose `Conv2d` modules are
    `ClientConv2d` (same parameter names, so `functional_call` takes the same tensors)."""
    if not any(_replaceable(m) for m in model.modules()):
        return model
    model = copy.deepcopy(model)
    for m in list(model.modules()):
        for name, child in list(m.named_children()):
            if _replaceable(child):
                child.__class__ = ClientConv2d   # same state, the per-client forward
    return model
