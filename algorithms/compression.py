"""Compressed updates: what a client sends is its model's change, quantized or sparsified.

`compress.type` picks the encoding of each floating entry's delta d = w_k - w (the
client's model minus the model it received); integer entries (BatchNorm counters)
travel exactly:

- `int8` / `int4`: per-tensor symmetric quantization with stochastic rounding.
  s = max|d| / L (L = 127 or 7), q = floor(d / s + u), u ~ U[0, 1), clamped to
  [-L, L]; the server reads q s. Unbiased (E[q s] = d) and |d - q s| <= s per entry.
  int4 packs two 4-bit codes per byte.
- `topk`: the k = ceil(`compress.topk_fraction` * numel) entries of largest magnitude,
  as (index, value) pairs (int32 indices below 2^31 entries); the others read as 0.

With `compress.error_feedback` (default on for topk) the client adds what it left
unsent last time (its residual, client state in the state store) before encoding
and keeps the new remainder: sent + residual = update + previous residual.

The server decodes an update as it arrives, against the model it broadcast this
round, so admission and every aggregator see a plain model. The wire checks the encoded
maps (finite scales and values); what they decode to is checked as it is decoded: a
scale whose largest code overflows the model's dtype, top-k indices that do not decode,
or a decoded entry not finite make the update a `Refusal` that admission refuses for its
client alone (`fedcore/runtime/admission.py`). Stochastic rounding
draws from the client's own stream, seeded by (seed, client, round), in simulation
and deployment alike: rounding protects no one, and the seeded stream makes a
deployment equal its simulation. `bytes_up` counts the encoded update. Figures:
docs/compression.md.
"""
from __future__ import annotations

import math

import torch

from fedcore.runtime import admission

from fedcore.kernel import registry
from fedcore.kernel.config import declare, fraction, validator
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.hooks import Wrapper
from fedcore.kernel.message import Message
from fedcore.kernel.worker import Registration
from fedcore.wire.tensor_forms import get_form

__all__ = ["KINDS", "LEVELS", "rounding_generator", "quantize", "dequantize", "top_k", "densify",
           "encode_update", "decode_update", "NotFinite", "wire_layout", "install"]

KINDS = ("none", "int8", "int4", "topk")
LEVELS = {"int8": 127, "int4": 7}      # largest code: symmetric codes in [-L, L]
RESIDUAL = "compression_residual"      # the client-state entry error feedback keeps

declare("compress.type", str, "none", "how a client encodes its update (the change of its "
        "model): none, int8 or int4 (per-tensor quantization with stochastic rounding) or topk "
        "(the largest entries, see compress.topk_fraction); docs/compression.md", choices=KINDS)
declare("compress.topk_fraction", float, 0.01, "topk: the fraction of each tensor's entries sent "
        "(at least one)", check=fraction)
declare("compress.error_feedback", bool, None, "add what the previous update left unsent before "
        "encoding (client state); default: on for topk, off for int8/int4 (unbiased already)")


@validator
def _check_compression(cfg) -> None:
    if cfg["compress.type"] == "none":
        return
    why, name = None, cfg["algorithm.name"]
    adding = [b for b in registry.selected_behaviours(cfg)
              if b != "compression" and hasattr(registry.behaviours.get(b), "update_layout")]
    if name in registry.algorithms and registry.algorithms.get(name).update_layout is not None:
        why = f"algorithm.name {name} sends more than a model"
    elif adding:
        why = f"{adding[0]} adds to the update"
    elif cfg["secure_aggregation.enabled"]:
        why = "secure aggregation masks the model itself"
    elif cfg["asyn.use"]:
        why = "an asynchronous server cannot tell which model a stale update started from"
    elif cfg["topology.edges"]:
        why = "edge aggregators average their clients' models, which they do not decode"
    if why:
        raise ConfigError(f"compress.type: {cfg['compress.type']} cannot be used here ({why}); "
                          "set compress.type=none")


def error_feedback(cfg) -> bool:
    on = cfg["compress.error_feedback"]
    return cfg["compress.type"] == "topk" if on is None else on


# ---------------------------------------------------------------- one tensor
def rounding_generator(seed: int, client_id: int, round_: int) -> torch.Generator:
    """Client `client_id`'s stochastic-rounding stream in `round_` (one per client and round)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + client_id) * 100_019 + round_ + 11)


def quantize(x: torch.Tensor, levels: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes in [-levels, levels] as int8, float32 scale s = max|x| / levels), stochastically
    rounded: floor(x / s + u), so the codes' mean over draws is x / s."""
    flat = x.detach().reshape(-1)
    amax = float(flat.abs().max()) if flat.numel() else 0.0
    scale = torch.tensor(amax / levels, dtype=torch.float32)
    if amax == 0.0:
        return torch.zeros(x.shape, dtype=torch.int8), scale
    u = torch.rand(flat.numel(), generator=generator, dtype=x.dtype)
    codes = torch.floor(flat / scale.to(x.dtype) + u).clamp_(-levels, levels)
    return codes.to(torch.int8).reshape(x.shape), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """codes * scale in `like`'s dtype and shape."""
    return (codes.to(like.dtype) * scale.to(like.dtype)).reshape(like.shape)


