"""The time model: how long a client computes and how long bytes travel.

A client's reply is stamped `received_at + compute_time + upload_time`; a
broadcast arrives at `sent_at + download_time`. Compute time comes from the
client's device profile and the local work actually done (gradient
evaluations, i.e. samples through forward+backward); network time from the
message's serialized bytes, the link's bandwidth and its latency. Handlers
never invent time: workers charge work through `Worker.spend`, and the
communicator charges transfers.

Device profiles come from `time.profiles`: constant values, seeded
distributions per field, or a trace file (CSV or JSON, one row per device).
A profile's `dropout` is the probability that a sampled client never replies
to a round; the decision is drawn per (client, round) from the run's seed.
"""
from __future__ import annotations

import csv
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from fedcore.kernel.config import declare
from fedcore.kernel.errors import ConfigError

__all__ = ["DeviceProfile", "TimeModel", "PROFILE_FIELDS", "profile_builders", "distributions",
           "draw", "expected_work"]

declare("time.mode", str, "modeled",
        "modeled: compute time from device profiles (reproducible); measured: wall-clock "
        "seconds of the actual local training (not reproducible)",
        choices=("modeled", "measured"))
declare("time.profiles", dict, {"type": "constant"},
        "device profile source: {type: constant|random|trace|uniform|normal|lognormal|pareto|zipf, "
        "...}; fields: compute_speed (gradient evaluations/s), upload_bandwidth and "
        "download_bandwidth (bytes/s), latency (s), dropout (probability a sampled client never "
        "replies); with type random each field is a number or {dist: NAME, params}; with a "
        "distribution name as type it applies to `field` (default compute_speed); "
        "trace: {type: trace, path: FILE.csv|FILE.json, assign: random|cycle}; see docs/time_model.md")


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """One device: speeds, latency and how likely it is to vanish mid-round."""

    compute_speed: float = 1000.0          # gradient evaluations per second
    upload_bandwidth: float = 1.0e6        # bytes per second
    download_bandwidth: float = 1.0e7      # bytes per second
    latency: float = 0.05                  # seconds, one way
    dropout: float = 0.0                   # probability of never replying to a round


PROFILE_FIELDS = tuple(DeviceProfile.__dataclass_fields__)
_RATES = ("compute_speed", "upload_bandwidth", "download_bandwidth")

# name -> fn(spec: dict, client_ids: list[int], seed: int) -> dict[int, DeviceProfile]
profile_builders: dict[str, Callable] = {}


# ---------------------------------------------------------------- distributions
def _param(params: dict, name: str, default: Any = None, where: str = "") -> float:
    if name not in params:
        if default is None:
            raise ConfigError(f"time.profiles{where}: distribution '{params.get('dist')}' needs "
                              f"'{name}'")
        return default
    try:
        return float(params[name])
    except (TypeError, ValueError):
        raise ConfigError(f"time.profiles{where}.{name}: expected a number, got "
                          f"{params[name]!r}") from None


def _uniform(rng, p, n, where):
    low, high = _param(p, "low", where=where), _param(p, "high", where=where)
    if high < low:
        raise ConfigError(f"time.profiles{where}: uniform needs low <= high")
    return rng.uniform(low, high, n)


def _normal(rng, p, n, where):
    mean, std = _param(p, "mean", where=where), _param(p, "std", where=where)
    floor = _param(p, "floor", mean / 10.0, where)
    return np.maximum(rng.normal(mean, std, n), floor)


def _lognormal(rng, p, n, where):
    """`median * exp(sigma * N(0, 1))`: speeds spread multiplicatively around the median."""
    median, sigma = _param(p, "median", where=where), _param(p, "sigma", where=where)
    return median * np.exp(sigma * rng.standard_normal(n))


def _pareto(rng, p, n, where):
    """Classical Pareto: `scale * (1 + Lomax(shape))`, never below `scale`, heavy upper tail."""
    scale, shape = _param(p, "scale", where=where), _param(p, "shape", where=where)
    if shape <= 0:
        raise ConfigError(f"time.profiles{where}: pareto needs shape > 0")
    return scale * (1.0 + rng.pareto(shape, n))


def _zipf(rng, p, n, where):
    """`scale * k` with k ~ Zipf(a) in 1, 2, ...; `reciprocal: true` gives `scale / k`
    (most devices at full speed `scale`, a long tail of slow ones)."""
    scale, a = _param(p, "scale", where=where), _param(p, "a", where=where)
    if a <= 1:
        raise ConfigError(f"time.profiles{where}: zipf needs a > 1")
    k = rng.zipf(a, n).astype(float)
    return scale / k if p.get("reciprocal", False) else scale * k


