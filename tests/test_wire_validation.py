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
