"""Verifiable secret sharing (Shamir with Feldman's commitments): any `threshold` shares
rebuild the secret, fewer reveal nothing about it, and every share can be checked against
the dealer's public commitments when it is received, so a bad share is caught at once.

Shares live in Z_q, q a 256-bit prime; the commitments `C_j = g^(a_j) mod P` live in
the order-q subgroup of Z_P*, P a 2048-bit prime (a Schnorr group). The constants were
derived reproducibly (q: the first prime of the form SHA-256("fedcore feldman q|i|0")
with its top and bottom bits set; P: the first prime 2kq + 1 at or below the
SHA-256-expanded 2048-bit value labelled "fedcore feldman p|j"; g = 2^((P-1)/q)); the
tests check that q and P are prime, q divides P - 1 and g has order q.
A share is `(x, y)`: `x` the holder's id (>= 1), `y` the secret polynomial's value
there, sent as 32 big-endian bytes; a commitment travels as 256 bytes.
"""
from __future__ import annotations

import functools
import secrets

__all__ = ["PRIME", "GROUP_P", "GENERATOR", "SHARE_BYTES", "COMMITMENT_BYTES", "g_pow", "random_secret", "split",
           "commit", "verify_share", "combine", "share_to_bytes", "share_from_bytes",
           "commitments_to_bytes", "commitments_from_bytes"]

PRIME = 0xf4ecc83d1d19cae024f31439362274ebd179cbfff8a9776a01b7ad3398a9d85d   # q
GROUP_P = int(
    "a027f900dd626ddafd4b0fabedc6bb231b0f69fceeaa04677a106878ea79e3fddb190f5e556559786fe99f73117a3076"
    "a89c0204a9fab63b47eee9d6d180bcf377c753980c8e07d7974cfae9ef2034f267f4b4a749b2918319782b37b6956578"
    "d0bd931683cc17005d1bc2ddcb7970f3051ad4987ed7d5370af075979951f3568f8d51b27dc2d88cba418b1b39de638a"
    "8383346c524676194961bc0c7124d25fdb022e96726556ab569a5e7e40527a56ae8272ca084b5841c68ed3a6ebc87a38"
    "101c726bca9d6135bb564b6c105898eca5fd788a8c7cba922e0489bbbf83b345e17f8614e41be32a20362f73afe4aaee"
    "3a8b6942d1ca63e371fafe034217df2b", 16)
GENERATOR = int(
    "9a797ee157434e0dadb12ae109a2bf5764dc43f546161fe5055662c1d50d231b2c1835a5dcdd94de4ccfb2d33d822165"
    "67466b2b51d03714225457d1521b82be369ae37b7b8ccc3954d87b555c171612b0c0b7590423c3833b7423d807d68945"
    "bc00759490cd7f2d890e1db53bb641d9d9b9498d4c5a578cd4f4c41f0b0e0e48c86ca3804f5cbb703206a42b4ebafc08"
    "b3e4b9a71dd19f5e5f952f5d0d2d0028a340f3668e2abda402e0383d873f7966c8fcaaada1f29050282ef2c4ae782675"
    "6081129affa6ada359b81f2d39a5b66670963b1caca6c8e9279cbdd4fcce9eba453c702ea5ed9ef4458ce4f2b6b569cc"
    "4d188835ddd5aeba41fa57d1846a5b91", 16)
SHARE_BYTES = 32
COMMITMENT_BYTES = 256


@functools.lru_cache(maxsize=1)
def _g_table() -> list[list[int]]:
    """g^(d * 256^i) for each byte position i of an exponent and each byte value d: with it,
    g^e is 32 multiplications instead of a 256-bit exponentiation (some 20 times faster)."""
    table, base = [], GENERATOR
    for _ in range(SHARE_BYTES):
        row = [1]
        for _ in range(255):
            row.append(row[-1] * base % GROUP_P)
        table.append(row)
        base = row[-1] * base % GROUP_P
    return table


def g_pow(exponent: int) -> int:
    """g^exponent mod P, for 0 <= exponent < q."""
    out = 1
    for row, byte in zip(_g_table(), exponent.to_bytes(SHARE_BYTES, "little")):
        if byte:
            out = out * row[byte] % GROUP_P
    return out


def random_secret() -> bytes:
    """32 uniformly random bytes that are a field element (below q)."""
    return secrets.randbelow(PRIME).to_bytes(SHARE_BYTES, "big")


def _coefficients(secret: bytes, threshold: int) -> list[int]:
    value = int.from_bytes(secret, "big")
    if value >= PRIME:
        raise ValueError("secret too large for the field")
    return [value] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]


def split(secret: bytes, holders: list[int], threshold: int) -> tuple[dict[int, int], list[int]]:
    """(shares of `secret` for each holder id, the Feldman commitments to the polynomial):
    a random polynomial of degree threshold - 1 whose constant term is the secret."""
    if not 1 <= threshold <= len(holders):
        raise ValueError(f"threshold {threshold} must be in 1..{len(holders)} (the holders)")
    if len(set(holders)) != len(holders) or min(holders) < 1:
        raise ValueError("holder ids must be distinct and >= 1")
    coeffs = _coefficients(secret, threshold)
    shares = {}
    for x in holders:
        y = 0
        for c in reversed(coeffs):  # Horner
            y = (y * x + c) % PRIME
        shares[x] = y
    return shares, [g_pow(c) for c in coeffs]


def commit(secret: bytes) -> int:
    """g^secret: the commitment to the constant term, what `split`'s first commitment is."""
    return g_pow(int.from_bytes(secret, "big") % PRIME)


def verify_share(x: int, y: int, commitments: list[int]) -> bool:
    """Whether share (x, y) lies on the committed polynomial: g^y == prod_j C_j^(x^j)."""
    if not 0 <= y < PRIME or not commitments:
        return False
    expected, power = 1, 1
    for c in commitments:
        expected = expected * pow(c, power, GROUP_P) % GROUP_P
        power = power * x % PRIME
    return g_pow(y) == expected


def combine(shares: dict[int, int], threshold: int, length: int = SHARE_BYTES) -> bytes:
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


def commitments_to_bytes(commitments: list[int]) -> bytes:
    return b"".join(c.to_bytes(COMMITMENT_BYTES, "big") for c in commitments)


def commitments_from_bytes(data: bytes, threshold: int) -> list[int]:
    if len(data) != threshold * COMMITMENT_BYTES:
        raise ValueError(f"{threshold} commitment(s) are {threshold * COMMITMENT_BYTES} bytes, got {len(data)}")
    out = [int.from_bytes(data[i:i + COMMITMENT_BYTES], "big") for i in range(0, len(data), COMMITMENT_BYTES)]
    if not all(1 < c < GROUP_P for c in out):
        raise ValueError("commitment outside the group")
    return out
