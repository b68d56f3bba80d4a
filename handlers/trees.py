"""The trees course (`task: trees`): the server asks, clients answer with sketches, histograms
or trees, the server aggregates (algorithms/trees.py) and asks again until the booster is done.

The flow is the synchronous course's (join, rounds of `models` and `updates`, `all_received`):
every client every round, except in `cyclic` mode, where one client a round is asked, in turn.
The booster is scored on the server's held-out rows whenever it gained trees; at the end it
is written as `final_model.json` in XGBoost's format (`xgboost.Booster(model_file=...)`).
Each round's record holds, per client, the bytes it sent and received in the round and in all
(`bytes_client_<c>`, `bytes_client_<c>_total`: the same count as `bytes_up`/`bytes_down`) and
when its reply arrived (`virtual_time_client_<c>`), as a vertical course reports its parties.

With `secure_aggregation.enabled` (histogram mode) round 1 (sketches, label sums) stays plain
and every later round runs secure aggregation's stages (handlers/secure_aggregation.py) on the
clients' fixed-point histograms (algorithms/trees_secure.py): the server unmasks only their sum.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from fedcore.handlers import analytics, evaluation, join, rounds, training
# secure aggregation's behaviour is installed before the one here that changes it; the two
# imported with it keep the behaviours' registration order (fedcore/handlers/__init__.py)
from fedcore.handlers import attack, performance_drop  # noqa: F401
from fedcore.handlers import secagg_client, secure_aggregation as secagg
from fedcore.handlers.secagg_blame import SecaggServer
from fedcore.kernel.contract import ReceivedUpdate
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.files import write_atomic
from fedcore.kernel.message import SERVER_ID
from fedcore.kernel.registry import behaviours, courses
from fedcore.kernel.server_state import transient, worker_state

log = logging.getLogger("fedcore.trees")

__all__ = ["ask", "collect", "add_up", "score", "install", "ClientTraffic", "mask_histograms", "sum_histograms",
           "install_secure"]


@worker_state("trees_traffic")
@dataclass
class ClientTraffic:
    """Per client: bytes to and from it since the last record and in all, and when its reply of
    the round arrived. Not saved: a record's counts start afresh with the process."""
    round: dict = transient(dict)
    total: dict = transient(dict)
    arrived: dict = transient(dict)

    def count(self, msg, receiver: int, nbytes: int) -> None:
        client = msg.sender if receiver == SERVER_ID else receiver
        self.round[client] = self.round.get(client, 0) + nbytes
        self.total[client] = self.total.get(client, 0) + nbytes

    def take(self, client_ids) -> dict[str, float]:
        out: dict[str, float] = {}
        for c in sorted(client_ids):
            out[f"bytes_client_{c}"] = self.round.get(c, 0)
            out[f"bytes_client_{c}_total"] = self.total.get(c, 0)
        out.update({f"virtual_time_client_{c}": t for c, t in sorted(self.arrived.items())})
        self.round, self.arrived = {}, {}
        return out


def _count_per_client(course) -> None:
    """Every message the server's communicator counts is also counted for its client (the
    communicator's byte callback, extended; in simulation and deployment alike)."""
    server, comm = getattr(course, "server", None), getattr(course, "comm", None)
    if server is None or comm is None or not hasattr(comm, "count_bytes"):
        return
    traffic, forward = server.state(ClientTraffic), comm.count_bytes

    def count(msg, receiver: int, nbytes: int) -> None:
        forward(msg, receiver, nbytes)
        traffic.count(msg, receiver, nbytes)
    comm.count_bytes = count


def ask(server, _event=None) -> None:
    """Send the round's request: to every client, or (cyclic, after round 1) to the next in turn."""
    ids = sorted(server.course.client_ids)
    if server.course.cfg["trees.mode"] == "cyclic" and server.round > 1:
        ids = [ids[(server.round - 2) % len(ids)]]
    server.selected = set(ids)
    server.buffer = []
    server.send("models", ids, server.aggregator.broadcast(server.round))


