"""Condition-driven rounds: asynchronous strategies, and synchronous rounds that need not wait
for every sampled client (over-selection, a round deadline).

The server aggregates when a condition event fires:

- `all_received`  every client sampled for the round replied (synchronous);
- `goal_achieved` `asyn.min_received_num` (or `fraction`) tolerable updates are in;
- `time_up`       `asyn.time_budget` seconds passed since the round began (a timer).
  With too few updates (`min_received_num`, default 1) the budget is extended
  and more clients are sampled: the remedial measure, logged and counted.

Between aggregations the server keeps `in_flight` (client -> the round and time
of the model it was sent). Broadcast manners: `after_aggregating` tops the
clients in flight back up to the concurrency after each aggregation;
`after_receiving` does it as soon as any update arrives (a constant
concurrency, as in FedBuff). Synchronous strategies sample a fresh batch each
round instead, and drop every stale update.

Staleness tau = current round - round of the model the client started from.
Updates with tau > `asyn.staleness_toleration` are dropped and counted; the
others reach the aggregator with their tau (its `discount` down-weights them).

Dropped-out clients never reply. A client silent for `asyn.reply_timeout`
seconds after it was sent a model is presumed lost: it goes back to the idle
pool and a replacement is sampled, so courses with dropouts still finish.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from fedcore.kernel.contract import ReceivedUpdate
from fedcore.algorithms.staleness import discount_function
from fedcore.kernel.config import declare, fraction, non_negative, positive, resolver, validator
from fedcore.kernel.errors import ConfigError
from fedcore.handlers import evaluation, join, rounds, training
from fedcore.kernel.registry import courses
from fedcore.kernel.schema import clients_per_round
from fedcore.wire.serialization import encoded_size
from fedcore.runtime.timing import expected_work

__all__ = ["Strategy", "resolve_strategy", "install", "ASYNC_KEYS"]


declare("asyn.use", bool, False, "asynchronous training: aggregate on goal_achieved or time_up "
        "without waiting for every sampled client; stale updates are tolerated (selects course async)")
declare("asyn.aggregator", str, "goal_achieved", "the condition that triggers aggregation: "
        "goal_achieved (enough updates) or time_up (asyn.time_budget passed)",
        choices=("goal_achieved", "time_up"))
declare("asyn.min_received_num", int, None, "goal_achieved: updates that trigger an aggregation "
        "(default: the clients per round); time_up: the fewest updates worth aggregating (default 1)",
        check=positive)
declare("asyn.min_received_rate", float, None, "the same goal as a fraction of the clients per round",
        check=fraction)
declare("asyn.time_budget", float, 0.0, "seconds of (virtual or wall) time per round for time_up; "
        "in a synchronous course a budget > 0 is a round deadline (time_up)", check=non_negative)
declare("asyn.staleness_toleration", int, 10, "asynchronous: updates staler than this many rounds "
        "are dropped (synchronous strategies drop every stale update)", check=non_negative)
declare("asyn.broadcast_manner", str, "after_aggregating", "when the server sends the current "
        "model to newly sampled clients: after_aggregating or after_receiving (asynchronous only)",
        choices=("after_aggregating", "after_receiving"))
declare("asyn.overselection", bool, False, "over-selection: sample (1 + asyn.overselection_rate) x "
        "the clients per round, aggregate the first ones to reply, drop the rest")
declare("asyn.overselection_rate", float, 0.3, "over-selection: the extra fraction of clients sampled",
        check=positive)
declare("asyn.reply_timeout", float, None, "seconds after which a client that was sent a model and "
        "stayed silent is presumed lost and replaced; default: twice the slowest device's modelled "
        "round time when devices can drop out, else off; 0: off", check=non_negative)

ASYNC_KEYS = ("asyn.use", "asyn.aggregator", "asyn.min_received_num", "asyn.min_received_rate",
              "asyn.time_budget", "asyn.staleness_toleration", "asyn.broadcast_manner",
              "asyn.overselection", "asyn.overselection_rate", "asyn.reply_timeout")


def _needs_engine(cfg) -> bool:
    return (cfg["asyn.use"] or cfg["asyn.overselection"] or cfg["asyn.time_budget"] > 0
            or cfg["asyn.aggregator"] == "time_up")


@resolver
def _choose_course(values: dict) -> None:
    """asyn.* strategies run on the `async` course; config.yaml names the course that runs."""
    if values["course"] == "sync" and _needs_engine(values):
        values["course"] = "async"


@validator
def _check_asyn(cfg) -> None:
    """Cross-key checks of the asyn.* strategies."""
    if cfg["asyn.min_received_num"] is not None and cfg["asyn.min_received_rate"] is not None:
        raise ConfigError("asyn.min_received_num and asyn.min_received_rate are both set; keep one")
    if cfg["asyn.aggregator"] == "time_up" and cfg["asyn.time_budget"] <= 0:
        raise ConfigError("asyn.time_budget: time_up needs a budget > 0 (seconds per round)")
    if cfg["asyn.broadcast_manner"] == "after_receiving" and not cfg["asyn.use"]:
        raise ConfigError("asyn.broadcast_manner: after_receiving is asynchronous; set asyn.use=true "
                          "or use after_aggregating")
    if cfg["course"] == "async":
        resolve_strategy(cfg)  # its own checks, before anything is built


@dataclass(frozen=True)
class Strategy:
    """What the server does, resolved once from the config."""

    asynchronous: bool
    trigger: str          # all_received | goal_achieved | time_up
    concurrency: int      # sync: clients sampled per round; async: clients kept in flight
    goal: int             # goal_achieved: updates to aggregate; time_up: the fewest worth it
    budget: float         # time_up: seconds per round
    toleration: int       # tolerated staleness (0 for synchronous strategies)
    manner: str           # after_aggregating | after_receiving

    @property
    def name(self) -> str:
        if not self.asynchronous:
            kind = "over-selection" if self.trigger == "goal_achieved" else self.trigger
            return f"sync {kind}"
        return f"async {self.trigger} {self.manner}"


def resolve_strategy(cfg) -> Strategy:
    """The strategy the `asyn.*` keys describe (see the module docstring and docs/async.md)."""
    k = clients_per_round(cfg)
    n = cfg["federate.client_num"]
    conc = min(n, math.ceil(k * (1 + cfg["asyn.overselection_rate"]))) if cfg["asyn.overselection"] else k
    num, rate = cfg["asyn.min_received_num"], cfg["asyn.min_received_rate"]
    explicit = num if num is not None else (max(1, math.ceil(rate * k)) if rate is not None else None)
    use = cfg["asyn.use"]
    if use:
        trigger = cfg["asyn.aggregator"]
    elif cfg["asyn.aggregator"] == "time_up" or (cfg["asyn.time_budget"] > 0 and not cfg["asyn.overselection"]):
        trigger = "time_up"
    elif cfg["asyn.overselection"]:
        trigger = "goal_achieved"
    else:
        trigger = "all_received"
    if trigger == "time_up":
        goal = explicit if explicit is not None else 1
    elif trigger == "goal_achieved":
        goal = explicit if (explicit is not None and use) else k
    else:
        goal = conc
    if not use and goal > conc:
        raise ConfigError(f"asyn.min_received_num: {goal} exceeds the {conc} clients sampled per round")
    if use and trigger == "goal_achieved" and cfg["asyn.broadcast_manner"] == "after_aggregating" \
            and goal > conc:
        # after_aggregating keeps at most `conc` clients busy until the goal is met: it never is
        raise ConfigError(f"asyn.min_received_num: a goal of {goal} updates exceeds the {conc} "
                          "clients kept in flight; lower it, sample more clients or use "
                          "asyn.broadcast_manner=after_receiving")
    return Strategy(use, trigger, conc, goal, cfg["asyn.time_budget"],
                    cfg["asyn.staleness_toleration"] if use else 0,
                    cfg["asyn.broadcast_manner"] if use else "after_aggregating")


# ---------------------------------------------------------------- sampling and sending
def _dispatch(server, n: int) -> list[int]:
    """Send the current model to `n` clients sampled among the idle ones."""
    if n <= 0:
        return []
    idle = [c for c in server.course.client_ids if c not in server.in_flight]
    picked = server.sampler.sample(n, idle)
    if not picked:
        return []
    for c in picked:
        server.in_flight[c] = (server.round, server.now)
    server.selected = set(server.in_flight)
    server.send("models", picked, server.aggregator.broadcast(server.round))
    if server.reply_timeout > 0:
        server.set_timer(server.reply_timeout, "reply_timeout", None)
    return picked


def _top_up(server) -> None:
    st = server.strategy
    _dispatch(server, st.concurrency - len(server.in_flight))


def _new_batch(server) -> None:
    """Synchronous: the previous round is over for everyone; sample a fresh batch."""
    server.in_flight.clear()
    server.waiting = set(_dispatch(server, server.strategy.concurrency))


def _open_round(server) -> None:
    server.buffer = []
    server.round_start = server.now
    if server.strategy.trigger == "time_up":
        _arm_deadline(server)


def _arm_deadline(server) -> None:
    server.deadline_gen += 1
    server.set_timer(server.strategy.budget, "time_up", server.deadline_gen)


# ---------------------------------------------------------------- handlers
def begin(server, _event=None) -> None:
    """`all_joined_in`: the first clients get the first model."""
    if server.strategy.asynchronous:
        _top_up(server)
    else:
        _new_batch(server)
    _open_round(server)


def _ready(server) -> bool:
    st = server.strategy
    if st.trigger == "goal_achieved":
        return len(server.buffer) >= st.goal
    if st.trigger == "all_received":
        return bool(server.buffer) and not server.waiting
    return False


def collect(server, msg) -> None:
    """`receiving_updates`: check staleness, keep or drop, maybe aggregate, maybe send on."""
    if server.finished:
        return
    st = server.strategy
    entry = server.in_flight.get(msg.sender)
    if entry is not None and entry[0] == msg.round:
        del server.in_flight[msg.sender]
    tau = server.round - msg.round
    if tau > st.toleration:
        server.stats.dropped_stale += 1
        server.course.log.info("round %d: dropped an update from client %d (staleness %d > %d)",
                               server.round, msg.sender, tau, st.toleration)
    else:
        server.buffer.append(ReceivedUpdate(msg.sender, msg.content, msg.round, tau))
        server.waiting.discard(msg.sender)
        if _ready(server):
            server.trigger(st.trigger)
    if not server.finished and st.manner == "after_receiving":
        _top_up(server)


def aggregate_and_continue(server, _event=None) -> None:
    """`goal_achieved` / `all_received` (and `time_up` with enough updates): aggregate, then
    finish or start the next round."""
    st = server.strategy
    updates = server.buffer
    server.buffer = []
    taus = [u.staleness for u in updates]
    stats = server.stats
    for u in updates:
        stats.counts[u.client_id] += 1
        stats.histogram[u.staleness] += 1
    extra = {"staleness_min": min(taus), "staleness_mean": sum(taus) / len(taus),
             "staleness_max": max(taus), "dropped_stale": stats.dropped_stale - stats.mark_dropped,
             "remedial": stats.remedial - stats.mark_remedial,
             "presumed_lost": stats.presumed_lost - stats.mark_lost,
             "in_flight": len(server.in_flight)}
    stats.mark_dropped, stats.mark_remedial, stats.mark_lost = (
        stats.dropped_stale, stats.remedial, stats.presumed_lost)
    if not rounds.aggregate(server, updates, extra):
        return
    if not st.asynchronous:
        _new_batch(server)
    elif st.manner == "after_aggregating":
        _top_up(server)
    _open_round(server)


def on_time_up(server, generation) -> None:
    """`time_up`: aggregate what arrived, or (too few) extend the budget and sample more."""
    if server.finished or generation != server.deadline_gen:
        return  # a deadline of a round already aggregated
    st = server.strategy
    if len(server.buffer) >= st.goal:
        aggregate_and_continue(server)
        return
    more = max(1, st.goal - len(server.buffer))
    picked = _dispatch(server, more)
    server.stats.remedial += 1
    server.course.log.warning(
        "round %d: time_up after %.3gs with %d of %d updates; budget extended by %.3gs and %d more "
        "client(s) sampled", server.round, server.now - server.round_start, len(server.buffer),
        st.goal, st.budget, len(picked))
    _arm_deadline(server)


def on_reply_timeout(server, _event=None) -> None:
    """`reply_timeout`: clients silent since a full timeout are presumed lost and replaced."""
    if server.finished:
        return
    cutoff = server.now - server.reply_timeout * (1 - 1e-9)
    lost = [c for c, (_, t) in server.in_flight.items() if t <= cutoff]
    if lost:
        release(server, lost, f"silent for {server.reply_timeout:.3g}s")


def release(server, lost: list[int], why: str) -> None:
    """Clients in flight that will not reply (silent too long, or gone from a deployment) go
    back to the idle pool and are replaced, so the round can still reach its condition."""
    lost = [c for c in lost if c in server.in_flight]
    if not lost:
        return
    st = server.strategy
    for c in lost:
        del server.in_flight[c]
    server.stats.presumed_lost += len(lost)
    server.course.log.info("round %d: %d client(s) %s presumed lost", server.round, len(lost), why)
    if st.asynchronous:
        _top_up(server)
    elif st.trigger == "all_received":
        # replace each lost client this round was waiting for
        replaced = server.waiting & set(lost)
        server.waiting -= replaced
        server.waiting |= set(_dispatch(server, len(replaced)))
    else:
        # over-selection / deadline: sample enough to make the goal reachable again
        hoping = sum(1 for r, _ in server.in_flight.values() if r == server.round)
        _dispatch(server, st.goal - len(server.buffer) - hoping)


def restart_idle(server) -> None:
    """No client in flight (all were lost) and some connected again: send them the model."""
    if server.finished or server.in_flight:
        return
    if server.strategy.asynchronous:
        _top_up(server)
    else:
        server.waiting = set(_dispatch(server, server.strategy.concurrency))


def finish(server, event) -> None:
    """`max_rounds_reached` / `early_stop`: finish, and write the strategy's summary."""
    rounds.finish_course(server, event)
    server.course.monitor.add_summary("async", server.stats.summary(server))


