"""FedBN keeps BatchNorm out of the payload; Ditto and fine-tuning personalize; performance_drop."""
import copy
import json

import pytest
import torch

from fedcore.algorithms.personalization import batchnorm_entries
from fedcore.kernel.contract import BatchStream, evaluate_model
from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.message import SERVER_ID, Message
from tests.conftest import small_cfg

SKEWED = dict(federate__client_num=8, federate__total_round_num=4,
              data__synthetic__samples_per_client=80, data__synthetic__iid=True,
              data__synthetic__dim=10, data__synthetic__num_classes=5, data__partition="dirichlet",
              data__alpha=0.1, data__min_size=20, model__type="mlp_bn", model__hidden=[16])


def _capture(course):
    sent = []
    course.comm.filters.append(lambda msg, receiver: sent.append((msg, receiver)) or True)
    return sent


def test_fedbn_keeps_batchnorm_out_of_the_payload():
    course = Course(small_cfg(None, personalization__method="fedbn", **SKEWED)).build()
    sent = _capture(course)
    init = {k: v.clone() for k, v in course.server.aggregator.global_state.items()}
    course.run()
    bn = batchnorm_entries(course.trainer.model)
    assert bn == {"2.weight", "2.bias", "2.running_mean", "2.running_var", "2.num_batches_tracked"}
    everything = set(init)
    models = [m for m, _ in sent if m.msg_type in ("models", "updates", "eval_request")]
    assert models and all(set(m.content["model"]) == everything - bn for m in models)
    # bytes: what the monitor counted is exactly the sizes of the messages sent ...
    training = [(m, r) for m, r in sent if m.msg_type not in course.monitor.separate_types]
    assert course.monitor.total_up == sum(m.nbytes_to(r) for m, r in training if r == SERVER_ID)
    assert course.monitor.total_down == sum(m.nbytes_to(r) for m, r in training if r != SERVER_ID)
    assert course.monitor.total_other == sum(m.nbytes_to(r) for m, r in sent) - \
        course.monitor.total_up - course.monitor.total_down
    # ... and each update is smaller than the same update with the BN entries by at least their data
    store = course.trainer.store
    bn_data = sum(init[k].numel() * init[k].element_size() for k in bn)
    for m, r in sent:
        if m.msg_type == "updates":
            local = store.load(m.sender)["local_params"]
            full = Message(m.msg_type, m.sender, r, m.round, m.timestamp,
                           dict(m.content, model={**m.content["model"], **local}))
            assert full.nbytes_to(r) - m.nbytes_to(r) >= bn_data
    # the server's BN entries never moved; the clients' own did, differently
    for k in bn:
        assert torch.equal(course.server.aggregator.global_state[k], init[k])
    means = [store.load(c)["local_params"]["2.running_mean"] for c in course.client_ids]
    assert not torch.equal(means[0], means[1]) and not torch.equal(means[0], init["2.running_mean"])


def test_fedbn_needs_batchnorm():
    with pytest.raises(ConfigError, match="fedbn needs a model with BatchNorm"):
        Course(small_cfg(None, personalization__method="fedbn")).build()


@pytest.mark.slow
def test_ditto_and_finetuning_raise_personalized_accuracy_on_a_skewed_split():
    def run(**kw):
        course = Course(small_cfg(None, **SKEWED, **kw))
        return course, course.run()
    _, fedavg = run()
    _, finetune = run(personalization__method="finetune")
    ditto_course, ditto = run(personalization__method="ditto", personalization__ditto_lambda=0.1)
    base = fedavg["final"]["client_test_acc_mean"]
    assert finetune["final"]["client_test_acc_mean"] > base + 0.1
    assert ditto["final"]["client_test_acc_mean"] > base + 0.1
    # neither touches the global model: same server accuracy as FedAvg
    assert finetune["final_test_acc"] == ditto["final_test_acc"] == fedavg["final_test_acc"]
    for key in ("client_test_acc_p10", "client_test_acc_std"):
        assert key in ditto["final"]


def _ditto_distance(lam: float) -> float:
    course = Course(small_cfg(None, personalization__method="ditto", personalization__ditto_lambda=lam,
                              **SKEWED))
    course.run()
    glob = course.server.aggregator.global_state
    total = 0.0
    for c in course.client_ids:
        personal = course.trainer.store.load(c)["ditto_model"]
        total += sum((personal[k] - glob[k]).pow(2).sum().item() for k in course.trainer.param_names)
    return total


def test_ditto_lambda_pulls_personal_models_toward_the_global_one():
    assert _ditto_distance(2.0) < 0.5 * _ditto_distance(0.0)


def test_performance_drop_marks_the_clients_that_raised_it():
    course = Course(small_cfg(None, personalization__method="finetune",
                              personalization__finetune_on="performance_drop", **SKEWED))
    summary = course.run()
    states = [course.trainer.store.load(c) for c in course.client_ids]
    raised = sum(s.get("performance_drops", 0) for s in states)
    assert summary["performance_drops"] == raised > 0
    assert {c for c, s in zip(course.client_ids, states) if s.get("personalize")} == \
        {c for c, s in zip(course.client_ids, states) if s.get("performance_drops")}
    graph = course.check().graph
    assert graph.has_edge("client:receiving_models", "client:performance_drop")


