"""Fixed-point codes of the trees' float histograms in secure aggregation's prime field, so that
the server learns only their sum (handlers/trees.py, `secure_aggregation.enabled`).

Each client codes every entry x of its gradient/hessian histograms as q = round(x 2^F) mod p
(F = `trees.secure_frac_bits`, p = `secure_aggregation.modulus`), refusing |q| above
(p - 1) / (2 N) so that the sum of N honest codes, read as a signed number in (-p/2, p/2),
is exactly sum_k q_k. The decoded sum is within N 2^-(F+1) of the clients' float64 sum, per
entry (each code within 2^-(F+1) of its entry), up to the final float64 rounding.
"""
from __future__ import annotations

import numpy as np

from fedcore.kernel.config import declare
from fedcore.kernel.errors import ConfigError

__all__ = ["encode", "decode", "error_bound", "limit"]

declare("trees.secure_frac_bits", int, 32, "task: trees with secure_aggregation.enabled: fractional "
        "bits F of the fixed-point code of each histogram entry (the securely summed histograms are "
        "within clients x 2^-(F+1) of the plain ones; an entry may be at most (p-1)/2 / clients / 2^F "
        "in size, p = secure_aggregation.modulus)",
        check=lambda v: None if 0 <= v <= 52 else "must be in 0..52")


def limit(modulus: int, clients: int) -> int:
    """The largest |code| a client may send: N of them sum to less than p/2 in size."""
    return (modulus - 1) // 2 // max(clients, 1)


def encode(hist: np.ndarray, frac_bits: int, modulus: int, clients: int) -> np.ndarray:
    """uint64 codes round(x 2^F) mod p of a float64 vector; an entry too large for the field
    (N clients' codes could wrap around) is refused in one line."""
    q = np.rint(np.ldexp(np.asarray(hist, dtype=np.float64), frac_bits))
    top = limit(modulus, clients)
    if q.size and not (np.isfinite(q).all() and float(np.abs(q).max()) <= top):
        big = float(np.abs(hist).max())
        raise ConfigError(f"trees.secure_frac_bits: a histogram entry of size {big:.6g} exceeds the "
                          f"{np.ldexp(float(top), -frac_bits):.6g} that {clients} clients may each send "
                          f"with {frac_bits} fractional bits in the field; lower trees.secure_frac_bits")
    q = q.astype(np.int64)
    return np.where(q < 0, q + modulus, q).astype(np.uint64)


def decode(total: np.ndarray, frac_bits: int, modulus: int) -> np.ndarray:
    """float64 values of a sum of codes mod p, read as signed: the integer part and the
    fraction converted apart, so a sum beyond 2^53 loses only float64's last rounding."""
    t = np.asarray(total, dtype=np.uint64).astype(np.int64)
    t = np.where(t > (modulus - 1) // 2, t - modulus, t)
    whole, frac = t >> frac_bits, t & ((1 << frac_bits) - 1)
    return whole.astype(np.float64) + np.ldexp(frac.astype(np.float64), -frac_bits)


def error_bound(frac_bits: int, clients: int) -> float:
    """The most a decoded sum's entry differs from the clients' float64 sum (before rounding)."""
    return clients * 2.0 ** -(frac_bits + 1)