def add_up(server, _event=None) -> None:
    """`all_received`: aggregate, record the round (scored when trees were added); go on or finish."""
    updates, server.buffer = server.buffer, []
    record(server, {"num_updates": len(updates), **server.aggregator.aggregate(updates, server.round)})


def collect(server, msg) -> None:
    """`receiving_updates`: note when the client's reply came, then keep it (analytics' rule)."""
    if not server.finished and msg.round == server.round and msg.sender in server.selected:
        server.state(ClientTraffic).arrived[msg.sender] = server.now
    analytics.collect_sums(server, msg)


def record(server, fields: dict) -> None:
    """Score (when trees were added) and record the round; go on or write the booster and finish."""
    agg, course = server.aggregator, server.course
    fields.update(server.state(ClientTraffic).take(course.client_ids))
    if fields.get("trees_tree_done"):
        fields.update(score(agg.model_json(), course.data.server_test, course.cfg["trees.objective"]))
    course.monitor.record_round(server.round, server.now, fields)
    if not agg.finished and server.round < course.cfg["federate.total_round_num"]:
        server.round += 1
        (secagg.start_secure_round if course.cfg["secure_aggregation.enabled"] else ask)(server)
        return
    if course.outdir is not None:
        write_atomic(course.outdir / "final_model.json", agg.model_json())
    course.monitor.add_summary("trees", {"trees_mode": course.cfg["trees.mode"],
                                         "trees_count": int(fields["trees_count"]),
                                         "trees_base_score": agg.base_score})
    server.trigger("max_rounds_reached")


def score(model_json: bytes, test, objective: str) -> dict[str, float]:
    """Test metrics of the booster on the server's rows (none when it holds none)."""
    if test is None or not len(test.y):
        return {}
    import xgboost as xgb
    from fedcore.algorithms.trees import booster_of
    x = test.x.flatten(1).double().numpy()
    y = test.y.double().numpy()
    pred = booster_of(model_json).predict(xgb.DMatrix(x)).astype(np.float64)
    if objective == "reg:squarederror":
        mse = float(np.mean((pred - y) ** 2))
        return {"test_loss": mse, "test_rmse": mse ** 0.5}
    p = np.clip(pred, 1e-15, 1 - 1e-15)
    return {"test_loss": float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))),
            "test_acc": float(np.mean((pred > 0.5) == (y > 0.5)))}


def _check_data(course) -> None:
    """Refuse, in one line, data the trees cannot be grown from (where the data is at hand)."""
    cfg, data = course.cfg, course.data
    clients = getattr(data, "clients", None) or {}
    rows = sum(len(getattr(c, s).y) for c in clients.values() for s in ("train", "val", "test"))
    if clients and cfg["trees.max_bin"] > rows:
        raise ConfigError(f"trees.max_bin: {cfg['trees.max_bin']} bins for {rows} rows; set "
                          f"trees.max_bin to at most the number of rows")
    if cfg["trees.objective"] == "binary:logistic" and getattr(data, "num_classes", 2) != 2:
        raise ConfigError(f"trees.objective: binary:logistic needs 2 classes, data.type "
                          f"{cfg['data.type']} has {data.num_classes}; choose binary data or "
                          "trees.objective=reg:squarederror")


@courses.register("trees")
def install(course) -> None:
    _check_data(course)
    _count_per_client(course)
    join.install(course)
    training.install(course)
    s = course.server_table
    s.register("max_rounds_reached", rounds.finish_course, sends=("finish",))
    s.register("all_joined_in", ask, sends=("models",))
    s.register("receiving_updates", collect, sends=("all_received",))
    s.register("all_received", add_up, sends=("models", "max_rounds_reached"))


