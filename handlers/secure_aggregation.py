"""Secure aggregation (SecAgg+, Bell et al. 2020; the full graph is Bonawitz et al. 2017):
the server learns the sum of the round's updates and nothing else about any one of them.

A behaviour switched on by `secure_aggregation.enabled`. It replaces the
synchronous round's exchange of plain updates with four stages, each a
message type answered by the clients and a condition event raised on the
server when the stage's replies are in (or the stage timed out, or a
deployment lost the missing clients):

1. `models` -> clients train, quantize their update, keep it, and advertise two
   X25519 public keys (`secagg_public_keys`) -> `secagg_keys_collected`;
2. `secagg_neighbour_keys` (each client's neighbours in a k-regular graph, or all
   others) -> clients Shamir-share their mask key and a fresh self-mask seed,
   each share AES-GCM-encrypted for its holder (`secagg_encrypted_shares`) ->
   `secagg_shares_collected`;
3. `secagg_routed_shares` -> clients send their input plus self mask plus
   pairwise masks, mod p (`secagg_masked_input`) -> `secagg_inputs_collected`;
4. `secagg_unmask_request` (who dropped, who survived) -> clients reveal, per
   neighbour, the seed share of a survivor or the key share of a dropout
   (`secagg_unmask_shares`) -> `secagg_shares_revealed`: the server removes the
   masks (algorithms/secure_sum.py) and aggregates the unmasked sum.

Fewer survivors than the threshold at any stage: the round is skipped (one
warning, the model unchanged, `secagg_skipped: 1` in its record) and the next
round starts. Client stages are in handlers/secagg_client.py.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedcore.algorithms.secagg_settings import Settings, neighbour_graph
from fedcore.handlers import rounds, secagg_checks, secagg_client, sync  # noqa: F401  (checks register)
from fedcore.message import SERVER_ID
from fedcore.registry import behaviours
from fedcore.scheduler import PRIORITY_TIMER

__all__ = ["install", "STAGES"]

log = logging.getLogger("fedcore.secagg")

# (stage, message type the server collects, condition event raised when the stage is complete)
STAGES = (("keys", "secagg_public_keys", "secagg_keys_collected"),
          ("shares", "secagg_encrypted_shares", "secagg_shares_collected"),
          ("inputs", "secagg_masked_input", "secagg_inputs_collected"),
          ("unmask", "secagg_unmask_shares", "secagg_shares_revealed"))
_EVENT = {stage: event for stage, _, event in STAGES}

# ---------------------------------------------------------------- the server's round
@dataclass
class ServerRound:
    serial: int
    round: int
    stage: str = "keys"
    threshold: int = 0
    keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)     # U1: (cipher pk, mask pk)
    graph: dict[int, list[int]] = field(default_factory=dict)
    shares: dict[int, dict[int, bytes]] = field(default_factory=dict)      # U2: sender -> holder -> ct
    masked: dict[int, np.ndarray] = field(default_factory=dict)            # U3
    dropped: list[int] = field(default_factory=list)
    revealed: dict[int, dict[int, bytes]] = field(default_factory=dict)    # responder -> v -> share
    messages: int = 0
    nbytes: int = 0

    def count(self, nbytes: int, messages: int = 1) -> None:
        self.messages += messages
        self.nbytes += nbytes

    def fields(self) -> dict[str, Any]:
        return {"secagg_messages": self.messages, "secagg_bytes": self.nbytes,
                "secagg_dropped": len(self.dropped)}


_serials = itertools.count(1)


def _settings(server) -> Settings:
    return Settings.of(server.course.cfg)


def _send(server, sr: ServerRound, msg_type: str, receiver: int, content: Any) -> None:
    msg = server.send(msg_type, receiver, content, round_=sr.round)
    sr.count(msg.nbytes)


def _next_stage(server, sr: ServerRound, stage: str, expected) -> None:
    sr.stage = stage
    server.selected, server.buffer = set(expected), []
    if server.secagg_timeout:
        _arm_timeout(server, sr, stage)


def _arm_timeout(server, sr: ServerRound, stage: str) -> None:
    """Raise `secagg_stage_timeout` after `secure_aggregation.stage_timeout` if the stage is
    still waiting then; a stage that completed in time leaves the server's clock alone."""
    def fire() -> None:
        if server.secagg is sr and sr.stage == stage and server.selected:
            server.now = server.course.scheduler.now
            server.trigger("secagg_stage_timeout", (sr.serial, stage))
    server.course.scheduler.schedule(server.now + server.secagg_timeout, PRIORITY_TIMER, fire)


