"""What the server accepts from the network: content of the right shape for its type."""
import torch

from fedcore.comm.validation import check_content


class _Agg:
    def __init__(self):
        self.state = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}

    def broadcast(self, round_):
        return {"model": self.state}


class _Server:
    round = 1
    aggregator = _Agg()


def _update(**model):
    return {"model": model, "num_samples": 4}


def test_a_well_formed_update_passes():
    assert check_content("updates", _update(w=torch.ones(2, 3), b=torch.ones(3)), _Server()) is None


def test_malformed_updates_are_named():
    s = _Server()
    cases = {
        "a 'model' map": "not a map",
        "num_samples": {"model": {"w": torch.ones(2, 3), "b": torch.ones(3)}},
        "differ": _update(w=torch.ones(2, 3)),
        "expected (3,)": _update(w=torch.ones(2, 3), b=torch.ones(4)),
        "float64": _update(w=torch.ones(2, 3), b=torch.ones(3, dtype=torch.float64)),
        "non-finite": _update(w=torch.full((2, 3), float("nan")), b=torch.ones(3)),
    }
    for needle, content in cases.items():
        problem = check_content("updates", content, s)
        assert problem is not None and needle in problem, (needle, problem)
    neg = _update(w=torch.ones(2, 3), b=torch.ones(3))
    neg["num_samples"] = -1
    assert "non-negative" in check_content("updates", neg, s)


def test_join_in_and_metrics_shapes():
    s = _Server()
    assert check_content("join_in", {"client_id": 2}, s) is None
    assert check_content("join_in", {"client_id": "2"}, s) is not None
    assert check_content("join_in", {"client_id": 2, "blob": b"\x80\x04"}, s) is not None
    assert check_content("metrics", {"acc": 0.5, "loss": 1, "n": 3}, s) is None
    assert check_content("metrics", {"acc": "high"}, s) is not None
    assert check_content("metrics", {"acc": True}, s) is not None
    assert check_content("a_plugin_type", {"anything": 1}, s) is None  # no check registered


def _served(tmp_path, algorithm, **kw):
    """A built simulation's server: the layouts read its aggregator and config."""
    from fedcore.runtime.course import Course
    from tests.conftest import small_cfg
    return Course(small_cfg(tmp_path, algorithm__name=algorithm, **kw)).build().server


def test_scaffold_updates_carry_model_and_control_deltas(tmp_path):
    server = _served(tmp_path, "scaffold")
    model = server.aggregator.broadcast(1)["model"]
    control = server.aggregator.control
    good = {"delta": {k: torch.zeros_like(v) for k, v in model.items()},
            "delta_control": {k: torch.zeros_like(v) for k, v in control.items()}, "num_samples": 3}
    assert set(control) and check_content("updates", good, server) is None
    plain = {"model": {k: torch.zeros_like(v) for k, v in model.items()}, "num_samples": 3}
    assert "'delta' map" in check_content("updates", plain, server)
    name = sorted(control)[0]
    short = dict(good, delta_control={k: v for k, v in good["delta_control"].items() if k != name})
    assert f"missing ['{name}']" in check_content("updates", short, server)
    wrong = dict(good, delta_control=dict(good["delta_control"], **{name: torch.zeros(7)}))
    assert f"'delta_control.{name}' is (7,)" in check_content("updates", wrong, server)


def test_fedbuff_updates_split_floating_deltas_from_other_entries(tmp_path):
    server = _served(tmp_path, "fedbuff", asyn__use=True)
    model = server.aggregator.broadcast(1)["model"]
    good = {"delta": {k: torch.zeros_like(v) for k, v in model.items() if v.is_floating_point()},
            "model": {k: v for k, v in model.items() if not v.is_floating_point()}, "num_samples": 1}
    assert check_content("updates", good, server) is None
    assert "differ" in check_content("updates", dict(good, delta={}), server)


def test_diloco_optimizer_state_is_refused_on_the_wire(tmp_path):
    server = _served(tmp_path, "diloco", train__local_steps=2, train__preserve_optimizer_state=True)
    model = server.aggregator.broadcast(1)["model"]
    update = {"model": {k: v.clone() for k, v in model.items()}, "num_samples": 2}
    assert check_content("updates", update, server) is None
    leaky = dict(update, optimizer={k: torch.zeros_like(v) for k, v in model.items()})
    assert "unexpected entries ['optimizer']" in check_content("updates", leaky, server)
