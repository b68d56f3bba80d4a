"""Attack simulation: the poisoning transforms, and their effect on FedAvg vs robust rules."""
import json

import pytest
import torch

from fedcore.algorithms.attacks import (add_trigger, drift_update, fixed_direction, flip_labels,
                                        gaussian_update, scale_update, sign_flip)
from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from tests.conftest import small_cfg


def test_flip_labels_and_triggers():
    assert flip_labels(torch.tensor([0, 1, 2]), 3).tolist() == [2, 1, 0]
    vec = add_trigger(torch.zeros(2, 5), 2, 7.0)
    assert vec.tolist() == [[0, 0, 0, 7, 7]] * 2
    img = add_trigger(torch.zeros(1, 1, 4, 4), 2, 1.0)
    assert img[0, 0].tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]


def test_update_poisoning_by_hand():
    ref = {"w": torch.tensor([1.0, 1.0]), "n": torch.tensor(3)}
    trained = {"w": torch.tensor([2.0, 0.0]), "n": torch.tensor(3)}   # delta (1, -1)
    assert sign_flip(trained, ref, 4.0)["w"].tolist() == [-3.0, 5.0]
    assert scale_update(trained, ref, 10.0)["w"].tolist() == [11.0, -9.0]
    noise = gaussian_update({"w": torch.zeros(100_000)}, {"w": torch.zeros(100_000)}, 2.0,
                            torch.Generator().manual_seed(0))["w"]
    assert noise.std().item() == pytest.approx(2.0, rel=0.02)
    assert sign_flip(trained, ref, 1.0)["n"].item() == 3  # integer entries untouched


def test_drift_update_by_hand():
    ref = {"w": torch.tensor([1.0, 1.0]), "b": torch.tensor([0.0]), "n": torch.tensor(3)}
    trained = {"w": torch.tensor([4.0, 1.0]), "b": torch.tensor([4.0]), "n": torch.tensor(3)}  # |delta| = 5
    e = {"w": torch.tensor([0.6, 0.0], dtype=torch.float64), "b": torch.tensor([0.8], dtype=torch.float64)}
    out = drift_update(trained, ref, 7.0, e)   # w + 7 x 5 x e
    assert out["w"].tolist() == [1.0 + 21.0, 1.0] and out["b"].tolist() == [28.0] and out["n"].item() == 3
    d = fixed_direction({"w": torch.zeros(30), "n": torch.tensor(1)}, torch.Generator().manual_seed(4))
    assert list(d) == ["w"] and d["w"].norm().item() == pytest.approx(1.0)
    again = fixed_direction({"w": torch.zeros(30)}, torch.Generator().manual_seed(4))
    assert torch.equal(d["w"], again["w"])


def _course(tmp_path=None, **kw):
    base = dict(federate__client_num=10, federate__total_round_num=10,
                data__synthetic__samples_per_client=100, data__synthetic__iid=True,
                data__synthetic__dim=10, data__synthetic__num_classes=3, eval__clients=False)
    base.update(kw)
    return Course(small_cfg(tmp_path, **base))


@pytest.mark.slow
def test_sign_flipping_hurts_fedavg_but_not_median_or_krum():
    attack = dict(attack__type="sign_flip", attack__fraction=0.2, attack__scale=4.0)
    clean = _course().run()["final_test_acc"]
    fedavg = _course(**attack).run()
    median = _course(aggregator__robust_rule="median", **attack).run()["final_test_acc"]
    krum = _course(aggregator__robust_rule="krum", aggregator__byzantine_num=2, **attack).run()
    assert fedavg["attackers"] == [1, 5]          # 20% of 10 clients, seeded
    assert fedavg["final_test_acc"] < clean - 0.15
    assert median >= clean - 0.03
    assert krum["final_test_acc"] >= clean - 0.03
    assert not set(krum["final"]["robust_selected"]) & {1, 5}


@pytest.mark.slow
def test_backdoor_success_is_reported_and_norm_bounding_reduces_it(tmp_path):
    bd = dict(attack__type="backdoor", attack__fraction=0.2, attack__scale=5.0, attack__target_label=1,
              attack__trigger_size=2, attack__trigger_value=1.5, model__type="mlp", model__hidden=[32])
    course = _course(tmp_path, **bd)
    plain = course.run()
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all("backdoor_acc" in r and "test_acc" in r for r in records)
    bounded = _course(aggregator__robust_rule="norm_bound", aggregator__norm_bound=0.3, **bd).run()
    assert plain["final_backdoor_acc"] > 0.9
    assert bounded["final_backdoor_acc"] < plain["final_backdoor_acc"] - 0.3


def test_attack_needs_its_clients():
    with pytest.raises(ConfigError, match="attack.clients=\\[ids\\] or attack.fraction"):
        small_cfg(None, attack__type="sign_flip")


def test_attackers_get_a_derived_role(tmp_path):
    course = _course(tmp_path, federate__total_round_num=1, attack__type="label_flip",
                     attack__clients=[2, 3]).build()
    roles = {cid: c.handlers.role for cid, c in course.clients.items()}
    assert {c for c, r in roles.items() if r == "attacker"} == {2, 3}
    course.run()
    text = (tmp_path / "handlers.txt").read_text()
    assert "[attacker]" in text and "attack_and_reply" in text and "overwritten" not in text


def _drift_course(**kw):
    """The synthetic course of the tests with 5 clients for 30 rounds, admission's 10x bound on;
    iid and 100 samples a client, so that one client's data is worth little (a client sending
    nothing costs nothing here) and 100 test samples measure accuracy to 0.01."""
    cfg = small_cfg(None, federate__client_num=5, federate__total_round_num=30, eval__clients=False,
                    admission__norm_ratio=10.0, data__synthetic__iid=True,
                    data__synthetic__samples_per_client=100, **kw)
    return Course(cfg).run()


@pytest.mark.slow
def test_a_drifting_client_under_admissions_bound_is_held_by_centered_clipping():
    """7x its own honest update's norm along one fixed direction, every round: admission never
    refuses it and FedAvg loses more than 0.05; centered clipping keeps it within 0.05."""
    honest = _drift_course()["final_test_acc"]
    for attacker in ([1], [3]):
        drift = dict(attack__type="drift", attack__clients=attacker)
        plain = _drift_course(**drift)
        assert "admission" not in plain                     # every update admitted
        assert plain["final_test_acc"] < honest - 0.05
        held = _drift_course(aggregator__robust_rule="centered_clip", aggregator__cc_tau=0.1, **drift)
        assert held["final_test_acc"] >= honest - 0.05, (attacker, held["final_test_acc"], honest)


def test_a_backdoor_round_that_diverges_keeps_the_last_finite_model(tmp_path):
    """The backdoor metric evaluates the new model in the server's module by viewing it, not by
    copying it into the module's tensors: those are the previous model's, which a folding
    round's snapshot holds (not a copy) to put back when the new one is not finite."""
    from fedcore.algorithms.streaming import FoldingBuffer
    from fedcore.kernel.errors import CourseDiverged
    from fedcore.runtime.admission import finite_state
    course = Course(small_cfg(tmp_path, attack__type="backdoor", attack__fraction=0.2, attack__target_label=1,
                              attack__trigger_size=2, attack__trigger_value=1.5, model__type="mlp",
                              aggregator__streaming="on", train__optimizer__lr=1000.0,
                              federate__total_round_num=8))
    with pytest.raises(CourseDiverged):
        course.run()
    assert isinstance(course.server.buffer, FoldingBuffer)
    assert finite_state(course.server.aggregator.global_state)
