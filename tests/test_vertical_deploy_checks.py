"""A deployed vertical course's active party refuses malformed party messages on the wire, and
its gradient noise comes from the operating system (seeded only in simulation)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("cryptography", reason="vertical courses need the 'vertical' extra (pip install 'fedcore[vertical]')")

from fedcore.algorithms.splitnn import BottomParty, TopParty  # noqa: E402
from fedcore.comm.validation import check_content  # noqa: E402
from fedcore.deployment.vertical_parties import PartyServerCourse  # noqa: E402
from fedcore.handlers import vertical as v  # noqa: E402
from fedcore.handlers.vertical_lr import setup_active  # noqa: E402
from fedcore.kernel.config import load_config  # noqa: E402
from fedcore.scenarios.vertical_data import party_table  # noqa: E402

BASE = {"seed": 1, "verbose": False, "data.type": "synthetic", "data.partition": "vertical",
        "data.synthetic.samples_per_client": 40, "data.synthetic.dim": 6, "data.synthetic.num_classes": 3,
        "federate.client_num": 4, "federate.total_round_num": 2, "data.test_size": 0.25,
        "vertical.parties": 2, "vertical.cut": 4, "model.dtype": "float64", "train.batch_size": 8}
DEPLOYED = {"federate.mode": "distributed", "distribute.role": "server", "distribute.insecure": True}


def _active(aligned: bool):
    cfg = load_config(None, extra={**BASE, **DEPLOYED})
    active = PartyServerCourse(cfg).build().server
    if aligned:   # the rows PSI would find: here every id both parties hold
        ids = sorted(set(active.table.ids) & set(party_table(cfg, 1).ids))
        v.align(active, ids)
        v.split_setup_active(active)
    return cfg, active


def _honest_activations(cfg, active, step: int) -> torch.Tensor:
    """What an honest passive party (the project's own bottom model) sends at `step`."""
    table = party_table(cfg, 1).aligned(active.train_rows.ids)
    return BottomParty(cfg, 1, table.x, table.x[:0]).forward(step).detach()


def test_honest_party_messages_pass_and_tampered_ones_are_refused():
    cfg, active = _active(aligned=True)
    h = _honest_activations(cfg, active, 0)
    assert check_content("activations", {"step": 0, "h": h}, active) is None
    nan = h.clone()
    nan[0, 0] = float("nan")
    refusals = {
        "non-finite": {"step": 0, "h": nan},
        "expected": {"step": 0, "h": torch.cat([h, h[:, :1]], dim=1)},          # a wider cut
        "float32": {"step": 0, "h": h.float()},                                   # another dtype
        "(9, 4)": {"step": 0, "h": torch.cat([h, h[:1]])},                        # an extra row
        "not a step": {"step": active.total_steps, "h": h},                       # past the course
        "must be": {"step": 0, "h": h, "extra": 1},
    }
    for why, content in refusals.items():
        problem = check_content("activations", content, active)
        assert problem is not None and why in problem, (why, problem)
    test_h = torch.zeros(len(active.test_rows.ids) + 1, cfg["vertical.cut"], dtype=torch.float64)
    assert "expected" in check_content("test_activations", {"h": test_h}, active)
    assert check_content("test_activations", {"h": test_h[1:]}, active) is None


def test_messages_before_alignment_are_bounded_by_a_batch():
    cfg, active = _active(aligned=False)
    ok = torch.zeros(cfg["train.batch_size"], cfg["vertical.cut"], dtype=torch.float64)
    assert check_content("activations", {"step": 0, "h": ok}, active) is None
    big = torch.zeros(cfg["train.batch_size"] + 1, cfg["vertical.cut"], dtype=torch.float64)
    assert "more than train.batch_size" in check_content("activations", {"step": 0, "h": big}, active)
    assert "step" in check_content("activations", {"step": -1, "h": ok}, active)


def test_psi_replies_must_be_32_byte_points():
    _cfg, active = _active(aligned=False)
    point = bytes(32)
    assert check_content("psi_reply", {"reblinded": [point], "own": [point]}, active) is None
    assert "32-byte" in check_content("psi_reply", {"reblinded": [bytes(33)], "own": []}, active)
    assert "must be" in check_content("psi_reply", {"reblinded": [point]}, active)


def _noise(cfg) -> torch.Tensor:
    """The noise one top step adds to party 1's cut gradient (noisy minus exact, same models)."""
    exact_cfg = cfg.with_overrides(vertical__gradient_noise=0.0)
    torch.manual_seed(0)
    x = torch.randn(256, 3, dtype=torch.float64)
    y = torch.randint(0, 3, (256,))
    grads = []
    for c in (exact_cfg, cfg):
        bottom = BottomParty(c, 0, x, x[:0])
        top = TopParty(c, 2, bottom, y, y[:0], 3)
        h = torch.ones(len(y), c["vertical.cut"], dtype=torch.float64)   # one batch: every row
        grads.append(top.step(0, {1: h})[0][1])
    return grads[1] - grads[0]


def test_gradient_noise_is_seeded_in_simulation_and_from_the_os_when_deployed():
    over = {**BASE, "train.batch_size": 256, "vertical.cut": 16, "vertical.gradient_noise": 0.5}
    sim = load_config(None, extra=over)
    assert torch.equal(_noise(sim), _noise(sim))   # reproducible from the seed
    dep = load_config(None, extra={**over, **DEPLOYED})
    a, b = _noise(dep), _noise(dep)
    assert not torch.equal(a, b) and not torch.equal(a, _noise(sim))
    # 4096 draws of N(0, 0.25): the sample std is within 5 standard errors (0.5/sqrt(2*4096)) of 0.5
    for n in (a, b):
        assert abs(n.std().item() - 0.5) < 5 * 0.5 / (2 * n.numel()) ** 0.5
        assert abs(n.mean().item()) < 5 * 0.5 / n.numel() ** 0.5


def test_he_lr_ciphertexts_must_lie_below_n_squared_in_the_keys_width():
    over = {**BASE, **DEPLOYED, "vertical.method": "he_lr", "vertical.he.key_bits": 256}
    cfg = load_config(None, extra=over)
    active = PartyServerCourse(cfg).build().server
    assert "before the Paillier key" in check_content("masked_gradient", {"step": 0, "c": [bytes(64)]}, active)
    ids = sorted(set(active.table.ids) & set(party_table(cfg, 1).ids))
    v.align(active, ids)
    sent = []
    active.send = lambda *a, **k: sent.append(a)   # the public key goes nowhere here
    setup_active(active)   # the course's own set-up: weights at zero, a fresh key pair
    nsquare = active.model.n ** 2
    width = (nsquare.bit_length() + 7) // 8
    honest = [(nsquare - 1).to_bytes(width, "big")]
    assert check_content("masked_gradient", {"step": 0, "c": honest}, active) is None
    assert "not below n^2" in check_content("masked_gradient", {"step": 0, "c": [b"\xff" * width]}, active)
    assert f"{width}-byte" in check_content("masked_gradient", {"step": 0, "c": [bytes(width + 1)]}, active)
    logits = torch.zeros(cfg["train.batch_size"], active.table.num_classes, dtype=torch.float64)
    assert check_content("partial_logits", {"step": 0, "h": logits}, active) is None
    assert "expected" in check_content("partial_logits", {"step": 0, "h": logits[:, 1:]}, active)
