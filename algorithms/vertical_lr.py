"""Vertical logistic regression on Paillier-encrypted residuals (Hardy et al. 2017, the
FederatedScope/FATE hetero-LR flow), multinomial, weights starting at zero.

Per mini-batch B (the seeded order of fedcore.algorithms.splitnn.batch_rows):
  passive p -> active   u_p = X_pB W_p                      (partial logits, plaintext)
  active                R = softmax(X_0B W_0 + b + sum_p u_p) - onehot(y_B); steps W_0, b
  active -> passive     [[R]]                               (Paillier, fixed point 2^-F)
  passive -> active     [[X_pB^T R + M_p]]                  (M_p uniform mod n, from the OS)
  active -> passive     X_pB^T R + M_p mod n                (decrypted: uniform, says nothing)
  passive               g_p = (that - M_p) / (2^2F |B|);    W_p -= lr g_p
The only difference to centralized softmax regression on the joined columns is the fixed-point
code of R and X_p: per coordinate of g_p the error is at most (max|x| + 1) 2^-(F+1) + 2^-(2F+2)
(docs/vertical.md; tests/test_vertical_lr.py).
"""
from __future__ import annotations

import torch

from fedcore.kernel.config import declare
from fedcore.kernel.registry import components

__all__ = ["LrPassive", "LrActive", "gradient_error_bound"]

declare("vertical.he.key_bits", int, 2048, "he_lr: bits of the Paillier modulus n (the active party's "
        "key); small keys only for tests", check=lambda v: None if v >= 256 else f"must be at least 256, got {v}")
declare("vertical.he.frac_bits", int, 24, "he_lr: fixed-point fraction bits F of residuals and features "
        "(gradient error per coordinate at most (max|x| + 1) 2^-(F+1) + 2^-(2F+2))",
        check=lambda v: None if 4 <= v <= 60 else f"must be in [4, 60], got {v}")


def gradient_error_bound(max_abs_x: float, frac_bits: int) -> float:
    """The most one coordinate of a decoded passive gradient can differ from the exact one."""
    return (max_abs_x + 1.0) * 2.0 ** -(frac_bits + 1) + 2.0 ** -(2 * frac_bits + 2)


def _rows(cfg, n: int, step: int) -> torch.Tensor:
    return components.get("batch_rows")(cfg["seed"], n, cfg["train.batch_size"], step)


def _pl():
    from fedcore.algorithms import paillier
    return paillier


class LrPassive:
    """A passive party's weights over its columns, and its side of the encrypted gradient."""

    def __init__(self, cfg, party: int, x_train: torch.Tensor, x_test: torch.Tensor, num_classes: int):
        self.cfg, self.party = cfg, party
        self.x_train, self.x_test = x_train.double(), x_test.double()
        self.w = torch.zeros(x_train.shape[1], num_classes, dtype=torch.float64)
        self.key = None
        self._masks: list[int] | None = None
        self._rows: torch.Tensor | None = None

    def partial(self, step: int) -> torch.Tensor:
        self._rows = _rows(self.cfg, len(self.x_train), step)
        return self.x_train[self._rows] @ self.w

    def test_partial(self) -> torch.Tensor:
        return self.x_test @ self.w

    def masked_gradient(self, enc_residuals: list[int]) -> list[int]:
        """[[X_B^T R + M]] per (column, class), from [[R]] (row-major B x C)."""
        pl, key = _pl(), self.key
        x = self.x_train[self._rows]
        classes = self.w.shape[1]
        if len(enc_residuals) != len(x) * classes:
            raise ValueError(f"party {self.party}: {len(enc_residuals)} encrypted residuals for a "
                             f"batch of {len(x)} x {classes}")
        scale = 1 << self.cfg["vertical.he.frac_bits"]
        xi = [[round(v * scale) for v in row] for row in x.tolist()]
        self._masks, out = [], []
        for j in range(x.shape[1]):
            for c in range(classes):
                s = pl.linear_combination(key, enc_residuals[c::classes], [row[j] for row in xi])
                m = pl.random_mask(key.n)
                self._masks.append(m)
                out.append(pl.add_plain(key, s, m))
        return out

    def tensors(self) -> dict[str, torch.Tensor]:
        """What a snapshot keeps (handlers/vertical_snapshot.py): the weights, live (plain SGD
        keeps no optimizer state)."""
        return {"w": self.w}

    def optimizers(self) -> dict:
        return {}

    def unmask_and_step(self, decrypted: list[int]) -> None:
        pl, n = _pl(), self.key.n
        if self._masks is None or len(decrypted) != len(self._masks):
            raise ValueError(f"party {self.party}: a decrypted gradient that answers no request")
        g = pl.decode([(d - m) % n for d, m in zip(decrypted, self._masks)],
                      2 * self.cfg["vertical.he.frac_bits"], n)
        self.w -= self.cfg["train.optimizer.lr"] * g.reshape(self.w.shape) / len(self._rows)
        self._masks = None


class LrActive:
    """The active party: its weights and the bias, the labels and the Paillier key pair."""

    def __init__(self, cfg, x_train, x_test, y_train, y_test, num_classes: int, keyed: bool = True):
        self.cfg = cfg
        self.x_train, self.x_test = x_train.double(), x_test.double()
        self.y_train, self.y_test = y_train, y_test
        self.w = torch.zeros(x_train.shape[1], num_classes, dtype=torch.float64)
        self.b = torch.zeros(num_classes, dtype=torch.float64)
        # keyed=False: a template of the layout only (a snapshot is checked against it)
        self.public, self._private = _pl().keypair(cfg["vertical.he.key_bits"]) if keyed else (None, None)

    @property
    def n(self) -> int:
        return self.public.n

    def step(self, step: int, partials: dict[int, torch.Tensor]) -> tuple[list[int], float]:
        """Residuals of the batch, encrypted for the passive parties; the own step; the loss."""
        pl = _pl()
        rows = _rows(self.cfg, len(self.y_train), step)
        x, y = self.x_train[rows], self.y_train[rows]
        z = x @ self.w + self.b + sum(partials[p].double() for p in sorted(partials))
        loss = torch.nn.functional.cross_entropy(z, y).item()
        r = torch.softmax(z, dim=1) - torch.nn.functional.one_hot(y, z.shape[1]).double()
        lr = self.cfg["train.optimizer.lr"]
        self.w -= lr * (x.T @ r) / len(rows)
        self.b -= lr * r.mean(0)
        enc = pl.encrypt(self.public, pl.encode(r, self.cfg["vertical.he.frac_bits"], self.n))
        return enc, loss

    def tensors(self) -> dict[str, torch.Tensor]:
        """What a snapshot keeps (handlers/vertical_snapshot.py): the weights and bias, live (the
        key pair is not kept: a resumed course makes a fresh one)."""
        return {"w0": self.w, "bias": self.b}

    def optimizers(self) -> dict:
        return {}

    def decrypt(self, masked: list[int]) -> list[int]:
        return _pl().decrypt_raw(self._private, masked)

    def evaluate(self, partials: dict[int, torch.Tensor]) -> dict[str, float]:
        if not len(self.y_test):
            return {}
        z = self.x_test @ self.w + self.b + sum(partials[p].double() for p in sorted(partials))
        return {"test_acc": float((z.argmax(1) == self.y_test).double().mean()),
                "test_loss": torch.nn.functional.cross_entropy(z, self.y_test).item()}

    def state(self) -> dict[str, torch.Tensor]:
        return {"w0": self.w.clone(), "bias": self.b.clone()}


components.register("lr_passive", LrPassive)
components.register("lr_active", LrActive)
components.register("paillier", _pl)
