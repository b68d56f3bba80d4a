"""Clients that lie about what their update decodes to, each the project's own client with
one stage changed: the update its compression stage encoded (or, for a language model, the
adapters it trained) is rewritten before it is sent. Loaded by tests through
`plugins: [tests.decoding_adversary_plugin]`, in simulation and in deployed processes alike.

`decoding_test.adversary` picks the change, `decoding_test.bad_client` the client making it:
- `huge_scale` (int8, int4): every scale 3.0e38, finite on the wire; codes of 2 or more then
  decode beyond float32's largest value, 3.4e38;
- `nan_scale` / `inf_scale`: every scale NaN / inf (the wire refuses those; a simulation has no
  wire);
- `index_out_of_range` (topk): each tensor's last index set to its number of entries;
- `index_duplicate` (topk): each tensor's second index set to its first;
- `nan_value` (topk): each tensor's first value NaN (simulation: the wire refuses it);
- `huge_value` (topk): every value 1e30: finite, and finite once decoded, but far away;
- `lora_product`: LoRA factors with A's first row and B's first column 1e20: finite in
  float32, but B A's entries are about 1e40;
- `lora_refactor`: the same with 1e19: B A's entries (about 1e38) are finite in float32, its
  Frobenius norm (about 3e39) is not, and so is not the re-factorized B = U S;
- `zero_weight`: the honest update, claiming num_samples 0: the weighted mean gives it no
  weight, which is the course without it, computed by FedAvg's own rule (the expectation).
"""
from __future__ import annotations

import torch

from fedcore.algorithms import compression  # noqa: F401  (registered first: this wrapper runs outside it)
from fedcore.kernel.config import declare
from fedcore.kernel.hooks import Wrapper
from fedcore.kernel.registry import behaviours

SCALES = {"huge_scale": 3.0e38, "nan_scale": float("nan"), "inf_scale": float("inf")}
INDICES = ("index_out_of_range", "index_duplicate", "nan_value", "huge_value")
LORA = {"lora_product": 1e20, "lora_refactor": 1e19}
ADVERSARIES = (*SCALES, *INDICES, *LORA, "zero_weight")

declare("decoding_test.adversary", str, "none", "tests: how the bad client's update lies",
        choices=("none",) + ADVERSARIES)
declare("decoding_test.bad_client", int, 0, "tests: the lying client")


def _lie(content: dict, received: dict, adversary: str) -> dict:
    """`content` (an update as the client's own stages made it from the `received` model) with
    the adversary's change."""
    content = dict(content)
    if adversary in SCALES:
        content["scale"] = {n: torch.full_like(s, SCALES[adversary]) for n, s in content["scale"].items()}
    elif adversary in INDICES:
        key = "topk_value" if adversary in ("nan_value", "huge_value") else "topk_index"
        changed = {}
        for name, t in content[key].items():
            t = t.clone()
            if adversary == "index_out_of_range":
                t[-1] = received[name].numel()
            elif adversary == "index_duplicate":
                t[1] = t[0]
            elif adversary == "nan_value":
                t[0] = float("nan")
            else:
                t.fill_(1e30)
            changed[name] = t
        content[key] = changed
    elif adversary in LORA:
        model = dict(content["model"])
        for a in [n for n in model if ".lora_A." in n]:
            b = a.replace("lora_A", "lora_B")
            model[a], model[b] = model[a].clone(), model[b].clone()
            model[a][0, :] = LORA[adversary]
            model[b][:, 0] = LORA[adversary]
        content["model"] = model
    else:   # zero_weight
        content["num_samples"] = 0
    return content


def install(course) -> None:
    cfg, trainer = course.cfg, course.trainer
    if trainer is None:
        return
    adversary, bad = cfg["decoding_test.adversary"], cfg["decoding_test.bad_client"]

    def lying_fit(fit, client_id, data, received, round_):
        result = fit(client_id, data, received, round_)
        if client_id == bad:
            result.content = _lie(result.content, received["model"], adversary)
        return result
    trainer.wrap(Wrapper("decoding_adversary", "fit", lying_fit, per_client_result=True, process_safe=True))


install.enabled = lambda cfg: cfg["decoding_test.adversary"] != "none"
behaviours.register("decoding_adversary", install)