def start_secure_round(server, _event=None) -> None:
    """`all_joined_in` (and after each round): sample and send the model, as a sync round does;
    the clients answer with keys, not updates."""
    sync.start_round(server)
    server.secagg = ServerRound(next(_serials), server.round)
    _next_stage(server, server.secagg, "keys", server.selected)


def _accept(server, msg, stage: str) -> ServerRound | None:
    sr = getattr(server, "secagg", None)
    if server.finished or sr is None or msg.round != sr.round or sr.stage != stage \
            or msg.sender not in server.selected:
        log.info("round %d: %s from client %d (round %d) ignored", server.round, msg.msg_type,
                 msg.sender, msg.round)
        return None
    sr.count(msg.nbytes_to(SERVER_ID))
    return sr


def _received(server, msg, stage: str) -> None:
    server.selected.discard(msg.sender)
    server.buffer.append(msg.sender)
    if not server.selected:
        server.trigger(_EVENT[stage])


def collect_keys(server, msg) -> None:
    sr = _accept(server, msg, "keys")
    if sr is not None:
        sr.keys[msg.sender] = (msg.content["cipher_key"], msg.content["mask_key"])
        _received(server, msg, "keys")


def collect_shares(server, msg) -> None:
    sr = _accept(server, msg, "shares")
    if sr is not None:
        mine = set(sr.graph.get(msg.sender, ()))
        sr.shares[msg.sender] = {v: ct for v, ct in zip(msg.content["to"], msg.content["ciphertexts"])
                                 if v in mine}
        _received(server, msg, "shares")


def collect_masked_input(server, msg) -> None:
    sr = _accept(server, msg, "inputs")
    if sr is not None:
        sr.masked[msg.sender] = msg.content["masked"].numpy().astype(np.uint64)
        _received(server, msg, "inputs")


def collect_unmask_shares(server, msg) -> None:
    sr = _accept(server, msg, "unmask")
    if sr is not None:
        sr.revealed[msg.sender] = dict(zip(msg.content["ids"], msg.content["shares"]))
        _received(server, msg, "unmask")


def refuse_plain_update(server, msg) -> None:
    """`receiving_updates`: this course takes no plain update; one that arrives is dropped unread."""
    log.warning("round %d: a plain update from client %d refused: this course aggregates securely",
                server.round, msg.sender)


def _enough(server, sr: ServerRound, ids: list[int], what: str) -> bool:
    if len(ids) >= max(sr.threshold, 2):
        return True
    _skip(server, sr, f"{len(ids)} client(s) {what}, {max(sr.threshold, 2)} needed")
    return False


def _skip(server, sr: ServerRound, why: str) -> None:
    """Too few survivors: skip the round (model unchanged), logged and recorded."""
    log.warning("secure aggregation: round %d skipped: %s (secure_aggregation.threshold)", sr.round, why)
    server.course.monitor.extra_summary.setdefault("secagg_skipped_rounds", []).append(sr.round)
    fields = {"num_updates": 0, "secagg_skipped": 1, "secagg_survivors": len(sr.masked), **sr.fields()}
    server.secagg, server.selected, server.buffer = None, set(), []
    if rounds.aggregate(server, [], fields):
        start_secure_round(server)


def advertise_keys(server, _event=None) -> None:
    """`secagg_keys_collected`: send each client its neighbours' public keys."""
    sr = server.secagg
    u1 = sorted(sr.keys)
    s = _settings(server)
    sr.graph = neighbour_graph(u1, s.neighbours, server.course.cfg["seed"], sr.round)
    sr.threshold = s.threshold(len(sr.graph[u1[0]])) if u1 else 2
    if not _enough(server, sr, u1, "advertised keys"):
        return
    if sr.threshold > len(sr.graph[u1[0]]):
        _skip(server, sr, f"{len(sr.graph[u1[0]])} neighbour(s) per client, threshold {sr.threshold}")
        return
    for u in u1:
        nb = sr.graph[u]
        _send(server, sr, "secagg_neighbour_keys", u, {
            "ids": nb, "cipher_keys": [sr.keys[v][0] for v in nb], "mask_keys": [sr.keys[v][1] for v in nb]})
    _next_stage(server, sr, "shares", u1)


