"""The time model: how long a client computes and how long bytes travel.

A client's reply is stamped `received_at + compute_time + upload_time`; a
broadcast arrives at `sent_at + download_time`. Compute time comes from the
client's device profile and the local work actually done (gradient
evaluations, i.e. samples through forward+backward); network time from the
message's serialized bytes, the link's bandwidth and its latency. Handlers
never invent time: workers charge work through `Worker.spend`, and the
communicator charges transfers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fedcore.config import declare

__all__ = ["DeviceProfile", "TimeModel", "PROFILE_FIELDS", "profile_builders"]

declare("time.mode", str, "modeled",
        "modeled: compute time from device profiles (reproducible); measured: wall-clock "
        "seconds of the actual local training (not reproducible)",
        choices=("modeled", "measured"))
declare("time.profiles", dict, {"type": "constant"},
        "device profile source: {type: constant|..., <field>: value or distribution}; fields: "
        "compute_speed (gradient evaluations/s), upload_bandwidth and download_bandwidth "
        "(bytes/s), latency (s), dropout (probability a sampled client never replies)")


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """One device: speeds, latency and how likely it is to vanish mid-round."""

    compute_speed: float = 1000.0          # gradient evaluations per second
    upload_bandwidth: float = 1.0e6        # bytes per second
    download_bandwidth: float = 1.0e7      # bytes per second
    latency: float = 0.05                  # seconds, one way
    dropout: float = 0.0                   # probability of never replying to a round


PROFILE_FIELDS = tuple(DeviceProfile.__dataclass_fields__)

# name -> fn(spec: dict, client_ids: list[int], seed: int) -> dict[int, DeviceProfile]
profile_builders: dict[str, Callable] = {}


def _constant_profiles(spec: dict, client_ids, seed: int) -> dict[int, DeviceProfile]:
    fields = {k: float(v) for k, v in spec.items() if k != "type"}
    unknown = set(fields) - set(PROFILE_FIELDS)
    if unknown:
        from fedcore.errors import ConfigError
        raise ConfigError(f"time.profiles: unknown field '{sorted(unknown)[0]}'; "
                          f"fields are {', '.join(PROFILE_FIELDS)}")
    profile = DeviceProfile(**fields)
    return {cid: profile for cid in client_ids}


profile_builders["constant"] = _constant_profiles


class TimeModel:
    """Turns work and bytes into seconds for each client; the server is not a bottleneck."""

    def __init__(self, profiles: dict[int, DeviceProfile], mode: str = "modeled"):
        self.profiles = profiles
        self.mode = mode
        self._default = DeviceProfile()

    @classmethod
    def from_config(cls, cfg, client_ids) -> "TimeModel":
        spec = dict(cfg["time.profiles"])
        kind = spec.get("type", "constant")
        builder = profile_builders.get(kind)
        if builder is None:
            from fedcore.errors import ConfigError
            raise ConfigError(f"time.profiles.type: unknown profile source '{kind}'; "
                              f"known: {', '.join(sorted(profile_builders))}")
        return cls(builder(spec, list(client_ids), cfg["seed"]), cfg["time.mode"])

    def profile(self, worker_id: int) -> DeviceProfile:
        return self.profiles.get(worker_id, self._default)

    def compute_time(self, worker_id: int, work: float, measured: float = 0.0) -> float:
        """Seconds a client spends on `work` gradient evaluations."""
        if self.mode == "measured":
            return measured
        return work / self.profile(worker_id).compute_speed

    def upload_time(self, worker_id: int, nbytes: int) -> float:
        p = self.profile(worker_id)
        return p.latency + nbytes / p.upload_bandwidth

    def download_time(self, worker_id: int, nbytes: int) -> float:
        p = self.profile(worker_id)
        return p.latency + nbytes / p.download_bandwidth

    def transfer_time(self, sender: int, receiver: int, nbytes: int, server_id: int = 0) -> float:
        """Seconds from send to arrival: the client's link is the bottleneck."""
        if sender == server_id:
            return self.download_time(receiver, nbytes)
        if receiver == server_id:
            return self.upload_time(sender, nbytes)
        return self.upload_time(sender, nbytes) + self.download_time(receiver, nbytes)
