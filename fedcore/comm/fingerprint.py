"""A fingerprint of the config keys a server and its clients must agree on.

A client started with another model, dataset or algorithm than its server
would otherwise fail deep inside a round (or, worse, train something else).
The client sends one short hash per course-defining key when it connects; the
server compares them with its own and refuses a client whose keys differ,
naming the keys and never their values: a token holder without the config must
not learn the course's values (its `seed` included) from a refusal. It guards
against mistakes, not against a hostile client (which can send any
fingerprint): the wire checks and admission do that.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["course_keys", "fingerprint", "differing_keys"]

SECTIONS = ("model", "algorithm", "data")
KEYS = ("course", "seed", "federate.client_num", "federate.share_params", "train.loss",
        # the privacy the server reports (summary.json's dp_epsilon) is that of this mechanism
        "privacy.dp.mode", "privacy.dp.noise_multiplier", "privacy.dp.clip_norm",
        "privacy.dp.clip_each_step", "privacy.dp.clients", "privacy.dp.fraction")
# Paths may differ between machines; what they hold is checked elsewhere (the model's layout on
# the wire, a client's own data by its own partition).
MACHINE_LOCAL = ("data.root", "model.init_from")


def course_keys(cfg) -> dict[str, Any]:
    """The course-defining keys and their values. A client on its own data
    (`distribute.own_data`) defines its data itself, so data keys and the seed are left out."""
    own_data = bool(cfg.get("distribute.own_data"))
    out: dict[str, Any] = {}
    for section in SECTIONS:
        if section == "data" and own_data:
            continue
        for k, v in cfg.section(section).items():
            key = f"{section}.{k}"
            if key not in MACHINE_LOCAL:
                out[key] = v
    for key in KEYS:
        if key in cfg and not (own_data and key == "seed"):
            out[key] = cfg[key]
    return out


def _hash(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def fingerprint(cfg) -> str:
    """`key=hash;key=hash;...` (ASCII, a few hundred bytes: fits in gRPC metadata)."""
    return ";".join(f"{k}={_hash(v)}" for k, v in sorted(course_keys(cfg).items()))


def differing_keys(cfg, theirs: str) -> list[str]:
    """The names of the keys whose values differ between `cfg` and the fingerprint `theirs`,
    sorted (keys only one side knows are not compared). Names only: what is sent back to a
    refused client must not tell it our values."""
    ours = course_keys(cfg)
    out = set()
    for pair in theirs.split(";"):
        key, _, h = pair.partition("=")
        if key in ours and _hash(ours[key]) != h:
            out.add(key)
    return sorted(out)