def route_shares(server, _event=None) -> None:
    """`secagg_shares_collected`: deliver each encrypted share to its holder."""
    sr = server.secagg
    u2 = sorted(sr.shares)
    if not _enough(server, sr, u2, "shared their secrets"):
        return
    for v in u2:
        senders = [u for u in u2 if v in sr.shares[u]]
        _send(server, sr, "secagg_routed_shares", v,
              {"from": senders, "ciphertexts": [sr.shares[u][v] for u in senders]})
    _next_stage(server, sr, "inputs", u2)


def request_unmasking(server, _event=None) -> None:
    """`secagg_inputs_collected`: tell the survivors who dropped, and ask for the shares."""
    sr = server.secagg
    u3 = sorted(sr.masked)
    if not _enough(server, sr, u3, "sent masked inputs"):
        return
    sr.dropped = [v for v in sorted(sr.shares) if v not in sr.masked]
    if sr.dropped:
        log.warning("secure aggregation: round %d: client(s) %s dropped after sharing; their masks "
                    "are rebuilt from the survivors' shares", sr.round, sr.dropped)
    for u in u3:
        _send(server, sr, "secagg_unmask_request", u, {"dropped": sr.dropped, "survivors": u3})
    _next_stage(server, sr, "unmask", u3)


def unmask_and_aggregate(server, _event=None) -> None:
    """`secagg_shares_revealed`: rebuild the secrets, remove the masks, aggregate the sum."""
    from fedcore.algorithms.secure_sum import ShareShortage, mean_delta, unmask, unmasked_update
    from fedcore.shamir import share_from_bytes
    sr, s, cfg = server.secagg, _settings(server), server.course.cfg
    survivors = sorted(sr.masked)
    wanted = set(survivors) | set(sr.dropped)
    shares: dict[int, dict[int, int]] = {v: {} for v in wanted}
    receivers = {v: sorted(sr.shares[v]) for v in sr.dropped}
    try:
        for holder, revealed in sr.revealed.items():
            for v, share in revealed.items():
                if v in wanted and holder in sr.shares.get(v, {}):   # only a holder v gave a share to
                    shares[v][holder] = share_from_bytes(share)
        total = unmask(sr.masked, sr.dropped, receivers, {u: sr.keys[u][1] for u in survivors},
                       {v: shares[v] for v in survivors}, {v: shares[v] for v in sr.dropped},
                       sr.threshold, s.modulus)
    except (ShareShortage, ValueError) as exc:
        _skip(server, sr, f"cannot unmask: {exc}")
        return
    mean, weight = mean_delta(total, s.clip, s.bits)
    model = server.aggregator.broadcast(sr.round)["model"]
    names = s.names(model)
    if s.dp_clip is not None and cfg["privacy.dp.noise_multiplier"] > 0:   # central DP on the sum
        mean = (mean * weight + _central_noise(model, names, s.dp_clip, cfg, sr.round)) / weight
    update = unmasked_update(server.aggregator, mean, weight, names, survivors, sr.round)
    fields = {"num_updates": len(survivors), "secagg_survivors": len(survivors), **sr.fields()}
    server.secagg = None
    if rounds.aggregate(server, [update], fields):
        start_secure_round(server)


def _central_noise(model, names: list[str], clip: float, cfg, round_: int) -> np.ndarray:
    """N(0, (sigma C)^2) per coordinate, drawn as plain central DP draws it (in the model's
    entry order), laid out in the masked vector's order: both courses get the same noise."""
    from fedcore.algorithms.dp import gaussian_noise, noise_generator
    drawn = [n for n in model if model[n].is_floating_point()]
    noise = gaussian_noise(sum(model[n].numel() for n in drawn),
                           cfg["privacy.dp.noise_multiplier"] * clip, noise_generator(cfg["seed"], 0, round_))
    parts, pos = {}, 0
    for n in drawn:
        parts[n] = noise[pos:pos + model[n].numel()].numpy()
        pos += model[n].numel()
    return np.concatenate([parts[n] for n in names])