def _constant(rng, p, n, where):
    return np.full(n, _param(p, "value", where=where))


# name -> fn(rng, params, n, where) -> array of n draws
distributions: dict[str, Callable] = {
    "constant": _constant, "uniform": _uniform, "normal": _normal, "lognormal": _lognormal,
    "pareto": _pareto, "zipf": _zipf}
_DIST_PARAMS = {"dist", "value", "low", "high", "mean", "std", "floor", "cap", "median", "sigma",
                "scale", "shape", "a", "reciprocal"}


def draw(spec: Any, n: int, rng: np.random.Generator, where: str = "") -> np.ndarray:
    """n values of one profile field: a number, or {dist: NAME, params..., floor, cap}."""
    if not isinstance(spec, dict):
        try:
            return np.full(n, float(spec))
        except (TypeError, ValueError):
            raise ConfigError(f"time.profiles{where}: expected a number or {{dist: ...}}, "
                              f"got {spec!r}") from None
    name = spec.get("dist")
    fn = distributions.get(name)
    if fn is None:
        raise ConfigError(f"time.profiles{where}.dist: unknown distribution {name!r}; known: "
                          f"{', '.join(sorted(distributions))}")
    unknown = set(spec) - _DIST_PARAMS
    if unknown:
        raise ConfigError(f"time.profiles{where}: unknown parameter '{sorted(unknown)[0]}' for "
                          f"distribution '{name}'")
    values = fn(rng, spec, n, where)
    if "floor" in spec and name != "normal":
        values = np.maximum(values, _param(spec, "floor", where=where))
    if "cap" in spec:
        values = np.minimum(values, _param(spec, "cap", where=where))
    return values


def _field_rng(seed: int, field: str) -> np.random.Generator:
    """One independent stream per field, so adding a field does not reshuffle the others."""
    return np.random.default_rng([seed % 2**32, 0x7153, PROFILE_FIELDS.index(field)])


def _checked(values: dict[str, float], where: str) -> DeviceProfile:
    for f in _RATES:
        if f in values and not values[f] > 0:
            raise ConfigError(f"time.profiles{where}: {f} must be > 0, got {values[f]}")
    if "latency" in values and values["latency"] < 0:
        raise ConfigError(f"time.profiles{where}: latency must be >= 0, got {values['latency']}")
    if "dropout" in values and not 0 <= values["dropout"] <= 1:
        raise ConfigError(f"time.profiles{where}: dropout must be in [0, 1], got {values['dropout']}")
    return DeviceProfile(**values)


def _unknown_field(names, where: str = "") -> None:
    unknown = set(names) - set(PROFILE_FIELDS)
    if unknown:
        raise ConfigError(f"time.profiles{where}: unknown field '{sorted(unknown)[0]}'; "
                          f"fields are {', '.join(PROFILE_FIELDS)}")


# ---------------------------------------------------------------- builders
def _constant_profiles(spec: dict, client_ids, seed: int) -> dict[int, DeviceProfile]:
    fields = {k: v for k, v in spec.items() if k != "type"}
    _unknown_field(fields)
    for k, v in fields.items():
        if isinstance(v, dict):
            raise ConfigError(f"time.profiles.{k}: a distribution needs type: random "
                              "(constant takes numbers only)")
    profile = _checked({k: float(draw(v, 1, None, f".{k}")[0]) for k, v in fields.items()}, "")
    return {cid: profile for cid in client_ids}


def _random_profiles(spec: dict, client_ids, seed: int) -> dict[int, DeviceProfile]:
    """Each field a number or a distribution, drawn per client in id order from the seed."""
    fields = {k: v for k, v in spec.items() if k != "type"}
    _unknown_field(fields)
    # a number is every client's value: checked as given (a distribution's draws are clipped)
    _checked({k: float(v) for k, v in fields.items() if isinstance(v, (int, float))}, "")
    ids = sorted(client_ids)
    columns = {f: draw(v, len(ids), _field_rng(seed, f), f".{f}") for f, v in fields.items()}
    if "dropout" in columns:
        columns["dropout"] = np.clip(columns["dropout"], 0.0, 1.0)
    return {cid: _checked({f: float(col[i]) for f, col in columns.items()}, f" (client {cid})")
            for i, cid in enumerate(ids)}