# ---------------------------------------------------------------- bookkeeping
class _Stats:
    """Counters for the records and the summary."""

    def __init__(self, client_ids):
        self.counts = Counter({c: 0 for c in client_ids})
        self.histogram: Counter = Counter()
        self.dropped_stale = self.remedial = self.presumed_lost = 0
        self.mark_dropped = self.mark_remedial = self.mark_lost = 0

    def summary(self, server) -> dict:
        counts = {str(c): self.counts[c] for c in sorted(self.counts)}
        return {
            "strategy": server.strategy.name,
            "staleness_histogram": {str(t): self.histogram[t] for t in sorted(self.histogram)},
            "effective_aggregation_counts": counts,
            "clients_never_aggregated": sum(1 for v in counts.values() if v == 0),
            "dropped_stale": self.dropped_stale,
            "remedial_extensions": self.remedial,
            "presumed_lost": self.presumed_lost,
            "lost_replies": getattr(getattr(server.course, "timing", None), "lost_replies", 0),
            "reply_timeout": server.reply_timeout,
        }


def _auto_reply_timeout(course) -> float:
    """Twice the slowest device's modelled round, when devices may drop out; else 0 (off)."""
    value = course.cfg["asyn.reply_timeout"]
    if value is not None:
        return value
    timing = getattr(course, "timing", None)
    if timing is None or not timing.has_dropouts:
        return 0.0
    nbytes = encoded_size(course.server.aggregator.broadcast(1))
    slowest = max(timing.round_trip_time(cid, expected_work(course, cid), nbytes)
                  for cid in course.client_ids)
    return 2.0 * slowest


