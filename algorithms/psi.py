"""Private set intersection by commutative (Diffie-Hellman) blinding on Curve25519.

Each id is hashed to a Curve25519 u-coordinate (SHA-512 under a domain tag, 255 bits);
a party blinds a point with its secret scalar k by X25519 scalar multiplication (the
`cryptography` package). Scalar multiplication commutes, so a·(b·H(x)) = b·(a·H(x)): two
parties who each blind the other's already-blinded set obtain equal values exactly for the
shared ids, and nothing else is comparable without a secret (the decisional Diffie-Hellman
assumption). Secrets come from the operating system (never from the course's seed).

Two-party round (the active party A with each passive party B):
  A -> B  `request`:  A's ids blinded by a, in a random order only A knows;
  B -> A  `reply`:    the request re-blinded by b (same order), and B's ids blinded by b,
                      shuffled;
  A:                  blinds B's set by a, compares: learns which of its own ids B holds.
With P parties A intersects every pair's result and tells every passive party the final
shared ids (`PsiActive.shared`). What each side sees is stated in docs/vertical.md.
"""
from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

__all__ = ["POINT_BYTES", "hash_to_point", "PsiKey", "PsiActive", "passive_reply", "intersect"]

POINT_BYTES = 32
DOMAIN = b"fedcore-psi-v1\x00"


def hash_to_point(sample_id: str) -> bytes:
    """The id's Curve25519 u-coordinate: SHA-512 under the domain tag, cut to 255 bits."""
    digest = bytearray(hashlib.sha512(DOMAIN + sample_id.encode("utf-8")).digest()[:POINT_BYTES])
    digest[-1] &= 0x7F
    return bytes(digest)


class PsiKey:
    """A party's secret blinding scalar (32 random bytes from the OS, clamped by X25519)."""

    def __init__(self, secret: bytes | None = None):
        self._key = X25519PrivateKey.from_private_bytes(secret if secret is not None else os.urandom(32))

    def blind(self, point: bytes) -> bytes:
        """k·point (a hashed id, or a point another party already blinded)."""
        if len(point) != POINT_BYTES:
            raise ValueError(f"psi: a point is {POINT_BYTES} bytes, got {len(point)}")
        return self._key.exchange(X25519PublicKey.from_public_bytes(point))

    def blind_ids(self, ids: Iterable[str]) -> list[bytes]:
        return [self.blind(hash_to_point(s)) for s in ids]


def _shuffled(items: list, rng: secrets.SystemRandom) -> list:
    items = list(items)
    rng.shuffle(items)
    return items


@dataclass
class PsiActive:
    """The active party's side: its blinded request, and the intersection once replies are in."""
    ids: list[str]
    key: PsiKey = field(default_factory=PsiKey)
    order: list[str] = field(init=False)
    found: dict[int, set[str]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if len(set(self.ids)) != len(self.ids):
            raise ValueError("psi: the active party's ids repeat")
        self.order = _shuffled(self.ids, secrets.SystemRandom())

    def request(self) -> list[bytes]:
        """What every passive party receives: a·H(id) for each own id, in a secret random order."""
        return self.key.blind_ids(self.order)

    def receive(self, party: int, reblinded: list[bytes], theirs: list[bytes]) -> set[str]:
        """A passive party's reply: b·a·H(own ids) in request order, and b·H(their ids)."""
        if len(reblinded) != len(self.order):
            raise ValueError(f"psi: party {party} re-blinded {len(reblinded)} points, "
                             f"{len(self.order)} were sent")
        doubled = {self.key.blind(p) for p in theirs}
        self.found[party] = {s for s, p in zip(self.order, reblinded) if p in doubled}
        return self.found[party]

    def shared(self) -> list[str]:
        """The ids every party holds (sorted): the intersection over all replies received."""
        sets = list(self.found.values())
        return sorted(set.intersection(*sets)) if sets else []


def passive_reply(ids: Iterable[str], request: list[bytes], key: PsiKey | None = None
                  ) -> tuple[list[bytes], list[bytes]]:
    """A passive party's answer: the request re-blinded in order, and its own ids blinded and
    shuffled (so their positions say nothing)."""
    key = key or PsiKey()
    own = key.blind_ids(ids)
    return [key.blind(p) for p in request], _shuffled(own, secrets.SystemRandom())


def intersect(id_sets: list[list[str]]) -> list[str]:
    """Run the protocol among parties 0 (active) .. P-1 in one process; the shared ids, sorted."""
    active = PsiActive(list(id_sets[0]))
    request = active.request()
    for party, ids in enumerate(id_sets[1:], start=1):
        active.receive(party, *passive_reply(ids, request))
    return active.shared()
