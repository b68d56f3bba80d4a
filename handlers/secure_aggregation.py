"""Secure aggregation (SecAgg+, Bell et al. 2020; the full graph is Bonawitz et al. 2017, with
its consistency check against an active server): the server learns the sum of the round's
updates and nothing else about any one of them.

A behaviour switched on by `secure_aggregation.enabled`. It replaces the
synchronous round's exchange of plain updates with five stages, each a
message type answered by the clients and a condition event raised on the
server when the stage's replies are in (or the stage timed out, or a
deployment lost the missing clients, or they refused the round):

1. `models` -> clients train, quantize their update, keep it, and advertise two
   X25519 public keys and their weight, signed (`secagg_public_keys`) -> `secagg_keys_collected`;
2. `secagg_neighbour_keys` (each client's neighbours in a k-regular graph, or all
   others, with their signed keys) -> clients Shamir-share their mask key and a fresh
   self-mask seed with Feldman commitments, each share AES-GCM-encrypted for its holder
   and signed (`secagg_encrypted_shares`) -> `secagg_shares_collected`;
3. `secagg_routed_shares` -> clients check their shares, then send their input plus self
   mask plus pairwise masks, mod p, naming dealers of bad shares (`secagg_masked_input`)
   -> `secagg_inputs_collected`;
4. `secagg_consistency_check` (the survivor set) -> clients sign it
   (`secagg_survivor_signature`) -> `secagg_signatures_collected`;
5. `secagg_unmask_request` (the set, its signatures, who dropped) -> clients that see a
   quorum of signatures on the set they signed reveal, per neighbour, the seed share of a
   survivor or the key share (and pairwise key) of a dropout (`secagg_unmask_shares`)
   -> `secagg_shares_revealed`: the server removes the masks (algorithms/secure_sum.py),
   checks the sum is in range and aggregates it.

A deployed server times each stage on its own (handlers/deployment.py, `time_stages`): a
client silent past its stage's derived deadline is dropped from the round, which completes
with the others as if it had died; silent after the keys stage, it is sampled again in the
next round. A client that cheats is excluded by name (handlers/secagg_blame.py); one that
sees a lying server refuses the round (`secagg_abort`). Fewer survivors than needed at any
stage: the round is skipped (one warning, the model unchanged, `secagg_skipped: 1` in its
record) and the next round starts. Client stages are in handlers/secagg_client.py.
"""
from __future__ import annotations

import itertools
import logging
from typing import Any

import numpy as np

from fedcore.algorithms.secagg_settings import Settings, neighbour_graph
from fedcore.handlers import rounds, secagg_checks, secagg_client, sync
from fedcore.handlers.secagg_blame import (SecaggServer, ServerRound, checked_shares, exclude, keys_problem,
                                           settle_survivors, shares_problem, survivor_keys)
from fedcore.kernel.errors import NothingAggregated
from fedcore.kernel.message import SERVER_ID
from fedcore.kernel.registry import behaviours
from fedcore.kernel.scheduler import PRIORITY_TIMER
from fedcore.kernel.server_state import Outcome

__all__ = ["install", "STAGES", "start_secure_round", "unmasked_total"]

log = logging.getLogger("fedcore.secagg")

# (stage, message type the server collects, condition event raised when the stage is complete)
STAGES = (("keys", "secagg_public_keys", "secagg_keys_collected"),
          ("shares", "secagg_encrypted_shares", "secagg_shares_collected"),
          ("inputs", "secagg_masked_input", "secagg_inputs_collected"),
          ("signatures", "secagg_survivor_signature", "secagg_signatures_collected"),
          ("unmask", "secagg_unmask_shares", "secagg_shares_revealed"))
_EVENT = {stage: event for stage, _, event in STAGES}
# the message type that asks the clients for each stage's reply
REQUESTS = {"keys": "models", "shares": "secagg_neighbour_keys", "inputs": "secagg_routed_shares",
            "signatures": "secagg_consistency_check", "unmask": "secagg_unmask_request"}


_serials = itertools.count(1)


def _settings(server) -> Settings:
    return Settings.of(server.course.cfg)