def _named_distribution(name: str) -> Callable:
    """`{type: lognormal, median: 100, sigma: 0.7, field: compute_speed, latency: 0.1}`."""
    def build(spec: dict, client_ids, seed: int) -> dict[int, DeviceProfile]:
        field = spec.get("field", "compute_speed")
        _unknown_field([field], ".field")
        params = {k: v for k, v in spec.items() if k in _DIST_PARAMS}
        rest = {k: v for k, v in spec.items() if k not in _DIST_PARAMS and k not in ("type", "field")}
        nested = [k for k, v in rest.items() if isinstance(v, dict)]
        if nested:
            raise ConfigError(f"time.profiles.{nested[0]}: a field of its own distribution goes under "
                              f"type: random; type: {name} is the shorthand for one field "
                              f"({{type: {name}, field: {field}, <its parameters>}}, the others numbers)")
        rest[field] = dict(params, dist=name)
        return _random_profiles(rest, client_ids, seed)
    build.__doc__ = f"One field drawn from the {name} distribution, the others constant."
    return build


def read_trace(path: str | Path) -> list[dict[str, float]]:
    """Rows of a device trace: CSV with a header, or JSON (a list of objects or {devices: [...]})."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"time.profiles.path: trace file '{p}' does not exist")
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"time.profiles.path: '{p}' is not valid JSON ({exc.msg})") from None
        rows = data.get("devices") if isinstance(data, dict) else data
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ConfigError(f"time.profiles.path: '{p}' must hold a list of device objects "
                              "(or {devices: [...]})")
    else:
        with p.open(newline="") as fh:
            rows = list(csv.DictReader(fh))
    if not rows:
        raise ConfigError(f"time.profiles.path: trace '{p}' has no devices")
    out = []
    known = PROFILE_FIELDS + ("client_id",)
    ignored = sorted({str(k).strip() for row in rows for k in row if k and str(k).strip() not in known})
    if ignored:   # a real trace may carry more (device names, ...); a misspelt field must not pass unseen
        logging.getLogger("fedcore.timing").warning(
            "time.profiles.path: trace '%s': columns ignored: %s (known: %s)", p, ", ".join(ignored[:8]),
            ", ".join(known))
    for i, row in enumerate(rows):
        keep = {k.strip(): v for k, v in row.items() if k and k.strip() in known}
        if not (set(keep) & set(PROFILE_FIELDS)):
            raise ConfigError(f"time.profiles.path: trace '{p}' row {i + 1} has none of the fields "
                              f"{', '.join(PROFILE_FIELDS)}")
        try:
            out.append({k: float(v) for k, v in keep.items() if v not in ("", None)})
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"time.profiles.path: trace '{p}' row {i + 1}: {exc}") from None
    return out


def _trace_profiles(spec: dict, client_ids, seed: int) -> dict[int, DeviceProfile]:
    """Devices from a trace; rows with `client_id` go to that client, others are assigned
    with the seed (`assign: random`, a permutation, with replacement when rows run short)
    or in turn (`assign: cycle`)."""
    unknown = set(spec) - {"type", "path", "assign"}
    if unknown:
        raise ConfigError(f"time.profiles: unknown key '{sorted(unknown)[0]}' for a trace "
                          "(keys: path, assign)")
    if "path" not in spec:
        raise ConfigError("time.profiles.path: a trace needs path: FILE.csv or FILE.json")
    rows = read_trace(spec["path"])
    ids = sorted(client_ids)
    assign = spec.get("assign", "random")
    if assign not in ("random", "cycle"):
        raise ConfigError(f"time.profiles.assign: {assign!r} is not one of random, cycle")
    if all("client_id" in r for r in rows):
        by_id = {int(r["client_id"]): r for r in rows}
        missing = [c for c in ids if c not in by_id]
        if missing:
            raise ConfigError(f"time.profiles.path: the trace has no row for client {missing[0]}; "
                              "add one or drop the client_id column to assign rows by the seed")
        chosen = [by_id[c] for c in ids]
    elif assign == "cycle":
        chosen = [rows[i % len(rows)] for i in range(len(ids))]
    else:
        rng = np.random.default_rng([seed % 2**32, 0x7ACE])
        if len(rows) >= len(ids):
            picks = rng.permutation(len(rows))[:len(ids)]
        else:
            picks = rng.integers(0, len(rows), len(ids))
        chosen = [rows[int(i)] for i in picks]
    return {cid: _checked({k: v for k, v in row.items() if k != "client_id"}, f" (client {cid})")
            for cid, row in zip(ids, chosen)}


profile_builders["constant"] = _constant_profiles
profile_builders["random"] = _random_profiles
profile_builders["trace"] = _trace_profiles
for _name in ("uniform", "normal", "lognormal", "pareto", "zipf"):
    profile_builders[_name] = _named_distribution(_name)


# ---------------------------------------------------------------- the model
def expected_work(course, client_id: int, nominal: float = 1000.0) -> float:
    """Gradient evaluations one round of local training costs `client_id` (from its training
    split and `train.*`); `nominal` where this process holds no data for the client."""
    clients = getattr(getattr(course, "data", None), "clients", None) or {}
    if client_id not in clients:
        return nominal
    cfg = course.cfg
    n = len(clients[client_id].train)
    steps = cfg["train.local_steps"]
    if steps is not None:
        return float(steps * min(cfg["train.batch_size"], n))
    return float(cfg["train.local_epochs"] * n)


class TimeModel:
    """Turns work and bytes into seconds for each client; the server is not a bottleneck."""

    def __init__(self, profiles: dict[int, DeviceProfile], mode: str = "modeled", seed: int = 0):
        self.profiles = profiles
        self.mode = mode
        self.seed = seed
        self.lost_replies = 0     # replies withheld by dropouts so far
        self._default = DeviceProfile()

    @classmethod
    def from_config(cls, cfg, client_ids) -> "TimeModel":
        spec = dict(cfg["time.profiles"])
        kind = spec.get("type", "constant")
        builder = profile_builders.get(kind)
        if builder is None:
            raise ConfigError(f"time.profiles.type: unknown profile source '{kind}'; "
                              f"known: {', '.join(sorted(profile_builders))}")
        return cls(builder(spec, list(client_ids), cfg["seed"]), cfg["time.mode"], cfg["seed"])

    def profile(self, worker_id: int) -> DeviceProfile:
        return self.profiles.get(worker_id, self._default)

    def compute_time(self, worker_id: int, work: float, measured: float = 0.0) -> float:
        """Seconds a client spends on `work` gradient evaluations."""
        if self.mode == "measured":
            return measured
        return work / self.profiles.get(worker_id, self._default).compute_speed

    def upload_time(self, worker_id: int, nbytes: int) -> float:
        p = self.profile(worker_id)
        return p.latency + nbytes / p.upload_bandwidth

    def download_time(self, worker_id: int, nbytes: int) -> float:
        p = self.profile(worker_id)
        return p.latency + nbytes / p.download_bandwidth

    def transfer_time(self, sender: int, receiver: int, nbytes: int, server_id: int = 0) -> float:
        """Seconds from send to arrival: the client's link is the bottleneck."""
        if sender == server_id:   # download_time and upload_time, inlined: once per message
            p = self.profiles.get(receiver, self._default)
            return p.latency + nbytes / p.download_bandwidth
        if receiver == server_id:
            p = self.profiles.get(sender, self._default)
            return p.latency + nbytes / p.upload_bandwidth
        return self.upload_time(sender, nbytes) + self.download_time(receiver, nbytes)

    def round_trip_time(self, worker_id: int, work: float, nbytes: int) -> float:
        """Modelled seconds of one round at a client: download, `work`, upload of `nbytes` each way."""
        return (self.download_time(worker_id, nbytes) + work / self.profile(worker_id).compute_speed
                + self.upload_time(worker_id, nbytes))

    # ------------------------------------------------------------ dropouts
    @property
    def has_dropouts(self) -> bool:
        return any(p.dropout > 0 for p in self.profiles.values())

    def drops_out(self, client_id: int, round_: int) -> bool:
        """Whether `client_id` vanishes during `round_`: one seeded draw per (client, round)."""
        p = self.profile(client_id).dropout
        if p <= 0:
            return False
        if p >= 1:
            return True
        rng = np.random.default_rng([self.seed % 2**32, 0xD209, client_id, round_])
        return bool(rng.random() < p)

    def keep(self, msg, receiver: int) -> bool:
        """A communicator filter: a dropped-out client's update never arrives."""
        if msg.msg_type == "updates" and msg.sender in self.profiles and \
                self.drops_out(msg.sender, msg.round):
            self.lost_replies += 1
            return False
        return True