def pack4(codes: torch.Tensor) -> torch.Tensor:
    """Codes in [-7, 7] as two 4-bit values (code + 8) per byte, low nibble first."""
    v = (codes.reshape(-1).to(torch.int16) + 8).to(torch.uint8)
    if v.numel() % 2:
        v = torch.cat([v, torch.tensor([8], dtype=torch.uint8)])
    return v[0::2] | (v[1::2] << 4)


def unpack4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The int8 codes `pack4` packed (the first `numel`)."""
    both = torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1)[:numel]
    return both.to(torch.int8) - 8


def top_count(numel: int, share: float) -> int:
    return min(numel, max(1, math.ceil(share * numel))) if numel else 0


def top_k(x: torch.Tensor, share: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(ascending indices, values) of the ceil(share * numel) entries of largest magnitude."""
    flat = x.detach().reshape(-1)
    idx = torch.topk(flat.abs(), top_count(flat.numel(), share), sorted=False).indices.sort().values
    return idx.to(_index_dtype(flat.numel())), flat[idx]


def densify(idx: torch.Tensor, values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The dense tensor with `values` at `idx` and zeros elsewhere; ValueError for indices out of
    range or not strictly increasing (a hostile sender's, which scatter would take silently)."""
    n = like.numel()
    i = idx.to(torch.int64)
    if i.numel() and (int(i[0]) < 0 or int(i[-1]) >= n or bool((i[1:] <= i[:-1]).any())):
        raise ValueError("top-k indices out of range or not strictly increasing")
    out = torch.zeros(n, dtype=like.dtype)
    out[i] = values.to(like.dtype)
    return out.reshape(like.shape)


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2 ** 31 else torch.int64


# ---------------------------------------------------------------- one update
def encode_update(model: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], kind: str,
                  share: float, generator: torch.Generator,
                  residual: dict[str, torch.Tensor] | None = None):
    """(the wire maps of `model`'s change from `reference`, the decoded change, the new residual).

    `residual` (error feedback) is added to the change before encoding; the new residual is
    what the encoding left out. Integer entries travel exactly under 'exact'."""
    maps: dict[str, dict[str, torch.Tensor]] = {"exact": {}}
    sent, left = {}, {}
    for name, t in model.items():
        if not t.is_floating_point():
            maps["exact"][name] = t
            continue
        delta = t.detach() - reference[name].to(t.dtype)
        if residual is not None and name in residual:
            delta = delta + residual[name]
        if kind == "topk":
            idx, values = top_k(delta, share)
            maps.setdefault("topk_index", {})[name] = idx
            maps.setdefault("topk_value", {})[name] = values
            sent[name] = densify(idx, values, delta)
        else:
            codes, scale = quantize(delta, LEVELS[kind], generator)
            maps.setdefault("scale", {})[name] = scale
            maps.setdefault("q8" if kind == "int8" else "q4", {})[name] = (
                codes if kind == "int8" else pack4(codes))
            sent[name] = dequantize(codes, scale, delta)
        left[name] = delta - sent[name]
    return maps, sent, left


class NotFinite(ValueError):
    """A compressed update whose decoded values would not be finite in the model's dtype."""


def decode_update(content: dict, reference: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """The model a compressed update stands for: `reference` plus the decoded change (float
    entries, in `reference`'s order), integer entries as sent. ValueError for bad top-k indices;
    `NotFinite` for a scale whose largest code overflows the model's dtype (checked before
    decoding) or a decoded entry that is not finite (checked as each entry is decoded, a slice
    at a time, so no copy of the model beyond the decoded one)."""
    model = {}
    for name, ref in reference.items():
        if not ref.is_floating_point():
            model[name] = content["exact"][name]
            continue
        if kind == "topk":
            model[name] = ref + densify(content["topk_index"][name], content["topk_value"][name], ref)
        else:
            scale = content["scale"][name]
            _check_scale(name, scale, LEVELS[kind], ref.dtype)
            codes = content["q8"][name] if kind == "int8" else unpack4(content["q4"][name], ref.numel())
            model[name] = ref + dequantize(codes, scale, ref)
        if not _TORCH.all_finite(model[name]):
            raise NotFinite(f"entry '{name}' is not finite in {_dtype_name(ref.dtype)} once decoded")
    return model


def _check_scale(name: str, scale: torch.Tensor, levels: int, dtype: torch.dtype) -> None:
    """The largest decoded step, |scale| x levels, must be finite in the model's dtype."""
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1:   # the wire's layout says so too
        raise ValueError(f"entry '{name}': its scale is not one number")
    step = scale.to(torch.float64).abs() * levels
    if not math.isfinite(float(step)) or float(step) > torch.finfo(dtype).max:
        raise NotFinite(f"entry '{name}': scale {float(scale):.3g} x {levels} levels is not finite "
                        f"in {_dtype_name(dtype)}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_TORCH = get_form("torch")


def wire_layout(reference: dict[str, torch.Tensor], kind: str, share: float) -> dict[str, dict]:
    """The maps (entry -> a tensor of the expected shape and dtype) a compressed update carries."""
    def like(shape, dtype):
        return torch.empty((), dtype=dtype).expand(shape)
    layout: dict[str, dict] = {"exact": {n: t for n, t in reference.items() if not t.is_floating_point()}}
    for name, t in reference.items():
        if not t.is_floating_point():
            continue
        n = t.numel()
        if kind == "topk":
            k = top_count(n, share)
            layout.setdefault("topk_index", {})[name] = like((k,), _index_dtype(n))
            layout.setdefault("topk_value", {})[name] = like((k,), t.dtype)
        else:
            layout.setdefault("scale", {})[name] = like((), torch.float32)
            layout.setdefault("q8" if kind == "int8" else "q4", {})[name] = (
                like(t.shape, torch.int8) if kind == "int8" else like(((n + 1) // 2,), torch.uint8))
    return layout


# ---------------------------------------------------------------- the behaviour
def _install_client(course) -> None:
    cfg, trainer = course.cfg, course.trainer
    kind, share, feedback = cfg["compress.type"], cfg["compress.topk_fraction"], error_feedback(cfg)

    def compressed_fit(fit, client_id, data, received, round_):
        result = fit(client_id, data, received, round_)
        extra = set(result.content) - {"model", "num_samples"}
        if extra:
            raise RuntimeError(f"compress.type: the update also carries {sorted(extra)}; "
                               "only a model can be compressed")
        state = trainer.store.load(client_id) if feedback else {}
        maps, _, left = encode_update(result.content["model"], received["model"], kind, share,
                                      rounding_generator(cfg["seed"], client_id, round_),
                                      state.get(RESIDUAL))
        if feedback:
            state[RESIDUAL] = left
            trainer.store.save(client_id, state)
        result.content = {**maps, "num_samples": result.content["num_samples"]}
        return result
    # it encodes the fit's result against what was received, with the client's stored residual
    trainer.wrap(Wrapper("compress", "fit", compressed_fit, per_client_result=True, process_safe=True))


def _install_server(course) -> None:
    kind = course.cfg["compress.type"]
    registration = course.server_table.get("receiving_updates")
    collect = registration.fn

    def decompress_then(server, msg) -> None:
        """Decode this round's compressed update against the model broadcast, then collect it:
        one that does not decode to finite values is collected as a `Refusal`, which admission
        refuses for this client alone (the round does not wait for it)."""
        content = msg.content
        if msg.round == server.round and isinstance(content, dict) and "exact" in content:
            reference = server.aggregator.broadcast(server.round)["model"]
            try:
                model = decode_update(content, reference, kind)
            except NotFinite as exc:
                model = admission.Refusal("compressed update not finite once decoded", str(exc))
            except KeyError as exc:
                model = admission.Refusal("undecodable compressed update", f"it lacks the entry {exc}")
            except ValueError as exc:
                model = admission.Refusal("undecodable compressed update", f"it does not decode: {exc}")
            msg = Message(msg.msg_type, msg.sender, msg.receivers, msg.round, msg.timestamp,
                          {"model": model, "num_samples": content["num_samples"]}, msg.content_size,
                          owned=True)   # a content built here, for the server alone
        collect(server, msg)
    decompress_then.__qualname__ = f"decompress_then.{registration.name}"
    # a wrapper, not a replacement: the collecting handler still runs (no "replaced" warning)
    course.server_table.entries["receiving_updates"] = Registration(
        "receiving_updates", decompress_then, registration.sends)


def compressed_layout(server, layout: dict) -> dict:
    """The update's layout on the wire (declared below): the model's maps, encoded."""
    cfg = server.course.cfg
    return wire_layout(layout["model"], cfg["compress.type"], cfg["compress.topk_fraction"])


def install(course) -> None:
    """Behaviour: clients encode their updates; the server decodes each as it arrives."""
    if course.trainer is not None:
        _install_client(course)
    if course.server is not None:
        _install_server(course)


install.enabled = lambda cfg: cfg["compress.type"] != "none"
install.update_layout = compressed_layout
registry.behaviours.register("compression", install)