def _send(server, sr: ServerRound, msg_type: str, receiver: int, content: Any) -> None:
    msg = server.send(msg_type, receiver, content, round_=sr.round)
    sr.count(msg.nbytes)


def _next_stage(server, sr: ServerRound, stage: str, expected) -> None:
    sr.stage = stage
    server.selected, server.buffer = set(expected), []
    if server.state(SecaggServer).timeout:
        _arm_timeout(server, sr, stage)


def _arm_timeout(server, sr: ServerRound, stage: str) -> None:
    """Raise `secagg_stage_timeout` after `secure_aggregation.stage_timeout` if the stage is
    still waiting then; a stage that completed in time leaves the server's clock alone."""
    def fire() -> None:
        if server.state(SecaggServer).current is sr and sr.stage == stage and server.selected:
            server.now = server.course.scheduler.now
            server.trigger("secagg_stage_timeout", (sr.serial, stage))
    server.course.scheduler.schedule(server.now + server.state(SecaggServer).timeout, PRIORITY_TIMER, fire)


def start_secure_round(server, _event=None) -> None:
    """`all_joined_in` (and after each round): sample and send the model, as a sync round does;
    the clients answer with keys, not updates."""
    sync.start_round(server)
    sr = server.state(SecaggServer).current = ServerRound(next(_serials), server.round)
    _next_stage(server, sr, "keys", server.selected)


def _accept(server, msg, stage: str) -> ServerRound | None:
    sr = server.state(SecaggServer).current
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
    """Keys, declared weight and signature; a client whose declaration fails the checks
    (secagg_blame.keys_problem) is excluded before anyone uses its keys."""
    sr = _accept(server, msg, "keys")
    if sr is None:
        return
    c, u = msg.content, msg.sender
    problem = keys_problem(server, msg)
    if problem is not None:
        exclude(server, sr, u, problem)
    else:
        sr.keys[u] = (c["cipher_key"], c["mask_key"])
        sr.weights[u], sr.key_signatures[u] = c["weight"], c["signature"]
    server.state(SecaggServer).seen_keys.update((c["cipher_key"], c["mask_key"]))
    _received(server, msg, "keys")


def collect_shares(server, msg) -> None:
    """Signed shares with their commitments; a dealer whose signature or commitments fail is
    excluded (its holders would refuse the round)."""
    sr = _accept(server, msg, "shares")
    if sr is None:
        return
    c, u = msg.content, msg.sender
    mine = set(sr.graph.get(u, ()))
    bundle = {v: (ct, sig) for v, ct, sig in zip(c["to"], c["ciphertexts"], c["signatures"]) if v in mine}
    problem = shares_problem(server, sr, msg, bundle)
    if problem is not None:
        exclude(server, sr, u, problem)
    else:
        sr.shares[u], sr.commitments[u] = bundle, c["commitments"]
    _received(server, msg, "shares")


def collect_masked_input(server, msg) -> None:
    """A masked input identical to one seen before is a replay: its sender leaves the sum."""
    import hashlib
    sr = _accept(server, msg, "inputs")
    if sr is None:
        return
    y = msg.content["masked"].numpy().astype(np.uint64)
    digest = hashlib.sha256(y.tobytes()).digest()
    if digest in server.state(SecaggServer).seen_inputs:
        exclude(server, sr, msg.sender, "it replayed a masked input already sent")
    else:
        server.state(SecaggServer).seen_inputs.add(digest)
        sr.masked[msg.sender] = y
        sr.bad_shares[msg.sender] = [v for v in msg.content["bad_shares"] if msg.sender in sr.shares.get(v, {})]
        if sr.bad_shares[msg.sender]:
            log.warning("secure aggregation: round %d: client %d reports a bad share from client(s) %s",
                        sr.round, msg.sender, sr.bad_shares[msg.sender])
    _received(server, msg, "inputs")


def collect_signature(server, msg) -> None:
    from fedcore.algorithms.secagg_identity import course_identity, key_digest, survivors_statement, verify
    sr = _accept(server, msg, "signatures")
    if sr is None:
        return
    statement = survivors_statement(sr.round, sr.survivors, key_digest(survivor_keys(sr)))
    if verify(course_identity(server.course).roster, msg.sender, statement, msg.content["signature"]):
        sr.signatures[msg.sender] = msg.content["signature"]
    else:
        log.warning("secure aggregation: round %d: client %d's signature on the survivor set is not valid",
                    sr.round, msg.sender)
    _received(server, msg, "signatures")


