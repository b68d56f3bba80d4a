"""Prometheus metrics of a deployed server or edge, read from the course at scrape time.

Nothing here keeps counts of its own: each scrape reads what the course already knows
(the monitor's records and byte totals, the server's joined set, the communicator's
sessions and refusal counts, admission's tallies, the checkpointer's last snapshot) and
turns it into metric families. Labels carry only the project's own words (tier,
direction, a refusal's kind, a record's field name), never a token, a key, a peer's
address or a configuration value.
"""
from __future__ import annotations

import math
import os
import re
import time
from typing import Any, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

__all__ = ["CourseCollector", "course_registry", "ROUND_BUCKETS"]

# seconds a round took; a course of tiny models runs many rounds a second, a language model's
# one round may take an hour
ROUND_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
# records a scrape looks back through for each field's latest value (evaluations are rarer)
RECENT = 1000
# the fields of a round's record exported as gauges (`fedcore_record_value{field=...}`)
RECORD_FIELDS = re.compile(r"^(test_|client_test_|val_|train_)[a-z_]*$|^(dp_epsilon|server_update_norm)$")


def _copy(mapping) -> dict:
    """A dict copy of a mapping another thread may be adding to (retried if it grew meanwhile)."""
    for _ in range(5):
        try:
            return dict(mapping)
        except RuntimeError:
            continue
    return {}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def model_norm(state: dict | None) -> float | None:
    """The L2 norm of a model's floating-point entries (None without a model)."""
    if not state:
        return None
    total = 0.0
    for t in list(state.values()):
        if getattr(t, "is_floating_point", lambda: False)():
            total += float(t.detach().double().pow(2).sum())
    return math.sqrt(total)


