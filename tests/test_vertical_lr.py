"""Vertical LR on Paillier-encrypted residuals: equal to centralized softmax regression on the
joined columns up to the fixed-point code (bound from algorithms/vertical_lr.py), and what each
party sees, tested as a curious party would look."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("phe", reason="he_lr needs the 'vertical' extra (pip install 'fedcore[vertical]')")
pytest.importorskip("cryptography", reason="PSI needs the 'vertical' extra (pip install 'fedcore[vertical]')")

import fedcore  # noqa: E402
from fedcore.algorithms import paillier as pl  # noqa: E402
from fedcore.algorithms.splitnn import batch_rows  # noqa: E402
from fedcore.algorithms.vertical_lr import LrPassive, gradient_error_bound  # noqa: E402
from fedcore.kernel.config import load_config  # noqa: E402
from fedcore.scenarios.vertical_data import party_tables, train_test_ids  # noqa: E402

BASE = {"seed": 1, "verbose": False, "data.type": "synthetic", "data.partition": "vertical",
        "data.synthetic.samples_per_client": 15, "data.synthetic.dim": 6, "data.synthetic.num_classes": 2,
        "federate.client_num": 3, "federate.total_round_num": 2, "data.test_size": 0.2,
        "vertical.parties": 3, "vertical.keep": 0.9, "vertical.method": "he_lr",
        "vertical.he.key_bits": 384, "vertical.he.frac_bits": 20,
        "model.dtype": "float64", "train.batch_size": 10, "train.optimizer.lr": 0.2}


def _central(cfg):
    """Softmax regression on the joined columns, weights at zero, the same batches."""
    tables = party_tables(cfg)
    shared = sorted(set.intersection(*(set(t.ids) for t in tables)))
    train_ids, _ = train_test_ids(shared, cfg)
    x = torch.cat([t.aligned(train_ids).x.double() for t in tables], dim=1)
    y = tables[0].aligned(train_ids).y
    c = tables[0].num_classes
    w, b = torch.zeros(x.shape[1], c, dtype=torch.float64), torch.zeros(c, dtype=torch.float64)
    n, bs, lr = len(y), cfg["train.batch_size"], cfg["train.optimizer.lr"]
    steps = -(-n // bs) * cfg["federate.total_round_num"]
    for s in range(steps):
        rows = batch_rows(cfg["seed"], n, bs, s)
        r = torch.softmax(x[rows] @ w + b, 1) - torch.nn.functional.one_hot(y[rows], c).double()
        w, b = w - lr * x[rows].T @ r / len(rows), b - lr * r.mean(0)
    widths = [t.x.shape[1] for t in tables]
    return w, b, widths, steps, float(x.abs().max())


def test_he_lr_equals_central_logistic_regression_up_to_fixed_point(tmp_path):
    fedcore.run({**BASE, "outdir": str(tmp_path)})
    final = torch.load(tmp_path / "final_model.pt", weights_only=True)
    w, b, widths, steps, max_x = _central(load_config(None, extra=BASE))
    parts = torch.split(w, widths, dim=0)
    # per step each passive coordinate is off by at most `bound`; lr times that, over the steps,
    # with a factor 4 for the propagation through later residuals (softmax is 1/4-Lipschitz per logit)
    tol = 4 * steps * BASE["train.optimizer.lr"] * gradient_error_bound(max_x, BASE["vertical.he.frac_bits"])
    assert tol < 1e-3
    torch.testing.assert_close(final["w0"], parts[0], rtol=0, atol=tol)
    torch.testing.assert_close(final["bias"], b, rtol=0, atol=tol)
    for p in (1, 2):
        torch.testing.assert_close(final[f"w{p}"], parts[p], rtol=0, atol=tol)
    assert not torch.equal(final["w1"], torch.zeros_like(final["w1"]))


def test_one_encrypted_gradient_is_within_the_stated_bound():
    cfg = load_config(None, extra=BASE)
    public, private = pl.keypair(384)
    torch.manual_seed(0)
    x = torch.randn(10, 3, dtype=torch.float64) * 3
    party = LrPassive(cfg, 1, x, x[:0], 2)
    party.key = pl.PublicKey(public.n)
    party.partial(0)
    rows = party._rows
    r = torch.rand(len(rows), 2, dtype=torch.float64) * 2 - 1
    masked = party.masked_gradient(pl.encrypt(public, pl.encode(r, 20, public.n)))
    decrypted = pl.decrypt_raw(private, masked)
    party.unmask_and_step(decrypted)
    exact = x[rows].T @ r / len(rows)
    got = -party.w / cfg["train.optimizer.lr"]
    assert (got - exact).abs().max() <= gradient_error_bound(float(x.abs().max()), 20)


class _Tap:
    """Records every message content a party receives (wraps the communicator's delivery)."""

    def __init__(self):
        self.seen: dict[int, list] = {}

    def __call__(self, msg, receiver, nbytes):
        self.seen.setdefault(receiver, []).append((msg.msg_type, msg.content))


def _run_tapped(tmp_path, name):
    from fedcore.runtime.course import Course
    course = Course(load_config(None, extra={**BASE, "outdir": str(tmp_path / name)})).build()
    tap, count = _Tap(), course.comm.count_bytes
    course.comm.count_bytes = lambda m, r, n: (tap(m, r, n), count(m, r, n))
    course.run()
    return course, tap.seen


def test_a_passive_party_sees_only_ciphertexts_and_masked_values(tmp_path):
    course, seen = _run_tapped(tmp_path, "a")
    kinds = {t for t, _ in seen[1]}
    assert kinds == {"psi_request", "psi_result", "public_key", "encrypted_residuals",
                     "decrypted_gradient", "finish"}
    n = int.from_bytes(bytes(next(c for t, c in seen[1] if t == "public_key")["n"]), "big")
    public = pl.PublicKey(n)
    enc = [c for t, c in seen[1] if t == "encrypted_residuals"][0]["c"]
    ints = pl.from_bytes(list(enc), n * n)
    # a curious passive party guessing residuals: Enc(m) with r = 1 is 1 + m n; its guesses of
    # every fixed-point residual it could expect never equal a received ciphertext
    guesses = {(1 + (round(v / 64 * 2 ** 20) % n) * n) % (n * n) for v in range(-64, 65)}
    assert not guesses & set(ints) and len(set(ints)) == len(ints)
    # the decrypted values it receives are its gradient plus a fresh uniform mask: two courses
    # with the same seed train the same weights but return different decrypted values
    course2, seen2 = _run_tapped(tmp_path, "b")
    d1 = [c["v"] for t, c in seen[1] if t == "decrypted_gradient"][0]
    d2 = [c["v"] for t, c in seen2[1] if t == "decrypted_gradient"][0]
    assert d1 != d2
    torch.testing.assert_close(course.clients[1].model.w, course2.clients[1].model.w, rtol=0, atol=1e-12)
    # the active party's view of a passive party's gradient: masked sums only, uniform modulo n
    masked = [c["c"] for t, c in seen[0] if t == "masked_gradient"]
    assert masked and all(len(m) == course.clients[1].model.w.numel() for m in masked[:1])