def collect_unmask_shares(server, msg) -> None:
    sr = _accept(server, msg, "unmask")
    if sr is not None:
        c = msg.content
        for kind, ids, values in (("seed", c["seed_ids"], c["seed_shares"]), ("key", c["key_ids"], c["key_shares"]),
                                  ("pair", c["pair_ids"], c["pair_keys"])):
            for v, value in zip(ids, values):
                sr.revealed[kind].setdefault(v, {})[msg.sender] = value
        _received(server, msg, "unmask")


def client_refused(server, msg) -> None:
    """`receiving_secagg_abort`: a client refused the round (it saw something only a lying or
    broken server would send); it is waited for no longer, and the round counts as aborted if
    it does not complete."""
    sr = server.state(SecaggServer).current
    if sr is None or msg.round != sr.round:
        return
    sr.refusals[msg.sender] = str(msg.content.get("reason", ""))
    log.warning("secure aggregation: round %d: client %d refused the round: %s", sr.round, msg.sender,
                sr.refusals[msg.sender])
    if msg.sender in server.selected:
        _received(server, msg, sr.stage)


def refuse_plain_update(server, msg) -> None:
    """`receiving_updates`: this course takes no plain update; one that arrives is dropped unread."""
    log.warning("round %d: a plain update from client %d refused: this course aggregates securely",
                server.round, msg.sender)


def _enough(server, sr: ServerRound, ids: list[int], what: str, needed: int | None = None) -> bool:
    needed = needed or max(sr.threshold, 2)
    if len(ids) >= needed:
        return True
    _skip(server, sr, f"{len(ids)} client(s) {what}, {needed} needed")
    return False


def _skip(server, sr: ServerRound, why: str, kind: str = "skipped") -> None:
    """The round cannot be aggregated: skip it (model unchanged), logged and recorded. A round
    that a client refused counts as aborted, one whose sum was out of range as such."""
    if kind == "skipped" and sr.refusals:
        kind = "aborted"
    log.warning("secure aggregation: round %d %s: %s", sr.round, kind, why)
    server.course.monitor.append_summary("secure_aggregation", f"secagg_{kind}_rounds", sr.round)
    fields = {"num_updates": 0, "secagg_skipped": 1, f"secagg_{kind}": 1, "secagg_survivors": len(sr.masked),
              **sr.fields()}
    server.state(SecaggServer).current, server.selected, server.buffer = None, set(), []
    if rounds.aggregate(server, [], fields):
        start_secure_round(server)
    elif not server.state(SecaggServer).aggregated:
        server.state(Outcome).unaggregated = (f"secure aggregation: no round of the course could be aggregated "
                               f"(last: round {sr.round} {kind}: {why})")


def advertise_keys(server, _event=None) -> None:
    """`secagg_keys_collected`: send each client its neighbours' signed public keys."""
    sr = server.state(SecaggServer).current
    u1 = sorted(sr.keys)
    s = _settings(server)
    sr.graph = neighbour_graph(u1, s.neighbours, server.course.cfg["seed"], sr.round)
    sr.threshold = s.threshold(len(sr.graph[u1[0]])) if u1 else 2
    if not _enough(server, sr, u1, "advertised valid keys"):
        return
    if sr.threshold > len(sr.graph[u1[0]]):
        _skip(server, sr, f"{len(sr.graph[u1[0]])} neighbour(s) per client, threshold {sr.threshold}")
        return
    for u in u1:
        nb = sr.graph[u]
        _send(server, sr, "secagg_neighbour_keys", u, {
            "ids": nb, "cipher_keys": [sr.keys[v][0] for v in nb], "mask_keys": [sr.keys[v][1] for v in nb],
            "weights": [sr.weights[v] for v in nb], "signatures": [sr.key_signatures[v] for v in nb]})
    _next_stage(server, sr, "shares", u1)