def test_no_drop_when_the_margin_cannot_be_exceeded():
    course = Course(small_cfg(None, personalization__drop_check=True, personalization__drop_margin=1.0,
                              **SKEWED))
    summary = course.run()
    assert "performance_drops" not in summary
    assert all("own_model" in course.trainer.store.load(c) for c in course.client_ids)


def test_bn_models_build_and_expose_their_batchnorm_entries():
    from fedcore.scenarios.bn_models import cnn_bn, mlp_bn
    cfg = small_cfg(None, model__hidden=[8, 4])
    cnn = cnn_bn(cfg, (8, 8), 10)
    assert cnn(torch.zeros(2, 8, 8)).shape == (2, 10) and cnn(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    assert len(batchnorm_entries(cnn)) == 10
    mlp = mlp_bn(cfg, (5,), 3).train()
    assert mlp(torch.randn(1, 5)).shape == (1, 3)  # a one-sample training batch is accepted
    assert batchnorm_entries(mlp) == {f"{i}.{n}" for i in (2, 5) for n in
                                      ("weight", "bias", "running_mean", "running_var",
                                       "num_batches_tracked")}


@pytest.mark.parametrize("algorithm", ["fedprox", "scaffold", "feddyn"])
def test_fedbn_composes_with_algorithms_that_keep_per_entry_state(algorithm):
    # Their regularised / corrected entries and server state follow FedBN's share rule.
    cfg = small_cfg(None, personalization__method="fedbn", algorithm__name=algorithm,
                    **dict(SKEWED, federate__total_round_num=2))
    course = Course(cfg).build()
    sent = _capture(course)
    init = {k: v.clone() for k, v in course.server.aggregator.global_state.items()}
    course.run()
    bn = batchnorm_entries(course.trainer.model)
    for m, _ in sent:
        if m.msg_type in ("models", "updates"):
            for part in m.content.values():
                if isinstance(part, dict):
                    assert not set(part) & bn      # neither the model nor control/delta entries
    agg = course.server.aggregator
    assert not set(getattr(agg, "control", {})) & bn and not set(getattr(agg, "h", {})) & bn
    for k in bn:
        assert torch.equal(agg.global_state[k], init[k])
    assert not torch.equal(agg.global_state["1.weight"], init["1.weight"])


def _record_fits(course) -> list[tuple[int, int]]:
    """(client, round) of every fit, in order (wrapping whatever fit the behaviours installed)."""
    fits, fit = [], course.trainer.fit
    course.trainer.fit = lambda cid, data, received, r: fits.append((cid, r)) or fit(cid, data, received, r)
    return fits


def _local_ditto_round(model, train, seed: int, r: int, cid: int, momentum: float, accum: int = 1) -> None:
    """Ditto's personal update of round `r` with lambda = 0: 3 SGD steps (lr 0.1) on the client's
    own loss, each on the mean loss over the next `accum` batches of 10 of its v-stream."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    batches = BatchStream(len(train), 10, seed * 1009 + 3 * r + 1, cid)
    model.train()
    for _ in range(3):
        idx = torch.cat([torch.as_tensor(batches.next()) for _ in range(accum)]) if accum > 1 else batches.next()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(train.x[idx]), train.y[idx]).backward()
        opt.step()


def test_ditto_lambda_zero_is_local_training_from_the_initial_model():
    # Li et al. 2021, Algorithm 1: every personal model v_k starts from w^0; with lambda = 0 its
    # update is plain SGD on the client's own loss, so v_k is local training from w^0.
    cfg = small_cfg(None, personalization__method="ditto", personalization__ditto_lambda=0.0,
                    federate__sample_client_num=3, train__local_steps=3,
                    train__optimizer__momentum=0.5, **dict(SKEWED, federate__total_round_num=5))
    course = Course(cfg).build()
    w0 = {k: v.clone() for k, v in course.server.aggregator.global_state.items()}
    fits = _record_fits(course)
    course.run()
    late = [c for c in course.client_ids if min((r for k, r in fits if k == c), default=1) > 1]
    assert late, "partial participation must leave some client's first round after the first"
    again = [c for c in course.client_ids if sum(k == c for k, _ in fits) > 1]
    assert again, "some client must train its personal model in several rounds"
    for cid in course.client_ids:
        model = copy.deepcopy(course.trainer.model)
        model.load_state_dict(w0)
        train = course.clients[cid].data.train
        for r in (r for k, r in fits if k == cid):       # the rounds this client was sampled in
            _local_ditto_round(model, train, cfg["seed"], r, cid, momentum=0.5)
        state = course.trainer.store.load(cid)
        if cid not in {k for k, _ in fits}:
            assert "ditto_model" not in state
            continue
        expected = model.state_dict()
        assert all(torch.equal(state["ditto_model"][k], expected[k]) for k in expected), cid


def test_each_rounds_personalized_evaluation_sees_the_personal_models_of_that_round(tmp_path):
    # With lambda = 0 each v_k is local training from w^0 over the rounds k was sampled in
    # (above). Round r's client_test_loss_mean is then the mean over clients of the loss of v_k
    # after its rounds <= r (w^0 for a client not yet sampled): a client sampled again in round
    # r+1 must be evaluated before it trains that round (the next round's smaller `models`
    # overtook the evaluation request in the simulation, so it was evaluated after).
    cfg = small_cfg(tmp_path, personalization__method="ditto", personalization__ditto_lambda=0.0,
                    federate__sample_client_num=3, train__local_steps=3, eval__clients=True,
                    **dict(SKEWED, federate__total_round_num=4))
    course = Course(cfg).build()
    w0 = {k: v.clone() for k, v in course.server.aggregator.global_state.items()}
    fits = _record_fits(course)
    course.run()
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    models = {}
    for cid in course.client_ids:
        model = copy.deepcopy(course.trainer.model)
        model.load_state_dict(w0)
        models[cid] = model
    again = [c for c in course.client_ids if sum(k == c for k, _ in fits) > 1]
    assert again, "some client must be sampled in two rounds"
    for r, record in enumerate(records, 1):
        for cid, model in models.items():
            if (cid, r) not in fits:
                continue
            _local_ditto_round(model, course.clients[cid].data.train, cfg["seed"], r, cid, momentum=0.0)
        losses = [evaluate_model(m, course.clients[c].data.test.x, course.clients[c].data.test.y,
                                 "cross_entropy")["loss"] for c, m in sorted(models.items())]
        assert record["client_test_loss_mean"] == pytest.approx(sum(losses) / len(losses), rel=1e-6), r


def test_a_ditto_personal_step_takes_the_trainers_micro_batches():
    # With train.grad_accum_steps = 2 a global step's gradient is that of the mean loss over two
    # micro-batches; a personal step is the same kind of step: the mean loss over the union of
    # the next two batches of the v-stream (here computed as one batch of 20: the same mean up
    # to float rounding; a model without BatchNorm, whose batch statistics would tell the two apart).
    cfg = small_cfg(None, personalization__method="ditto", personalization__ditto_lambda=0.0,
                    federate__sample_client_num=3, train__local_steps=3, train__grad_accum_steps=2,
                    train__optimizer__momentum=0.5,
                    **dict(SKEWED, federate__total_round_num=3, model__type="mlp"))
    course = Course(cfg).build()
    w0 = {k: v.clone() for k, v in course.server.aggregator.global_state.items()}
    fits = _record_fits(course)
    course.run()
    for cid in {k for k, _ in fits}:
        model = copy.deepcopy(course.trainer.model)
        model.load_state_dict(w0)
        for r in (r for k, r in fits if k == cid):
            _local_ditto_round(model, course.clients[cid].data.train, cfg["seed"], r, cid, momentum=0.5, accum=2)
        personal = course.trainer.store.load(cid)["ditto_model"]
        for k, v in model.state_dict().items():
            assert torch.allclose(personal[k], v, rtol=0, atol=1e-6), (cid, k)
        one_batch = copy.deepcopy(course.trainer.model)   # and not the old one micro-batch a step
        one_batch.load_state_dict(w0)
        for r in (r for k, r in fits if k == cid):
            _local_ditto_round(one_batch, course.clients[cid].data.train, cfg["seed"], r, cid, momentum=0.5)
        assert any((personal[k] - v).abs().max() > 1e-4 for k, v in one_batch.state_dict().items()), cid


def test_a_never_trained_ditto_client_is_evaluated_with_the_initial_model():
    cfg = small_cfg(None, personalization__method="ditto", **SKEWED)
    course = Course(cfg).build()
    w0 = {k: v.clone() for k, v in course.server.aggregator.global_state.items()}
    course.run()
    model = copy.deepcopy(course.trainer.model)
    model.load_state_dict(w0)
    test = course.clients[1].data.test
    expected = evaluate_model(model, test.x, test.y, "cross_entropy")
    course.trainer.store.save(1, {})             # as a client that was never sampled
    got = course.trainer.evaluate(1, course.clients[1].data, course.server.aggregator.broadcast(9))
    assert got == expected


def test_ditto_personal_models_survive_a_checkpoint(tmp_path):
    common = dict(personalization__method="ditto", federate__sample_client_num=3,
                  **dict(SKEWED, federate__total_round_num=4))
    full = Course(small_cfg(tmp_path / "full", checkpoint__every=2, **common))
    full.run()
    resumed = Course(small_cfg(tmp_path / "resumed", **common,
                               resume_from=str(tmp_path / "full" / "checkpoints" / "round_2.pt")))
    resumed.run()
    for cid in full.client_ids:
        a, b = full.trainer.store.load(cid), resumed.trainer.store.load(cid)
        assert ("ditto_model" in a) == ("ditto_model" in b)
        if "ditto_model" in a:
            assert all(torch.equal(a["ditto_model"][k], b["ditto_model"][k]) for k in a["ditto_model"])