class CourseCollector(Collector):
    """Reads one deployed course (`ServerCourse` or `EdgeCourse`) when Prometheus scrapes."""

    def __init__(self, course, tier: str):
        self.course, self.tier = course, tier

    def collect(self) -> Iterator:
        c, tier = self.course, self.tier
        worker, monitor = c.server, c.monitor
        records = list(monitor.records)
        rounds = [r for r in records if "round" in r]

        g = GaugeMetricFamily("fedcore_round", "the round the server (edge: its cloud round) is in",
                              labels=["tier"])
        g.add_metric([tier], float(getattr(worker, "cloud_round", worker.round) or 0))
        yield g
        done = CounterMetricFamily("fedcore_rounds_completed", "aggregation rounds whose record is "
                                   "written (metrics.jsonl)", labels=["tier"])
        done.add_metric([tier], float(len(rounds)))
        yield done
        yield self._durations(rounds)

        sessions = _copy(getattr(c.comm, "down", c.comm).describe())
        states = [s["state"] for s in sessions.values()]
        clients = GaugeMetricFamily("fedcore_clients", "clients by state: joined the course, alive "
                                    "(a live session), dropped (session lost: no heartbeat or a "
                                    "broken stream), left (said goodbye)", labels=["tier", "state"])
        clients.add_metric([tier, "joined"], float(len(set(getattr(worker, "joined", ())))))
        clients.add_metric([tier, "alive"], float(states.count("live")))
        clients.add_metric([tier, "dropped"], float(states.count("lost")))
        clients.add_metric([tier, "left"], float(states.count("left")))
        yield clients
        expected = GaugeMetricFamily("fedcore_clients_expected", "participants this tier waits for "
                                     "(a cloud: its edges)", labels=["tier"])
        counts = {"edge": lambda: len(getattr(worker, "children", ()) or ()),
                  "cloud": lambda: c.cfg["topology.edges"]}
        expected.add_metric([tier], float(counts.get(tier, lambda: c.num_clients)()))
        yield expected

        refused = CounterMetricFamily("fedcore_refused", "calls, streams, messages and updates "
                                      "refused, by stage and kind", labels=["tier", "stage", "reason"])
        for reason, n in _copy(getattr(c.comm, "down", c.comm).refusals()).items():
            refused.add_metric([tier, "connection", reason], float(n))
        for reason, n in _copy(monitor.extra_summary.get("admission", {})).items():
            refused.add_metric([tier, "admission", reason], float(n))
        yield refused

        traffic = CounterMetricFamily("fedcore_bytes", "payload bytes as serialized for the wire, by "
                                      "direction: up (to this tier's server worker), down (from it), "
                                      "eval (evaluation requests and replies)",
                                      labels=["tier", "direction"])
        for direction, n in (("up", monitor.total_up), ("down", monitor.total_down),
                             ("eval", monitor.total_other)):
            traffic.add_metric([tier, direction], float(n))
        yield traffic

        yield from self._record_gauges(rounds, tier)
        norm = model_norm(getattr(getattr(worker, "aggregator", None), "global_state", None)
                          or getattr(worker, "global_state", None))
        if norm is not None:
            g = GaugeMetricFamily("fedcore_model_norm", "L2 norm of the current global model",
                                  labels=["tier"])
            g.add_metric([tier], norm)
            yield g
        yield from self._snapshot(tier)

    @staticmethod
    def _durations(rounds: list[dict]) -> HistogramMetricFamily:
        """Wall seconds between consecutive round records (the first from the course's start)."""
        times = [float(r.get("wall_time", 0.0)) for r in rounds]
        spans = [b - a for a, b in zip([0.0] + times, times)]
        buckets, total = [], sum(spans)
        for bound in ROUND_BUCKETS:
            buckets.append((repr(bound), float(sum(1 for s in spans if s <= bound))))
        buckets.append(("+Inf", float(len(spans))))
        h = HistogramMetricFamily("fedcore_round_duration_seconds", "wall seconds each round took")
        h.add_metric([], buckets, total)
        return h

    @staticmethod
    def _record_gauges(rounds: list[dict], tier: str) -> Iterator:
        """The latest value of each test metric, DP epsilon and update norm the records hold."""
        latest: dict[str, tuple[float, int]] = {}
        for r in reversed(rounds[-RECENT:]):   # newest first: the first value seen is the latest
            for name, value in r.items():
                v = _number(value)
                if v is not None and name not in latest and RECORD_FIELDS.match(name):
                    latest[name] = (v, r["round"])
        g = GaugeMetricFamily("fedcore_record_value", "the latest value of a round record's field "
                              "(test metrics, dp_epsilon, update norms)", labels=["tier", "field"])
        at = GaugeMetricFamily("fedcore_record_round", "the round whose record gave that value",
                               labels=["tier", "field"])
        for name, (v, round_) in sorted(latest.items()):
            g.add_metric([tier, name], v)
            at.add_metric([tier, name], float(round_))
        yield g
        yield at
        if "dp_epsilon" in latest:
            eps = GaugeMetricFamily("fedcore_dp_epsilon", "client-level epsilon spent so far "
                                    "(privacy.dp)", labels=["tier"])
            eps.add_metric([tier], latest["dp_epsilon"][0])
            yield eps

    def _snapshot(self, tier: str) -> Iterator:
        checkpointer = getattr(self.course, "checkpointer", None)
        path = getattr(checkpointer, "last_path", None)
        if path is None:
            return
        try:
            age = max(0.0, time.time() - os.stat(path).st_mtime)
        except OSError:
            return
        g = GaugeMetricFamily("fedcore_snapshot_age_seconds", "seconds since the latest snapshot "
                              "was written", labels=["tier"])
        g.add_metric([tier], age)
        yield g
        r = GaugeMetricFamily("fedcore_snapshot_round", "the round the latest snapshot holds",
                              labels=["tier"])
        r.add_metric([tier], float(checkpointer.last_round))
        yield r


def course_registry(course, tier: str) -> CollectorRegistry:
    """A private registry (never the process's global one) holding this course's collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CourseCollector(course, tier))
    return registry
