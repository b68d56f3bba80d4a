"""Paillier encryption (python-paillier, `phe`) over fixed-point integers, for vertical LR.

phe makes the keys and does encryption and decryption; this module adds the two operations
a passive party needs on ciphertexts as plain integers modulo n^2 (a sum of ciphertext
powers is the encryption of a linear combination) and the fixed-point code: a real v is the
integer round(v * 2^F) modulo n, negative values wrapping to n - |.|. A product of two
encoded values carries scale 2^(2F); decoding divides it out. Ciphertexts cross the wire as
big-endian bytes (never pickled).
"""
from __future__ import annotations

import secrets

import torch

__all__ = ["keypair", "encode", "decode", "encrypt", "decrypt_raw", "linear_combination", "add_plain",
           "to_bytes", "from_bytes", "PublicKey"]


def _phe():
    try:
        import phe
    except ImportError:
        from fedcore.kernel.errors import ConfigError
        raise ConfigError("vertical.method: he_lr needs python-paillier (pip install 'fedcore[vertical]' "
                          "or pip install phe)") from None
    return phe


class PublicKey:
    """n and n^2: all a passive party holds of the key."""

    def __init__(self, n: int):
        self.n, self.nsquare = n, n * n


def keypair(bits: int):
    """(phe public key, phe private key) of an n of `bits` bits."""
    return _phe().generate_paillier_keypair(n_length=bits)


def encode(values: torch.Tensor, frac_bits: int, n: int) -> list[int]:
    """Each value as round(v * 2^F) modulo n (exact in float64's range, via Python ints)."""
    scale = 1 << frac_bits
    return [round(float(v) * scale) % n for v in values.reshape(-1).tolist()]


def decode(ints: list[int], scale_bits: int, n: int) -> torch.Tensor:
    """Integers modulo n back to reals of scale 2^scale_bits (the upper half is negative)."""
    half = n // 2
    return torch.tensor([(i - n if i > half else i) / float(1 << scale_bits) for i in ints],
                        dtype=torch.float64)


def encrypt(public, ints: list[int]) -> list[int]:
    """Fresh randomised encryptions (phe's raw_encrypt with an OS random r)."""
    return [public.raw_encrypt(m) for m in ints]


def decrypt_raw(private, ciphertexts: list[int]) -> list[int]:
    """The plaintexts modulo n (no decoding: a masked value is uniform in [0, n))."""
    return [private.raw_decrypt(c) for c in ciphertexts]


def linear_combination(key: PublicKey, ciphertexts: list[int], weights: list[int]) -> int:
    """Enc(sum_i w_i m_i) from Enc(m_i) and signed plaintext integers w_i (small: cheap powers)."""
    acc = 1
    for c, w in zip(ciphertexts, weights):
        if w == 0:
            continue
        if w < 0:
            c, w = pow(c, -1, key.nsquare), -w
        acc = acc * pow(c, w, key.nsquare) % key.nsquare
    return acc


def add_plain(key: PublicKey, ciphertext: int, m: int) -> int:
    """Enc(x + m) from Enc(x): multiply by g^m = 1 + m n (mod n^2)."""
    return ciphertext * ((1 + (m % key.n) * key.n) % key.nsquare) % key.nsquare


def random_mask(n: int) -> int:
    """A uniform mask modulo n from the OS: hides any value modulo n perfectly."""
    return secrets.randbelow(n)


def to_bytes(values: list[int], width: int) -> list[bytes]:
    return [v.to_bytes(width, "big") for v in values]


def from_bytes(values: list[bytes], bound: int) -> list[int]:
    """Integers read from the wire, refused unless each lies in [0, bound)."""
    out = [int.from_bytes(bytes(v), "big") for v in values]
    if any(v >= bound for v in out):
        raise ValueError("paillier: a received integer is out of range")
    return out
