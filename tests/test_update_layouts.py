"""What a deployed server accepts in an update is what the course declares: its algorithm's
`update_layout`, changed by its behaviours' declarations (FedEx's feedback), and nothing a
module adds to a table as it is imported."""
import pytest
import torch

from fedcore.comm.validation import CHECKS, check_content
from fedcore.kernel.contract import Aggregator, Algorithm, Trainer
from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.registry import algorithms
from tests.conftest import small_cfg

CANDIDATES = [{"train.optimizer.lr": 0.05}, {"train.optimizer.lr": 0.1}]


def _with_step(server) -> dict:
    """A plug-in's declaration: the model, and a step size as a float64 scalar."""
    return {"model": server.aggregator.broadcast(server.round)["model"],
            "step": {"eta": torch.zeros((), dtype=torch.float64)}}


algorithms.register("_test_declares_step", Algorithm(Trainer, Aggregator, update_layout=_with_step))


def test_an_algorithm_s_declared_layout_is_what_its_server_accepts():
    declared = Course(small_cfg(None, algorithm__name="_test_declares_step")).build().server
    plain = Course(small_cfg(None)).build().server
    model = dict(plain.aggregator.broadcast(1)["model"])
    with_step = {"model": model, "num_samples": 3, "step": {"eta": torch.tensor(0.5, dtype=torch.float64)}}
    assert check_content("updates", with_step, declared) is None
    assert check_content("updates", {"model": model, "num_samples": 3}, declared) == \
        "updates content needs a 'step' map of tensors"
    wrong = dict(with_step, step={"eta": torch.tensor(0.5)})
    assert check_content("updates", wrong, declared) == \
        "update entry 'step.eta' is () torch.float32, expected () torch.float64"
    # the course that declares nothing accepts the model alone, and not the other's step
    assert check_content("updates", {"model": model, "num_samples": 3}, plain) is None
    assert "unexpected entries ['step']" in check_content("updates", with_step, plain)


def test_the_built_in_checks_cannot_be_added_to():
    with pytest.raises(TypeError):
        CHECKS["a_plugin_type"] = lambda content, server: None  # type: ignore[index]


def _fedex_server(**kw):
    cfg = small_cfg(None, fedex__candidates=CANDIDATES, data__splits=[0.6, 0.2, 0.2], **kw)
    return Course(cfg).build().server


def test_a_fedex_server_admits_only_well_formed_feedback():
    server = _fedex_server()
    model = dict(server.aggregator.broadcast(1)["model"])
    assert set(server.aggregator.broadcast(1)) == {"model", "fedex_theta"}

    def update(**feedback):
        return {"model": model, "num_samples": 3, "fedex": feedback}
    assert check_content("updates", update(arm=1, loss=0.7, size=4), server) is None
    assert check_content("updates", update(arm=0, loss=2, size=0), server) is None   # an int loss is a number
    shape = ("update's 'fedex' feedback must be {arm: int in [0, 2), loss: finite number, "
             "size: int >= 0}")
    for bad in (dict(arm=2, loss=0.7, size=4), dict(arm=-1, loss=0.7, size=4),
                dict(arm=True, loss=0.7, size=4), dict(arm=1.0, loss=0.7, size=4),
                dict(arm=1, loss=float("nan"), size=4), dict(arm=1, loss=float("inf"), size=4),
                dict(arm=1, loss="0.7", size=4), dict(arm=1, loss=0.7, size=-1),
                dict(arm=1, loss=0.7), dict(arm=1, loss=0.7, size=4, before=0.9)):
        assert check_content("updates", update(**bad), server) == shape, bad
    assert check_content("updates", {"model": model, "num_samples": 3, "fedex": [1, 0.7, 4]}, server) == shape
    assert check_content("updates", {"model": model, "num_samples": 3}, server) == \
        "updates content needs a 'fedex' entry"
    # the model is still checked as in any course
    short = dict(update(arm=1, loss=0.7, size=4), model={k: v for k, v in list(model.items())[1:]})
    assert "differ from the global model's" in check_content("updates", short, server)


def test_fedex_with_diff_feedback_needs_the_loss_before_training():
    server = _fedex_server(fedex__diff=True)
    model = dict(server.aggregator.broadcast(1)["model"])
    good = {"model": model, "num_samples": 3, "fedex": {"arm": 0, "loss": 0.7, "size": 4, "before": 0.9}}
    assert check_content("updates", good, server) is None
    del good["fedex"]["before"]
    assert "before: finite number" in check_content("updates", good, server)


def test_compression_is_refused_where_a_behaviour_adds_to_the_update():
    with pytest.raises(ConfigError, match=r"compress.type: int8 cannot be used here \(fedex adds to the update\)"):
        small_cfg(compress__type="int8", fedex__candidates=CANDIDATES)
    with pytest.raises(ConfigError, match="algorithm.name _test_declares_step sends more than a model"):
        small_cfg(compress__type="int8", algorithm__name="_test_declares_step")
