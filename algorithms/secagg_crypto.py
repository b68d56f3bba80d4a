"""The cryptographic pieces of secure aggregation, all from the `cryptography` package.

- key agreement: X25519 key pairs, the shared secret run through HKDF-SHA256;
- share encryption: AES-256-GCM (authenticated; the pair's ids and the round are
  its associated data, so a ciphertext cannot be replayed for another pair);
- mask expansion: AES-256-CTR keystream as a PRG, turned into integers uniform
  modulo the field's prime by rejection sampling;
- the field: vectors of integers modulo a prime p < 2^62 (numpy uint64, no overflow);
- quantization: an update clipped to [-c, c] per coordinate and rounded to one of
  2^bits levels, so that integer sums dequantize to the real sum within c / (2^bits - 1)
  per coordinate of the mean.
"""
from __future__ import annotations

import os

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

__all__ = ["KEY_BYTES", "new_private_key", "public_bytes", "private_bytes", "agree", "encrypt",
           "decrypt", "prg_field", "field_add", "field_sub", "quantize", "dequantize", "is_prime"]

KEY_BYTES = 32
NONCE_BYTES = 12


# ---------------------------------------------------------------- keys
def new_private_key() -> X25519PrivateKey:
    return X25519PrivateKey.generate()


def public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes_raw()


def private_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes_raw()


def agree(private: X25519PrivateKey | bytes, peer_public: bytes, info: bytes) -> bytes:
    """A 32-byte key both ends of a pair derive alike: HKDF-SHA256 over X25519(private, peer)."""
    if isinstance(private, bytes):
        private = X25519PrivateKey.from_private_bytes(private)
    shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(shared)


# ---------------------------------------------------------------- authenticated encryption
def encrypt(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """AES-256-GCM under `key`; a fresh random nonce is prepended (both directions of a pair
    share the key, so the nonce must not repeat)."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, associated)


def decrypt(key: bytes, ciphertext: bytes, associated: bytes) -> bytes:
    """The plaintext; raises cryptography's InvalidTag if anything was altered."""
    return AESGCM(key).decrypt(ciphertext[:NONCE_BYTES], ciphertext[NONCE_BYTES:], associated)


# ---------------------------------------------------------------- the field and the PRG
def prg_field(seed: bytes, length: int, modulus: int) -> np.ndarray:
    """`length` integers uniform in [0, modulus), expanded from a 32-byte seed.

    AES-256-CTR (zero nonce: every seed is used for one expansion only) gives 64-bit
    words; each is cut to the bit length of the modulus and kept if below it, so every
    kept value is exactly uniform. At least half the words are kept."""
    bits = int(modulus - 1).bit_length()
    mask = np.uint64((1 << bits) - 1)
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(b"\0" * 16)).encryptor()
    out, have = [], 0
    while have < length:
        want = max(16, int((length - have) * (1 << bits) / modulus * 1.05) + 8)
        words = np.frombuffer(encryptor.update(b"\0" * (8 * want)), dtype="<u8") & mask
        kept = words[words < np.uint64(modulus)]
        out.append(kept)
        have += kept.size
    return np.concatenate(out)[:length].astype(np.uint64)


def field_add(a: np.ndarray, b: np.ndarray, modulus: int) -> np.ndarray:
    return (a + b) % np.uint64(modulus)   # both < 2^62: the sum cannot wrap


def field_sub(a: np.ndarray, b: np.ndarray, modulus: int) -> np.ndarray:
    return (a + (np.uint64(modulus) - b)) % np.uint64(modulus)


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (bases: the first 13 primes)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


# ---------------------------------------------------------------- quantization
def quantize(vector: np.ndarray, clip: float, bits: int) -> np.ndarray:
    """Each coordinate clipped to [-clip, clip] and rounded to the nearest of 2^bits levels
    (level 0 is -clip, the top level +clip)."""
    levels = (1 << bits) - 1
    clipped = np.clip(np.asarray(vector, dtype=np.float64), -clip, clip)
    return np.rint((clipped + clip) * (levels / (2 * clip))).astype(np.uint64)


def dequantize(total: np.ndarray, total_weight: int, clip: float, bits: int) -> np.ndarray:
    """The weighted mean from the integer sum of w_k * quantize(x_k) and W = sum_k w_k."""
    levels = (1 << bits) - 1
    return total.astype(np.float64) * (2 * clip / levels) / total_weight - clip
