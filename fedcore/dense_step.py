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
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["DenseStep"]


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
        vector per sample, on the CPU (where the layouts were compared with `vmap`)."""
        if y.is_floating_point() or y.dim() != 2 or x.device.type != "cpu" or x.dim() < 3:
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
        logp = torch.log_softmax(h, 2)
        index = y.unsqueeze(2)
        loss = logp.gather(2, index).sum((1, 2)).neg().div(b)
        seed = torch.ones_like(loss).div(b).neg().view(c, 1, 1).expand(c, b, 1)
        g = torch._log_softmax_backward_data(seed.new_zeros(logp.shape).scatter_add(2, index, seed),
                                             logp, 2, logp.dtype)
        grads: dict[str, torch.Tensor] = {}
        for i in range(len(self.layers) - 1, self._first - 1, -1):
            kind, w, bias = self.layers[i]
            if kind == "relu":
                g = torch.ops.aten.threshold_backward(g, inputs[i], 0)
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
