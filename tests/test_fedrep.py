"""FedRep against hand-computed steps on a two-layer linear model, and its limiting cases."""
import numpy as np
import pytest
import torch
from torch import nn

from fedcore.algorithms.fedrep import head_entries
from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from tests import drift_problem as P
from tests.conftest import small_cfg

PHI0, A0, C0 = np.array([0.3, -0.2]), 0.7, 0.1     # representation z = phi.x; head y = a z + c
HEAD_STEPS = 2


def two_layer_model() -> nn.Module:
    model = nn.Sequential(nn.Flatten(), nn.Linear(2, 1, bias=False), nn.Linear(1, 1)).double()
    with torch.no_grad():
        model[1].weight.copy_(torch.tensor(PHI0).reshape(1, 2))
        model[2].weight.fill_(A0)
        model[2].bias.fill_(C0)
    return model


def _residual(k, phi, a, c):
    x, y = P.arrays(k)[0][:, :2], P.arrays(k)[1]
    z = x @ phi
    return x, z, a * z + c - y


def _client_round(k, phi, a, c, head_first=True):
    """Algorithm 1 of the paper for one client: tau_h head steps, then tau_phi representation
    steps, full-batch gradients of the mean squared error written out by hand."""
    def head_steps(phi, a, c):
        for _ in range(HEAD_STEPS):
            _, z, e = _residual(k, phi, a, c)
            n = len(e)
            a, c = a - P.LR * 2 / n * (e @ z), c - P.LR * 2 / n * e.sum()
        return a, c

    def rep_steps(phi, a, c):
        for _ in range(P.STEPS):
            x, _, e = _residual(k, phi, a, c)
            phi = phi - P.LR * 2 / len(e) * a * (x.T @ e)
        return phi
    if head_first:
        a, c = head_steps(phi, a, c)
        return rep_steps(phi, a, c), a, c
    phi = rep_steps(phi, a, c)
    return (phi, *head_steps(phi, a, c))


def _reference(rounds, head_first=True, weighted=False):
    phi, heads = PHI0.copy(), {k: (A0, C0) for k in (1, 2, 3)}
    for clients in rounds:
        local = {}
        for k in clients:
            local[k], *heads[k] = _client_round(k, phi, *heads[k], head_first=head_first)
        w = np.array([P.n_samples(k) if weighted else 1.0 for k in clients])
        phi = sum(w[i] * local[k] for i, k in enumerate(clients)) / w.sum()
    return phi, heads


def test_fedrep_two_rounds_match_hand_computation():
    cfg = P.config("fedrep", algorithm__fedrep__head_steps=HEAD_STEPS)
    trainer, agg = P.build(cfg, two_layer_model())
    rounds = [(1, 2, 3), (1, 3)]                      # client 2 sits out round 2: its head stays
    for r, clients in enumerate(rounds, 1):
        results = P.run_round(trainer, agg, r, clients)
        for k, res in results.items():
            assert set(res.content["model"]) == {"1.weight"}            # the head is never sent
            assert res.work == (HEAD_STEPS + P.STEPS) * P.n_samples(k)
    phi, heads = _reference(rounds)
    np.testing.assert_allclose(agg.global_state["1.weight"].numpy().ravel(), phi, rtol=0, atol=1e-12)
    for k in (1, 2, 3):
        local = trainer.store.load(k)["local_params"]
        got = (local["2.weight"].item(), local["2.bias"].item())
        np.testing.assert_allclose(got, heads[k], rtol=0, atol=1e-12)
    # the test would notice the representation trained first, or a sample-weighted average
    assert np.abs(_reference(rounds, head_first=False)[0] - phi).max() > 1e-4
    assert np.abs(_reference(rounds, weighted=True)[0] - phi).max() > 1e-4
    # the server never moved the head it started with
    assert agg.global_state["2.weight"].item() == A0 and agg.global_state["2.bias"].item() == C0


def test_a_client_is_evaluated_with_its_own_head():
    cfg = P.config("fedrep", algorithm__fedrep__head_steps=HEAD_STEPS)
    trainer, agg = P.build(cfg, two_layer_model())
    P.run_round(trainer, agg, 1, (1, 2))
    phi, heads = _reference([(1, 2)])
    _, _, e = _residual(1, phi, *heads[1])
    got = trainer.evaluate(1, P.client_data(1), agg.broadcast(2))
    assert got["loss"] == pytest.approx(np.mean(e ** 2), abs=1e-12)


def test_the_default_head_is_the_last_layer_with_parameters():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.BatchNorm1d(4), nn.Linear(4, 2), nn.ReLU())
    assert head_entries(model, None) == {"3.weight", "3.bias"}
    assert head_entries(model, ["2.*"]) == {"2.weight", "2.bias", "2.running_mean", "2.running_var",
                                            "2.num_batches_tracked"}
    assert head_entries(model, []) == set()
    with pytest.raises(ConfigError, match=r"algorithm.fedrep.head: pattern '4\.\*' matches no entry"):
        head_entries(model, ["4.*"])


def test_a_one_layer_model_has_no_representation_to_share():
    with pytest.raises(ConfigError, match="takes every trainable parameter of model.type logreg"):
        Course(small_cfg(None, algorithm__name="fedrep")).build()


def test_no_head_is_fedavg_exactly(tmp_path):
    # Nothing local and no head steps: tau_phi steps of SGD on the whole model and the plain
    # average, which is FedAvg's sample-weighted one when every client holds as many samples.
    common = dict(model__type="mlp", model__hidden=[6], federate__total_round_num=3,
                  federate__sample_client_num=4)
    a = Course(small_cfg(tmp_path / "a", algorithm__name="fedrep", algorithm__fedrep__head=[], **common))
    b = Course(small_cfg(tmp_path / "b", algorithm__name="fedavg", **common))
    sa, sb = a.run(), b.run()
    assert len({len(c.data.train) for c in a.clients.values()}) == 1   # equal sizes: the premise
    ma = torch.load(tmp_path / "a" / "final_model.pt", weights_only=True)
    mb = torch.load(tmp_path / "b" / "final_model.pt", weights_only=True)
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in mb)
    assert sa["virtual_time"] == sb["virtual_time"] and sa["bytes_up"] == sb["bytes_up"]


def test_no_head_steps_leave_every_head_at_the_initial_one():
    cfg = small_cfg(None, algorithm__name="fedrep", algorithm__fedrep__head_steps=0, model__type="mlp",
                    model__hidden=[6], federate__total_round_num=2)
    course = Course(cfg).build()
    init = {k: v.clone() for k, v in course.server.aggregator.global_state.items()}
    course.run()
    glob = course.server.aggregator.global_state
    assert head_entries(course.trainer.model, None) == {"3.weight", "3.bias"}
    for cid in course.client_ids:
        local = course.trainer.store.load(cid)["local_params"]
        assert set(local) == {"3.weight", "3.bias"}
        assert all(torch.equal(local[k], init[k]) for k in local)
    assert not torch.equal(glob["1.weight"], init["1.weight"])    # the representation trained