@courses.register("async")
def install(course) -> None:
    """The condition-driven course selected by `asyn.*` (see the module docstring)."""
    join.install(course)
    training.install(course)
    evaluation.install(course)
    st = resolve_strategy(course.cfg)
    server = getattr(course, "server", None)
    if server is None:  # a deployed client's process: the server's state lives elsewhere
        _register(course, st)
        return
    server.strategy = st
    _say_if_overselection_is_clamped(course, st)
    server.in_flight, server.waiting, server.buffer = {}, set(), []
    server.round_start, server.deadline_gen = 0.0, 0
    server.stats = _Stats(course.client_ids)
    server.reply_timeout = _auto_reply_timeout(course)
    server.aggregator.discount = discount_function(course.cfg) if st.asynchronous else None
    _register(course, st)


def _say_if_overselection_is_clamped(course, st: Strategy) -> None:
    """Over-selection cannot sample more clients than the course has: say so where it is cut."""
    cfg = course.cfg
    if not cfg["asyn.overselection"]:
        return
    k, rate = clients_per_round(cfg), cfg["asyn.overselection_rate"]
    wanted = math.ceil(k * (1 + rate))
    if st.concurrency >= wanted:
        return
    if st.concurrency == st.goal:
        course.log.warning("asyn.overselection: the course has only %d clients, all of them needed "
                           "per round (goal %d): over-selection samples no extra client and every "
                           "round waits for all; lower federate.sample_client_num",
                           st.concurrency, st.goal)
    else:
        course.log.warning("asyn.overselection: rate %g asks %d clients per round, the course has "
                           "%d: sampling %d", rate, wanted, st.concurrency, st.concurrency)


def _register(course, st: Strategy) -> None:
    timers = ("time_up", "reply_timeout") if st.trigger == "time_up" else ("reply_timeout",)
    after = ("models",) + timers + ("eval_request", "max_rounds_reached", "early_stop")
    s = course.server_table
    s.register("all_joined_in", begin, sends=("models",) + timers)
    collect_sends = ["models", "reply_timeout"] if st.manner == "after_receiving" else []
    if st.trigger != "time_up":
        collect_sends.append(st.trigger)
        s.register(st.trigger, aggregate_and_continue, sends=after)
    s.register("receiving_updates", collect, sends=tuple(collect_sends))
    if st.trigger == "time_up":
        s.register("time_up", on_time_up, sends=after)
    s.register("reply_timeout", on_reply_timeout, sends=("models", "reply_timeout"))
    s.register("max_rounds_reached", finish, sends=("finish",))
    s.register("early_stop", finish, sends=("finish",))
