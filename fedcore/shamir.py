"""Shamir secret sharing over a prime field: any `threshold` shares rebuild the secret, fewer
reveal nothing about it.

The field is GF(2^521 - 1) (a Mersenne prime), wide enough for any 32-byte secret
(a private key, a PRG seed). A share is `(x, y)` with `x` the holder's id (>= 1)
and `y` the secret polynomial's value there; `y` travels as 66 big-endian bytes.
"""
from __future__ import annotations

import secrets

__all__ = ["PRIME", "SHARE_BYTES", "split", "combine", "share_to_bytes", "share_from_bytes"]

PRIME = 2 ** 521 - 1
SHARE_BYTES = 66


def split(secret: bytes, holders: list[int], threshold: int) -> dict[int, int]:
    """Shares of `secret` for each holder id: a random polynomial of degree threshold - 1
    whose constant term is the secret, evaluated at each id."""
    if not 1 <= threshold <= len(holders):
        raise ValueError(f"threshold {threshold} must be in 1..{len(holders)} (the holders)")
    if len(set(holders)) != len(holders) or min(holders) < 1:
        raise ValueError("holder ids must be distinct and >= 1")
    value = int.from_bytes(secret, "big")
    if value >= PRIME:
        raise ValueError("secret too large for the field")
    coeffs = [value] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    shares = {}
    for x in holders:
        y = 0
        for c in reversed(coeffs):  # Horner
            y = (y * x + c) % PRIME
        shares[x] = y
    return shares


def combine(shares: dict[int, int], threshold: int, length: int) -> bytes:
    """The secret (`length` bytes) from at least `threshold` shares (Lagrange at x = 0)."""
    if len(shares) < threshold:
        raise ValueError(f"{len(shares)} share(s) given, {threshold} needed")
    points = sorted(shares.items())[:threshold]
    secret = 0
    for i, (xi, yi) in enumerate(points):
        num = den = 1
        for j, (xj, _) in enumerate(points):
            if i != j:
                num = num * (-xj) % PRIME
                den = den * (xi - xj) % PRIME
        secret = (secret + yi * num * pow(den, -1, PRIME)) % PRIME
    if secret >= 1 << (8 * length):
        raise ValueError("shares do not rebuild a secret of the expected length (inconsistent shares)")
    return secret.to_bytes(length, "big")


def share_to_bytes(y: int) -> bytes:
    return y.to_bytes(SHARE_BYTES, "big")


def share_from_bytes(data: bytes) -> int:
    if len(data) != SHARE_BYTES:
        raise ValueError(f"a share is {SHARE_BYTES} bytes, got {len(data)}")
    y = int.from_bytes(data, "big")
    if y >= PRIME:
        raise ValueError("share outside the field")
    return y
