"""Label leakage through SplitNN's cut gradients, tested as a curious passive party would
attack (the direction attack of Li et al., ICLR 2022), and what `vertical.gradient_noise` does
to it. The attacker is passive party 1 of a real course: it sees only the messages it receives."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("cryptography", reason="vertical courses need the 'vertical' extra (pip install 'fedcore[vertical]')")

from fedcore.algorithms.splitnn import batch_rows  # noqa: E402
from fedcore.kernel.config import load_config  # noqa: E402
from fedcore.runtime.course import Course  # noqa: E402
from fedcore.scenarios.vertical_data import party_tables, train_test_ids  # noqa: E402

BASE = {"seed": 2, "verbose": False, "data.type": "synthetic", "data.partition": "vertical",
        "data.synthetic.samples_per_client": 40, "data.synthetic.dim": 6, "data.synthetic.num_classes": 2,
        "federate.client_num": 4, "federate.total_round_num": 2, "data.test_size": 0.2,
        "vertical.parties": 2, "vertical.cut": 4, "model.dtype": "float64", "train.batch_size": 16,
        "train.optimizer.lr": 0.05}


def _attack(noise: float) -> float:
    """Fraction of party 1's training labels the direction attack infers (the better of the two
    cluster namings: the attacker does not know which cluster is which class)."""
    cfg = load_config(None, extra={**BASE, "vertical.gradient_noise": noise})
    course = Course(cfg).build()
    seen, count = [], course.comm.count_bytes
    course.comm.count_bytes = lambda m, r, n: (seen.append(m.content) if r == 1 and m.msg_type
                                               == "cut_gradients" else None, count(m, r, n))
    course.run()
    # the attack: in each batch, the sign of each row's cosine with the batch's first row
    guesses = []
    for msg in seen:
        g = msg["g"]
        guesses.append((torch.nn.functional.cosine_similarity(g, g[:1].expand_as(g)) > 0, msg["step"]))
    # scoring (the test's knowledge, not the attacker's): the true labels of each batch
    tables = party_tables(cfg)
    shared = sorted(set(tables[0].ids) & set(tables[1].ids))
    train_ids, _ = train_test_ids(shared, cfg)
    y = tables[0].aligned(train_ids).y
    right = total = 0
    for same, step in guesses:
        labels = y[batch_rows(cfg["seed"], len(y), cfg["train.batch_size"], step)]
        truth = labels == labels[0]
        hits = int((same == truth).sum())
        right, total = right + max(hits, len(truth) - hits), total + len(truth)
    return right / total


def test_exact_cut_gradients_reveal_every_label_and_noise_hides_most():
    assert _attack(0.0) == 1.0          # binary task, linear top: every gradient row is ±(w1 - w0)
    assert _attack(5.0) < 0.8           # noise far above the gradients' scale: near guessing