def route_shares(server, _event=None) -> None:
    """`secagg_shares_collected`: deliver each signed, encrypted share to its holder."""
    sr = server.state(SecaggServer).current
    u2 = sorted(sr.shares)
    if not _enough(server, sr, u2, "shared their secrets"):
        return
    for v in u2:
        senders = [u for u in u2 if v in sr.shares[u]]
        _send(server, sr, "secagg_routed_shares", v, {
            "from": senders, "ciphertexts": [sr.shares[u][v][0] for u in senders],
            "signatures": [sr.shares[u][v][1] for u in senders],
            "commitments": [sr.commitments[u] for u in senders]})
    _next_stage(server, sr, "inputs", u2)


def request_consistency(server, _event=None) -> None:
    """`secagg_inputs_collected`: settle the survivor set and ask each survivor to sign it."""
    sr = server.state(SecaggServer).current
    if not _enough(server, sr, sorted(sr.masked), "sent masked inputs"):
        return
    settle_survivors(server, sr)
    if not _enough(server, sr, sr.survivors, "remain with shares that passed their checks"):
        return
    keys = survivor_keys(sr)
    for u in sr.survivors:
        _send(server, sr, "secagg_consistency_check", u, {"survivors": sr.survivors, "keys": keys})
    _next_stage(server, sr, "signatures", sr.survivors)


def request_unmasking(server, _event=None) -> None:
    """`secagg_signatures_collected`: forward the signatures; tell each signer who dropped."""
    sr = server.state(SecaggServer).current
    signers = sorted(sr.signatures)
    if not _enough(server, sr, signers, "signed the survivor set", _settings(server).quorum(sr.threshold)):
        return
    if sr.dropped:
        log.warning("secure aggregation: round %d: client(s) %s dropped after sharing; their masks "
                    "are rebuilt from the survivors' shares", sr.round, sorted(sr.dropped))
    keys, sigs = survivor_keys(sr), [sr.signatures[u] for u in signers]
    for u in signers:
        mine = set(sr.graph[u])
        _send(server, sr, "secagg_unmask_request", u, {
            "survivors": sr.survivors, "keys": keys, "dropped": [v for v in sr.dropped if v in mine],
            "signers": signers, "signatures": sigs})
    _next_stage(server, sr, "unmask", signers)


def unmask_and_aggregate(server, _event=None) -> None:
    """`secagg_shares_revealed`: rebuild the secrets, remove the masks, check the sum is one
    honest inputs can reach, and aggregate it."""
    from fedcore.algorithms.secure_sum import ShareShortage, beyond_norm, mean_delta, out_of_range, unmasked_update
    sr, s, cfg = server.state(SecaggServer).current, _settings(server), server.course.cfg
    survivors = sr.survivors
    try:
        total = unmasked_total(server, sr)
    except (ShareShortage, ValueError) as exc:
        _skip(server, sr, f"cannot unmask: {exc}")
        return
    problem = out_of_range(total, sum(sr.weights[v] for v in survivors), s.bits)
    if problem is not None:
        _skip(server, sr, f"the unmasked sum is refused: {problem}", kind="out_of_range")
        return
    mean, weight = mean_delta(total, s.clip, s.bits)
    problem = beyond_norm(mean, s.dp_clip, s.clip, s.bits) if s.dp_clip is not None else None
    if problem is not None:   # central DP: every client clipped its delta's L2 norm
        _skip(server, sr, f"the unmasked sum is refused: {problem}", kind="out_of_range")
        return
    model = server.aggregator.broadcast(sr.round)["model"]
    names = s.names(model)
    if s.dp_clip is not None and cfg["privacy.dp.noise_multiplier"] > 0:   # central DP on the sum
        mean = (mean * weight + _central_noise(model, names, s.dp_clip, cfg, sr.round)) / weight
    update = unmasked_update(server.aggregator, mean, weight, names, survivors, sr.round)
    fields = {"num_updates": len(survivors), "secagg_survivors": len(survivors), **sr.fields()}
    state = server.state(SecaggServer)
    state.current = None
    state.aggregated += 1
    if rounds.aggregate(server, [update], fields):
        start_secure_round(server)