# ------------------------------------------------------------------ secure aggregation
def mask_histograms(client, msg) -> None:
    """Client `receiving_models`: round 1's sketch goes plain; a level's histograms enter secure
    aggregation as fixed-point codes (weight 1), where a training client enters its update."""
    from fedcore.algorithms import trees_secure as ts
    from fedcore.algorithms.trees import SKETCH
    from fedcore.algorithms.secagg_settings import Settings
    if int(msg.content["model"]["stage"][0]) == SKETCH:
        training.train_and_reply(client, msg)
        return
    client.round = msg.round
    result = client.course.trainer.fit(client.id, client.data, msg.content, msg.round)
    client.spend(result.work)
    cfg, s = client.course.cfg, Settings.of(client.course.cfg)
    codes = ts.encode(result.content["hist"].numpy(), cfg["trees.secure_frac_bits"], s.modulus, s.per_round)
    secagg_client.advertise(client, msg.round, np.append(codes, np.uint64(1)), 1)


def collect_sketch(server, msg) -> None:
    """`receiving_updates`: round 1's sketches; a plain update in a secure level is refused."""
    if server.state(SecaggServer).current is None and server.round == 1:
        collect(server, msg)
    else:
        secagg.refuse_plain_update(server, msg)


def sketches_or_stage(server, event=None) -> None:
    """`all_received`: round 1's sketches are in, or (deployed) a secure stage lost its last clients."""
    if server.state(SecaggServer).current is None:
        add_up(server, event)
    else:
        secagg.stage_complete(server, event)


def sum_histograms(server, _event=None) -> None:
    """`secagg_shares_revealed`: unmask the level's summed histograms and grow the tree. Every
    client must be in the sum (a tree level grown from some clients' rows is another tree):
    otherwise the course stops, as an analytics course does."""
    from fedcore.algorithms import trees_secure as ts
    from fedcore.algorithms.secagg_settings import Settings
    cfg = server.course.cfg
    everyone = sorted(server.course.client_ids)

    def check(sr, total) -> str | None:
        if sorted(sr.survivors) != everyone:
            return f"clients {sorted(sr.survivors)} of {everyone} are in the sum"
        if int(total[-1]) != len(everyone):
            return f"its total weight is {int(total[-1])}, not the {len(everyone)} clients"
        return None

    sr, total = secagg.whole_sum(server, "trees", "a tree level needs every client's histograms", check)
    hist = ts.decode(total[:-1], cfg["trees.secure_frac_bits"], Settings.of(cfg).modulus)
    update = ReceivedUpdate(0, {"hist": torch.from_numpy(hist)}, sr.round, 0)
    record(server, {"num_updates": len(sr.survivors), "secagg_survivors": len(sr.survivors), **sr.fields(),
                    **server.aggregator.aggregate([update], server.round)})


@behaviours.register("trees_secure_histograms")
def install_secure(course) -> None:
    """After secure aggregation's own handlers: round 1 plain, the levels' histograms secure."""
    c, s = course.client_table, course.server_table
    c.register("receiving_models", mask_histograms, sends=("updates", "secagg_public_keys"), replaces=True)
    s.register("all_joined_in", ask, sends=("models",), replaces=True)
    s.register("receiving_updates", collect_sketch, sends=("all_received",), replaces=True)
    s.register("all_received", sketches_or_stage, replaces=True,
               sends=("models", "secagg_stage_timeout", "max_rounds_reached") + tuple(e for _, _, e in secagg.STAGES))
    s.register("secagg_shares_revealed", sum_histograms, replaces=True,
               sends=("models", "secagg_stage_timeout", "max_rounds_reached"))
    # the stages' ways of ending a round as a training course does (a skipped round evaluates,
    # may stop early) stop a trees course in its aggregator; their events are handled too
    s.register("early_stop", rounds.finish_course, sends=("finish",))
    evaluation.install(course)


install_secure.enabled = lambda cfg: cfg["task"] == "trees" and cfg["secure_aggregation.enabled"]
