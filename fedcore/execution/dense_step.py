"""A group's SGD step for stacks of Flatten, Linear and ReLU, without `torch.func`.

For such a model - an `nn.Sequential` of `Flatten`, `Linear` and `ReLU` layers, trained with
cross-entropy on class indices - the vectorized executor's `vmap(grad_and_value(...))` runs a
fixed sequence of ATen operations: in a group's first step, where every client starts from the
same received parameters, each layer's forward pass is one matrix product over all the
group's samples and only the weight gradients are per client (batched products); in later
steps, with each client's own parameters, the products are batched throughout. `DenseStep`
calls the same operations on the same layouts directly - hence the same numbers, bit for bit
(tested against `vmap` in both forms) - without the transforms' per-operation wrapping and
autograd's graph, which cost as much as the arithmetic on small models (W1's first step:
1.2 ms against 2.2-2.5 ms). Any other model or loss goes through `vmap`.

Two of those operations are ATen's own backward kernels, which torch does not promise to keep
(`_log_softmax_backward_data`, `aten.threshold_backward`). At first use they are checked
against public operations that give the same numbers (autograd through `log_softmax`, a
`where` for ReLU's gradient); if one is missing or disagrees, the public forms are used
from then on (slower by the small autograd graph) and one line says so.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

__all__ = ["DenseStep"]

log = logging.getLogger("fedcore.dense_step")


def _private_log_softmax(h: torch.Tensor):
    """log_softmax over the classes and its backward, by ATen's kernel."""
    logp = torch.log_softmax(h, 2)
    return logp, lambda g: torch._log_softmax_backward_data(g, logp, 2, logp.dtype)


def _public_log_softmax(h: torch.Tensor):
    """The same through autograd (the same kernel, reached by public calls)."""
    h = h.detach().requires_grad_()
    with torch.enable_grad():
        logp = torch.log_softmax(h, 2)
    return logp.detach(), lambda g: torch.autograd.grad(logp, h, g)[0]


def _private_relu_grad(g: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.threshold_backward(g, out, 0)


def _public_relu_grad(g: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return torch.where(out > 0, g, 0.0)


_DEVICES = ("cpu", "cuda")
PRIVATE, PUBLIC = (_private_log_softmax, _private_relu_grad), (_public_log_softmax, _public_relu_grad)
_chosen: tuple | None = None


def _disagreement(private: tuple, public: tuple) -> str | None:
    """Why the private operations cannot be used (None when they give the public ones' numbers
    on a small input with ties at zero)."""
    h = torch.tensor([[[0.5, -1.0, 2.0], [0.0, 3.0, -2.0]]], dtype=torch.float32)
    g = torch.tensor([[[0.0, -0.5, 0.0], [-0.5, 0.0, 0.0]]])
    try:
        (lp, back), (lp2, back2) = private[0](h), public[0](h)
        if not (torch.equal(lp, lp2) and torch.equal(back(g), back2(g))):
            return "log_softmax's backward gives other numbers"
        if not torch.equal(private[1](h, torch.relu(h)), public[1](h, torch.relu(h))):
            return "ReLU's backward gives other numbers"
    except Exception as e:   # a removed or changed private op
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None


def _ops() -> tuple:
    """The operations to use, checked once per process."""
    global _chosen
    if _chosen is None:
        why = _disagreement(PRIVATE, PUBLIC)
        if why:
            log.warning("dense step: ATen's private backward ops cannot be used (%s); public "
                        "operations with the same numbers are used instead", why)
        _chosen = PUBLIC if why else PRIVATE
    return _chosen


class DenseStep:
    """`vmap(grad_and_value(objective))` for Flatten/Linear/ReLU stacks: with `shared` the
    parameters are one set for all clients (`in_dims=(None, 0, 0)`), else stacked per client."""

    def __init__(self, layers: list[tuple[str, str | None, str | None]]):
        self.layers = layers   # (kind, weight name, bias name) per layer, in order; a Linear last
        self._first = next(i for i, layer in enumerate(layers) if layer[0] == "linear")

    @classmethod
    def of(cls, model: nn.Module, loss: str) -> "DenseStep | None":
        """The dense step of `model`, or None where it does not apply (then `vmap` runs)."""
        if loss == "mse" or type(model) is not nn.Sequential or not len(model):
            return None
        layers = []
        for name, m in model.named_children():
            if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks \
                    or m._backward_pre_hooks or list(m.children()):
                return None
            if type(m) is nn.Linear:
                layers.append(("linear", f"{name}.weight", f"{name}.bias" if m.bias is not None else None))
            elif type(m) is nn.ReLU:
                layers.append(("relu", None, None))
            elif type(m) is nn.Flatten and m.start_dim == 1 and m.end_dim == -1:
                layers.append(("flatten", None, None))
            else:
                return None
        if model._forward_hooks or model._forward_pre_hooks or layers[-1][0] != "linear":
            return None
        return cls(layers)

    def applies(self, x: torch.Tensor, y: torch.Tensor) -> bool:
        """Class-index labels, one per sample, and inputs that reach the first Linear as one
        vector per sample, on the CPU or a CUDA GPU (where the layouts were compared with
        `vmap`'s)."""
        if y.is_floating_point() or y.dim() != 2 or x.device.type not in _DEVICES or x.dim() < 3:
            return False
        return x.dim() == 3 or ("flatten", None, None) in self.layers[:self._first]

    def __call__(self, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                 shared: bool = True):
        """Every client's gradients (stacked along dimension 0) and loss, for inputs
        x [clients, batch, ...] and labels y [clients, batch]."""
        c, b = y.shape
        h = x
        inputs = []   # each layer's input (Linear) or output (ReLU), for the backward pass
        for kind, w, bias in self.layers:
            if kind == "flatten":
                h = h.flatten(2)
                inputs.append(None)
            elif kind == "relu":
                h = torch.relu(h)
                inputs.append(h)
            else:
                inputs.append(h)
                weight = params[w]
                if shared:
                    h = torch.mm(h.reshape(c * b, h.shape[-1]), weight.t()).view(c, b, weight.shape[0])
                    if bias is not None:
                        h = torch.add(params[bias], h)
                else:
                    h = torch.bmm(h, weight.transpose(1, 2))
                    if bias is not None:
                        h = torch.add(params[bias].unsqueeze(1), h)
        # -log_softmax(out).gather(labels).sum() / b per client, and its gradient
        log_softmax, relu_grad = _ops()
        logp, log_softmax_backward = log_softmax(h)
        index = y.unsqueeze(2)
        loss = logp.gather(2, index).sum((1, 2)).neg().div(b)
        seed = torch.ones_like(loss).div(b).neg().view(c, 1, 1).expand(c, b, 1)
        g = log_softmax_backward(seed.new_zeros(logp.shape).scatter_add(2, index, seed))
        grads: dict[str, torch.Tensor] = {}
        for i in range(len(self.layers) - 1, self._first - 1, -1):
            kind, w, bias = self.layers[i]
            if kind == "relu":
                g = relu_grad(g, inputs[i])
            elif kind == "linear":
                grads[w] = torch.bmm(g.transpose(1, 2), inputs[i])
                if bias is not None:
                    grads[bias] = g.sum(1)
                if i > self._first:
                    weight = params[w]
                    if shared:
                        g = torch.mm(g.reshape(c * b, g.shape[-1]), weight).view(c, b, weight.shape[1])
                    else:
                        g = torch.bmm(g, weight)
            # a Flatten after the first Linear meets [clients, batch, features]: nothing to undo
        return grads, loss