def whole_sum(server, course: str, why: str, check) -> tuple[ServerRound, np.ndarray]:
    """The round's unmasked sum for a course whose rounds cannot skip (a statistic of the union,
    a tree level): `check(sr, total)` names what is wrong with it, or None; a sum that cannot be
    unmasked or fails the check stops the course (NothingAggregated, saying `why`)."""
    from fedcore.algorithms.secure_sum import ShareShortage
    state = server.state(SecaggServer)
    sr = state.current
    try:
        total = unmasked_total(server, sr)
        problem = check(sr, total)
    except (ShareShortage, ValueError) as exc:
        problem = f"cannot unmask: {exc}"
    state.current = None
    if problem is not None:
        raise NothingAggregated(f"secure aggregation: round {sr.round} of the {course} course: {problem}; {why}")
    state.aggregated += 1
    return sr, total


def unmasked_total(server, sr: ServerRound) -> np.ndarray:
    """The survivors' sum mod p, every mask removed with the revealed shares (checked); its
    last entry is the survivors' total weight. Raises ShareShortage (or ValueError)."""
    from fedcore.algorithms.secure_sum import unmask
    survivors = sr.survivors
    return unmask({v: sr.masked[v] for v in survivors}, sr.dropped, {u: sr.keys[u][1] for u in sr.keys},
                  checked_shares(server, sr, "seed", survivors), checked_shares(server, sr, "key", sr.dropped),
                  {v: dict(sr.revealed["pair"].get(v, {})) for v in sr.dropped}, sr.threshold,
                  _settings(server).modulus)


def _central_noise(model, names: list[str], clip: float, cfg, round_: int) -> np.ndarray:
    """N(0, (sigma C)^2) per coordinate, drawn as plain central DP draws it (in the model's
    entry order), laid out in the masked vector's order: both courses get the same noise. In a
    deployment it comes from the OS (`privacy.dp.noise_source`), so no client can regenerate it."""
    from fedcore.algorithms.dp import gaussian_noise
    from fedcore.algorithms.dp_noise import noise_source
    drawn = [n for n in model if model[n].is_floating_point()]
    noise = gaussian_noise(sum(model[n].numel() for n in drawn),
                           cfg["privacy.dp.noise_multiplier"] * clip, noise_source(cfg, 0, round_))
    parts, pos = {}, 0
    for n in drawn:
        parts[n] = noise[pos:pos + model[n].numel()].numpy()
        pos += model[n].numel()
    return np.concatenate([parts[n] for n in names])


def stage_timeout(server, payload) -> None:
    """`secagg_stage_timeout`: go on without the clients still silent in this stage."""
    sr = server.state(SecaggServer).current
    serial, stage = payload
    if sr is None or sr.serial != serial or sr.stage != stage or not server.selected:
        return
    log.warning("secure aggregation: round %d: no %s from client(s) %s within %gs; going on without them",
                sr.round, dict((s, m) for s, m, _ in STAGES)[stage], sorted(server.selected),
                server.state(SecaggServer).timeout)
    server.selected.clear()
    server.trigger(_EVENT[stage])


def stage_complete(server, _event=None) -> None:
    """`all_received` (a deployment dropped the last clients it waited for): end the stage."""
    sr = server.state(SecaggServer).current
    if sr is not None:
        server.trigger(_EVENT[sr.stage])


