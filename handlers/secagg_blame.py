"""What the server of a secure course checks of each client, and whom it excludes, by name.

Each check is one the server can make alone and that an honest client always passes: a
signature against the roster, a declared weight against the sample count the client
joined with, keys never seen before, a share against its dealer's Feldman commitments.
A client that fails is left out of the rest of the round with one warning saying what
it did (the stages are in handlers/secure_aggregation.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedcore.algorithms.secagg_settings import Settings
from fedcore.kernel.server_state import transient, worker_state

__all__ = ["ServerRound", "SecaggServer", "exclude", "keys_problem", "shares_problem", "settle_survivors", "checked_shares",
           "survivor_keys"]

log = logging.getLogger("fedcore.secagg")


@dataclass
class ServerRound:
    serial: int
    round: int
    stage: str = "keys"
    threshold: int = 0
    keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)     # U1: (cipher pk, mask pk)
    weights: dict[int, int] = field(default_factory=dict)                  # declared, signed
    key_signatures: dict[int, bytes] = field(default_factory=dict)
    graph: dict[int, list[int]] = field(default_factory=dict)
    shares: dict[int, dict[int, tuple[bytes, bytes]]] = field(default_factory=dict)  # U2: dealer -> holder -> (ct, sig)
    commitments: dict[int, bytes] = field(default_factory=dict)
    masked: dict[int, np.ndarray] = field(default_factory=dict)            # U3
    bad_shares: dict[int, list[int]] = field(default_factory=dict)         # holder -> dealers it reported
    survivors: list[int] = field(default_factory=list)
    dropped: dict[int, list[int]] = field(default_factory=dict)            # dropped -> survivors masked with it
    signatures: dict[int, bytes] = field(default_factory=dict)
    revealed: dict[str, dict[int, dict[int, bytes]]] = field(
        default_factory=lambda: {"seed": {}, "key": {}, "pair": {}})       # kind -> secret's owner -> holder -> bytes
    excluded: dict[int, str] = field(default_factory=dict)                 # client -> what it did
    refusals: dict[int, str] = field(default_factory=dict)                 # client -> why it refused
    messages: int = 0
    nbytes: int = 0

    def count(self, nbytes: int, messages: int = 1) -> None:
        self.messages += messages
        self.nbytes += nbytes

    def fields(self) -> dict[str, Any]:
        return {"secagg_messages": self.messages, "secagg_bytes": self.nbytes,
                "secagg_dropped": len(self.dropped), "secagg_excluded": sorted(self.excluded),
                "secagg_refusals": len(self.refusals)}


@worker_state("secure_aggregation")
@dataclass
class SecaggServer:
    """A secure course's server state. Saved: how many rounds were aggregated (a course that
    aggregated none exits as such) and every public key and masked input seen, so that one
    replayed from an earlier round is refused after a restart too. The round in progress is
    transient: its keys and shares belong to clients' sessions of that round, and a round in
    flight when the server died is run again from its start with fresh keys."""
    aggregated: int = 0
    seen_keys: set[bytes] = field(default_factory=set)
    seen_inputs: set[bytes] = field(default_factory=set)
    current: ServerRound | None = transient(lambda: None)
    timeout: float = transient(float)   # a stage's wait (secure_aggregation.stage_timeout), from the config


def exclude(server, sr: ServerRound, client: int, what: str) -> None:
    """Leave a misbehaving client out of the rest of the round, naming it and what it did."""
    if client not in sr.excluded:
        sr.excluded[client] = what
        log.warning("secure aggregation: round %d: client %d excluded: %s", sr.round, client, what)
        server.course.monitor.tally("secure_aggregation", "secagg_excluded", str(client))


def _weight_bound(server, client: int) -> int:
    """The largest weight a client may declare: 1 when all weigh 1, else the sample count it
    joined with, capped as admission caps it (admission.max_num_samples)."""
    from fedcore.runtime.admission import AdmissionState, sample_cap
    s = Settings.of(server.course.cfg)
    if s.uniform:
        return 1
    declared = server.state(AdmissionState).declared.get(client)
    bounds = [b for b in (declared, sample_cap(server.course))
              if b is not None]
    return s.client_weight(min(bounds)) if bounds else s.modulus


def keys_problem(server, msg) -> str | None:
    """What is wrong with a client's advertised keys and weight: a signature that is not its
    roster key's, a weight outside 1..its join's sample count, or keys seen before (a replay)."""
    from fedcore.algorithms.secagg_identity import course_identity, keys_statement, verify
    c, u = msg.content, msg.sender
    bound = _weight_bound(server, u)
    if not verify(course_identity(server.course).roster, u,
                  keys_statement(msg.round, u, c["cipher_key"], c["mask_key"], c["weight"]), c["signature"]):
        return "its keys are not signed with its roster key"
    if not 1 <= c["weight"] <= bound:
        return f"it declared weight {c['weight']}, outside 1..{bound} (its join)"
    seen = server.state(SecaggServer).seen_keys
    if c["cipher_key"] in seen or c["mask_key"] in seen:
        return "it replayed public keys of an earlier round"
    return None


def shares_problem(server, sr: ServerRound, msg, bundle: dict[int, tuple[bytes, bytes]]) -> str | None:
    """What is wrong with a dealer's shares: a neighbour left without one (its pairwise mask could
    not be taken out of the sum if the dealer dropped), commitments of the wrong size, or a
    ciphertext its signature does not cover."""
    from fedcore.algorithms.secagg_identity import course_identity, shares_statement, verify
    from fedcore.kernel.shamir import COMMITMENT_BYTES
    commitments, u = msg.content["commitments"], msg.sender
    missing = sorted(set(sr.graph.get(u, ())) - set(bundle))
    if missing:   # an honest dealer shares with every neighbour it was shown (or refuses the round)
        return f"it sent no share to its neighbour(s) {missing}"
    if len(commitments) != 2 * sr.threshold * COMMITMENT_BYTES:
        return f"it sent {len(commitments)} bytes of commitments, not {2 * sr.threshold} commitments"
    roster = course_identity(server.course).roster
    if not all(verify(roster, u, shares_statement(msg.round, u, v, ct, commitments), sig)
               for v, (ct, sig) in bundle.items()):
        return "its encrypted shares are not signed with its roster key"
    return None


def survivor_keys(sr: ServerRound) -> list[bytes]:
    return [sr.keys[s][0] + sr.keys[s][1] for s in sr.survivors]


def settle_survivors(server, sr: ServerRound) -> None:
    """The survivors: masked senders whose seed at least t holders can rebuild from good
    shares; a client whose shares too many holders reported bad leaves the sum (named)."""
    survivors = set(sr.masked)
    changed = True
    while changed:
        changed = False
        for v in sorted(survivors):
            holders = [u for u in sr.shares.get(v, {}) if u in survivors]
            good = [u for u in holders if v not in sr.bad_shares.get(u, [])]
            bad = sorted(set(holders) - set(good))
            if bad and len(good) < sr.threshold:
                exclude(server, sr, v, f"its shares failed their checks at client(s) {bad}")
                survivors.discard(v)
                changed = True
    sr.survivors = sorted(survivors)
    sr.dropped = {v: [u for u in sorted(sr.shares[v]) if u in survivors]
                  for v in sorted(sr.shares) if v not in survivors}


def checked_shares(server, sr: ServerRound, kind: str, owners) -> dict[int, dict[int, int]]:
    """The revealed shares of `kind` that lie on their owner's committed polynomial; a holder
    that reveals one that does not is named and its share ignored."""
    from fedcore.kernel.shamir import commitments_from_bytes, share_from_bytes, verify_share
    out = {}
    for v in owners:
        polys = commitments_from_bytes(sr.commitments[v], 2 * sr.threshold)
        poly = polys[:sr.threshold] if kind == "key" else polys[sr.threshold:]
        out[v] = {}
        for holder, raw in sr.revealed[kind].get(v, {}).items():
            if holder not in sr.shares[v]:
                continue   # v gave it no share
            try:
                y = share_from_bytes(raw)
            except ValueError:
                y = None
            if y is not None and verify_share(holder, y, poly):
                out[v][holder] = y
            else:
                exclude(server, sr, holder, f"it revealed a false share of client {v}'s {kind}")
    return out