def stage_timeout(server, payload) -> None:
    """`secagg_stage_timeout`: go on without the clients still silent in this stage."""
    sr = getattr(server, "secagg", None)
    serial, stage = payload
    if sr is None or sr.serial != serial or sr.stage != stage or not server.selected:
        return
    log.warning("secure aggregation: round %d: no %s from client(s) %s within %gs; going on without them",
                sr.round, dict((s, m) for s, m, _ in STAGES)[stage], sorted(server.selected),
                server.secagg_timeout)
    server.selected.clear()
    server.trigger(_EVENT[stage])


def stage_complete(server, _event=None) -> None:
    """`all_received` (a deployment dropped the last clients it waited for): end the stage."""
    sr = getattr(server, "secagg", None)
    if sr is not None:
        server.trigger(_EVENT[sr.stage])


# ---------------------------------------------------------------- wiring
def _auto_timeout(course) -> float:
    value = course.cfg["secure_aggregation.stage_timeout"]
    timing = getattr(course, "timing", None)
    if value is not None or course.wall_clock or timing is None or not timing.has_dropouts:
        return value or 0.0
    from fedcore.serialization import encoded_size
    from fedcore.timing import expected_work
    nbytes = encoded_size(course.server.aggregator.broadcast(1))
    return 2.0 * max(timing.round_trip_time(c, expected_work(course, c), nbytes) for c in course.client_ids)


def _withhold_after_sharing(timing):
    """Simulated device dropouts in a secure course: a client that drops in a round vanishes
    after the share stage (its masks must then be recovered), the protocol's hard case."""
    def keep(msg, receiver: int) -> bool:
        if msg.msg_type in ("secagg_masked_input", "secagg_unmask_shares") and \
                timing.drops_out(msg.sender, msg.round):
            timing.lost_replies += 1
            return False
        return True
    return keep


@behaviours.register("secure_aggregation")
def install(course) -> None:
    c, s = course.client_table, course.server_table
    c.register("receiving_models", secagg_client.train_and_advertise, sends=("secagg_public_keys",))
    c.register("receiving_secagg_neighbour_keys", secagg_client.share_keys,
               sends=("secagg_encrypted_shares",))
    c.register("receiving_secagg_routed_shares", secagg_client.mask_input, sends=("secagg_masked_input",))
    c.register("receiving_secagg_unmask_request", secagg_client.reveal_shares,
               sends=("secagg_unmask_shares",))
    # every stage arms the stage timer; a skipped or finished round goes on as a plain round does
    next_round = ("models", "secagg_stage_timeout", "eval_request", "max_rounds_reached", "early_stop")
    s.register("all_joined_in", start_secure_round, sends=("models", "secagg_stage_timeout"))
    s.register("receiving_updates", refuse_plain_update)
    s.register("receiving_secagg_public_keys", collect_keys, sends=("secagg_keys_collected",))
    s.register("secagg_keys_collected", advertise_keys,
               sends=("secagg_neighbour_keys",) + next_round)
    s.register("receiving_secagg_encrypted_shares", collect_shares, sends=("secagg_shares_collected",))
    s.register("secagg_shares_collected", route_shares,
               sends=("secagg_routed_shares",) + next_round)
    s.register("receiving_secagg_masked_input", collect_masked_input, sends=("secagg_inputs_collected",))
    s.register("secagg_inputs_collected", request_unmasking,
               sends=("secagg_unmask_request",) + next_round)
    s.register("receiving_secagg_unmask_shares", collect_unmask_shares, sends=("secagg_shares_revealed",))
    s.register("secagg_shares_revealed", unmask_and_aggregate, sends=next_round)
    events = tuple(e for _, _, e in STAGES)
    s.register("secagg_stage_timeout", stage_timeout, sends=events)
    s.register("all_received", stage_complete, sends=events)
    server = getattr(course, "server", None)
    if server is not None:
        server.secagg = None
        server.secagg_timeout = _auto_timeout(course)
        if not course.wall_clock and course.timing.has_dropouts:
            course.comm.filters.append(_withhold_after_sharing(course.timing))


install.enabled = lambda cfg: cfg["secure_aggregation.enabled"]