# ---------------------------------------------------------------- wiring
def _auto_timeout(course) -> float:
    value = course.cfg["secure_aggregation.stage_timeout"]
    timing = getattr(course, "timing", None)
    if value is not None or course.wall_clock or timing is None or not timing.has_dropouts:
        return value or 0.0
    from fedcore.wire.serialization import encoded_size
    from fedcore.runtime.timing import expected_work
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
    c.register("receiving_models", secagg_client.train_and_advertise, sends=("secagg_public_keys",), replaces=True)
    c.register("receiving_secagg_neighbour_keys", secagg_client.share_keys,
               sends=("secagg_encrypted_shares", "secagg_abort"))
    c.register("receiving_secagg_routed_shares", secagg_client.mask_input,
               sends=("secagg_masked_input", "secagg_abort"))
    c.register("receiving_secagg_consistency_check", secagg_client.sign_survivors,
               sends=("secagg_survivor_signature", "secagg_abort"))
    c.register("receiving_secagg_unmask_request", secagg_client.reveal_shares,
               sends=("secagg_unmask_shares", "secagg_abort"))
    # every stage arms the stage timer; a skipped or finished round goes on as a plain round does
    next_round = ("models", "secagg_stage_timeout", "eval_request", "max_rounds_reached", "early_stop")
    s.register("all_joined_in", start_secure_round, sends=("models", "secagg_stage_timeout"), replaces=True)
    s.register("receiving_updates", refuse_plain_update, replaces=True,
               reached_by="a client that sends a plain update in a secure course")
    s.register("receiving_secagg_public_keys", collect_keys, sends=("secagg_keys_collected",))
    s.register("secagg_keys_collected", advertise_keys,
               sends=("secagg_neighbour_keys",) + next_round)
    s.register("receiving_secagg_encrypted_shares", collect_shares, sends=("secagg_shares_collected",))
    s.register("secagg_shares_collected", route_shares,
               sends=("secagg_routed_shares",) + next_round)
    s.register("receiving_secagg_masked_input", collect_masked_input, sends=("secagg_inputs_collected",))
    s.register("secagg_inputs_collected", request_consistency,
               sends=("secagg_consistency_check",) + next_round)
    s.register("receiving_secagg_survivor_signature", collect_signature,
               sends=("secagg_signatures_collected",))
    s.register("secagg_signatures_collected", request_unmasking,
               sends=("secagg_unmask_request",) + next_round)
    s.register("receiving_secagg_abort", client_refused, sends=tuple(e for _, _, e in STAGES))
    s.register("receiving_secagg_unmask_shares", collect_unmask_shares, sends=("secagg_shares_revealed",))
    s.register("secagg_shares_revealed", unmask_and_aggregate, sends=next_round)
    events = tuple(e for _, _, e in STAGES)
    s.register("secagg_stage_timeout", stage_timeout, sends=events)
    s.register("all_received", stage_complete, sends=events, replaces=True,
               reached_by="a deployed server that drops the last clients a stage waits for")
    from fedcore.algorithms.secagg_identity import course_identity
    try:
        course_identity(course)   # a missing or wrong key file stops a deployed process at once
    except ValueError as exc:
        from fedcore.kernel.errors import ConfigError
        raise ConfigError(str(exc)) from None
    server = getattr(course, "server", None)
    if server is not None:
        server.state(SecaggServer).timeout = _auto_timeout(course)
        if course.wall_clock:   # a deployed server: each stage has its own derived deadline
            from fedcore.handlers.deployment import time_stages
            model = server.aggregator.global_state   # a masked input: an int64 per entry, and the weight
            longest = getattr(server.aggregator, "longest_masked", None)   # its clients mask another vector
            length = longest() if longest else sum(model[n].numel() for n in Settings.names(model)) + 1
            masked = 8 * length
            time_stages(server, [(REQUESTS[stage], reply) for stage, reply, _ in STAGES], masked)
        _say_if_no_loss_is_tolerated(course)
        if not course.wall_clock and course.timing.has_dropouts:
            course.comm.filters.append(_withhold_after_sharing(course.timing))


def _say_if_no_loss_is_tolerated(course) -> None:
    """t equal to k (2 neighbours a client, e.g. 3 clients a round) leaves no slack: a client
    must keep every neighbour it masked with, so any loss after masking voids the round."""
    s = Settings.of(course.cfg)
    k = s.neighbours_each
    if s.threshold(k) == k and s.per_round > 1:
        log.warning("secure aggregation: each client has %d neighbour(s) and threshold %d: one "
                    "dropout, exclusion or report of a bad share after masking voids the round "
                    "(a single misbehaving client can void every round); use 3 or more neighbours "
                    "(4 or more clients a round, or secure_aggregation.num_neighbours) so that "
                    "t < k", k, k)


install.enabled = lambda cfg: cfg["secure_aggregation.enabled"]
install.message_checks = secagg_checks.MESSAGE_CHECKS


