"""Streaming aggregation: the running sum equals the list-based mean, courses that fold equal
those that do not, rules that need every update keep the list, and a deployed server's
memory does not grow with the number of clients."""
import copy
import json
import random

import pytest
import torch

from fedcore.runtime.admission import finite_state
from fedcore.algorithms import streaming
from fedcore.algorithms.streaming import FoldingBuffer, RunningMean, round_buffer
from fedcore.kernel.contract import evaluate_model, weighted_mean
from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError, CourseDiverged
from fedcore.handlers.sync import collect_update
from fedcore.kernel.message import SERVER_ID, Message
from tests.conftest import small_cfg
from tests.deploy_helpers import text, wait_exit, wait_for, write_cfg


def _models(k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"w": torch.randn(6, 5, generator=g, dtype=torch.float64),
             "b": torch.randn(5, generator=g, dtype=torch.float32),
             "count": torch.randint(0, 100, (3,), generator=g)} for _ in range(k)]


def _exact_mean(models, weights, name):
    """sum w_i x_i / sum w_i, in float64, one product at a time (independent of the fold)."""
    total = sum(weights)
    return sum(m[name].double() * (w / total) for m, w in zip(models, weights))


def test_the_running_mean_is_the_weighted_mean_in_any_order():
    models, weights = _models(9), [3.0, 1.0, 7.0, 2.0, 5.0, 4.0, 8.0, 6.0, 9.0]
    order = list(range(9))
    random.Random(1).shuffle(order)            # updates arrive in any order
    running = RunningMean()
    for i in order:
        running.fold(models[i], weights[i])
    assert running.weight == sum(weights)
    mean = running.mean()
    assert (mean["w"] - _exact_mean(models, weights, "w")).abs().max() <= 1e-12
    assert mean["b"].dtype == torch.float32 and mean["count"].dtype == torch.int64
    # float32 entries: the exact mean rounded once; the list-based mean sums in float32
    assert torch.equal(mean["b"], _exact_mean(models, weights, "b").float())
    assert torch.allclose(mean["b"], weighted_mean([m["b"] for m in models], weights), rtol=1e-6, atol=1e-7)
    assert torch.equal(mean["count"], weighted_mean([m["count"] for m in models], weights))


def test_a_sum_kept_in_pieces_folds_and_casts_across_their_boundaries(monkeypatch):
    # pieces of 7 elements folded 3 at a time: slices straddle pieces, pieces end mid-tensor
    monkeypatch.setattr(streaming, "SUM_PIECE", 7)
    monkeypatch.setattr(streaming, "FOLD_STEP", 3)
    models, weights = _models(4, seed=5), [2.0, 5.0, 1.0, 3.0]
    running = RunningMean()
    for m, w in zip(models, weights):
        running.fold(m, w)
    assert [p.numel() for p in running.sum["w"]] == [7] * (models[0]["w"].numel() // 7) + \
        ([models[0]["w"].numel() % 7] if models[0]["w"].numel() % 7 else [])
    mean = running.mean()
    assert running.sum is None
    assert (mean["w"] - _exact_mean(models, weights, "w")).abs().max() <= 1e-12
    assert torch.equal(mean["b"], _exact_mean(models, weights, "b").float())
    assert torch.equal(mean["count"], weighted_mean([m["count"] for m in models], weights))


def test_a_sum_in_the_models_dtype_takes_half_the_memory_and_is_the_mean_to_its_rounding():
    models, weights = _models(9, seed=4), [3.0, 1.0, 7.0, 2.0, 5.0, 4.0, 8.0, 6.0, 9.0]
    running = RunningMean(in_model_dtype=True)
    for m, w in zip(models, weights):
        running.fold(m, w)
    assert [p.dtype for p in running.sum["b"]] == [torch.float32]      # a float32 entry: float32
    assert [p.dtype for p in running.sum["count"]] == [torch.float64]  # integers still in float64
    mean = running.mean()
    exact = _exact_mean(models, weights, "b")
    # nine float32 roundings of sums of terms of the same sign or not: within 1e-6 relative of
    # the largest partial sum, not bit-equal to the float64 mean rounded once
    scale = sum(w * m["b"].double().abs() for m, w in zip(models, weights)) / sum(weights)
    assert ((mean["b"].double() - exact).abs() <= 1e-6 * scale + 1e-12).all()
    assert torch.equal(mean["count"], weighted_mean([m["count"] for m in models], weights))


def test_zero_weights_average_uniformly_as_the_list_does():
    models = _models(3, seed=2)
    running = RunningMean()
    for m in models:
        running.fold(m, 0.0)
    assert (running.mean()["w"] - _exact_mean(models, [1, 1, 1], "w")).abs().max() <= 1e-12
    running = RunningMean()                     # a positive weight after zeros: zeros count nothing
    for m, w in zip(models, [0.0, 2.0, 0.0]):
        running.fold(m, w)
    assert torch.equal(running.mean()["w"], models[1]["w"])


def _final(tmp_path, name, **kw):
    course = Course(small_cfg(tmp_path / name, federate__total_round_num=3, **kw))
    course.run()
    return course


@pytest.mark.parametrize("algorithm", [
    {"algorithm__name": "fedavg"},
    {"algorithm__name": "fedprox", "server_optimizer__type": "adam"},
    {"algorithm__name": "diloco", "train__local_steps": 2, "train__preserve_optimizer_state": True},
    {"algorithm__name": "fedmos", "algorithm__fedmos__server_momentum": 0.5},
    {"algorithm__name": "fedavg", "federate__sample_client_num": 3, "server_optimizer__type": "sgdm"},
    {"algorithm__name": "fedavg", "aggregator__streaming_sum": "model"},
    {"algorithm__name": "scaffold"},     # the mean dy_i and the summed dc_i, both folded
    {"algorithm__name": "scaffold", "algorithm__scaffold__weighting": "num_samples",
     "federate__sample_client_num": 3, "data__synthetic__samples_per_client": None,
     "data__synthetic__max_samples": 200},
    {"algorithm__name": "feddyn"},       # the uniform mean; the drift |S| (mean - theta^{t-1})
    {"algorithm__name": "feddyn", "federate__sample_client_num": 3, "algorithm__feddyn__alpha": 0.3},
    # the (p_i / a_i)-weighted mean, the p-weighted mean of a_i (tau_eff) and the weights' totals
    {"algorithm__name": "fednova", "algorithm__fednova__straggler_fraction": 0.5,
     "data__synthetic__samples_per_client": None, "data__synthetic__max_samples": 200},
    {"algorithm__name": "fednova", "aggregator__weighting": "uniform", "train__local_steps": 3},
])
def test_a_folding_course_equals_the_list_based_one(tmp_path, algorithm):
    listed = _final(tmp_path, "list", aggregator__streaming="off", **algorithm)
    folded = _final(tmp_path, "fold", aggregator__streaming="on", **algorithm)
    assert isinstance(folded.server.buffer, FoldingBuffer) and isinstance(listed.server.buffer, list)
    for name, t in listed.server.aggregator.global_state.items():
        # the list sums in float32, the fold in float64: they agree to float32 rounding
        assert torch.allclose(folded.server.aggregator.global_state[name], t, rtol=1e-5, atol=1e-6), name
    rec = [json.loads(x) for x in (tmp_path / "fold" / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in (tmp_path / "list" / "metrics.jsonl").read_text().splitlines()]
    assert [r["num_updates"] for r in rec] == [r["num_updates"] for r in ref]
    if algorithm["algorithm__name"] == "scaffold":   # the server's control variate, from the summed dc_i
        for name, c in listed.server.aggregator.control.items():
            assert torch.allclose(folded.server.aggregator.control[name], c, rtol=1e-5, atol=1e-6), name
        assert max(c.abs().max().item() for c in folded.server.aggregator.control.values()) > 0
    if algorithm["algorithm__name"] == "fednova":
        taus = [(r["fednova_tau_eff"], q["fednova_tau_eff"]) for r, q in zip(rec, ref) if "fednova_tau_eff" in q]
        assert taus and all(a == pytest.approx(b, rel=1e-12) for a, b in taus)
        if "algorithm__fednova__straggler_fraction" in algorithm:   # the clients' a_i differ
            assert all(b != round(b) for _, b in taus)
    if algorithm["algorithm__name"] == "feddyn":   # the server's drift h, from the round's contributors
        for name, h in listed.server.aggregator.h.items():
            assert torch.allclose(folded.server.aggregator.h[name], h, rtol=1e-5, atol=1e-6), name
        assert max(h.abs().max().item() for h in folded.server.aggregator.h.values()) > 0


def test_uniform_weighting_folds_each_update_alike(tmp_path):
    # clients of 54 to 197 samples: uniform weighting is another mean than FedAvg's, and the
    # running sum folds with the aggregator's weights as the list-based mean does
    unequal = dict(data__synthetic__samples_per_client=None, data__synthetic__max_samples=1000,
                   aggregator__weighting="uniform", server_optimizer__type="adam")
    listed = _final(tmp_path, "list", aggregator__streaming="off", **unequal)
    folded = _final(tmp_path, "fold", aggregator__streaming="on", **unequal)
    weighted = _final(tmp_path, "weighted", aggregator__streaming="on",
                      **{**unequal, "aggregator__weighting": "num_samples"})
    assert isinstance(folded.server.buffer, FoldingBuffer)
    for name, t in listed.server.aggregator.global_state.items():
        assert torch.allclose(folded.server.aggregator.global_state[name], t, rtol=1e-5, atol=1e-6), name
    assert max((weighted.server.aggregator.global_state[n] - t).abs().max().item()
               for n, t in listed.server.aggregator.global_state.items()) > 1e-4


def test_rules_that_need_every_update_keep_the_list(tmp_path):
    with pytest.raises(ConfigError, match="aggregator.streaming"):
        Course(small_cfg(tmp_path / "a", aggregator__streaming="on", aggregator__robust_rule="median")).build()
    course = _final(tmp_path, "c", aggregator__streaming="auto", aggregator__robust_rule="median")
    assert isinstance(course.server.buffer, list)
    small = _final(tmp_path, "d")                 # auto: a small model keeps today's list
    assert isinstance(small.server.buffer, list)


def _update_message(course, sender, owned, value):
    model = {k: torch.full_like(v, value) for k, v in course.server.aggregator.global_state.items()}
    return model, Message("updates", sender, (SERVER_ID,), 1, 0.0, {"model": model, "num_samples": 10},
                          owned=owned)


def test_a_folded_update_received_over_the_wire_is_let_go_before_the_round_aggregates(tmp_path):
    """The last update's handler runs the aggregation: a deployed server's own decoded copy
    (`owned`) gives its model up once folded; a simulation's, shared with its sender, is kept."""
    course = Course(small_cfg(tmp_path, aggregator__streaming="on")).build()
    server = course.server
    server.round, server.selected = 1, {1, 2, 3}
    server.buffer = round_buffer(server)
    model1, wire = _update_message(course, 1, True, 2.0)
    model2, shared = _update_message(course, 2, False, 4.0)
    collect_update(server, wire)
    collect_update(server, shared)
    assert "model" not in wire.content and wire.content["num_samples"] == 10
    assert shared.content["model"] is model2
    assert server.selected == {3}                       # no aggregation yet
    for name, pieces in server.buffer.running.sum.items():   # both folded, weight 10 each
        assert torch.equal(torch.cat(pieces).view(model1[name].shape),
                           10 * model1[name].double() + 10 * model2[name].double()), name


def test_a_folding_round_that_diverges_keeps_the_last_finite_model(tmp_path):
    """A folding round's snapshot holds the previous global tensors, not a copy: a non-finite
    aggregate puts them back (the simulation then stops as diverged with a finite model)."""
    course = Course(small_cfg(tmp_path, aggregator__streaming="on", model__type="mlp",
                              train__optimizer__lr=1000.0, federate__total_round_num=8))
    with pytest.raises(CourseDiverged):
        course.run()
    assert isinstance(course.server.buffer, FoldingBuffer)
    assert finite_state(course.server.aggregator.global_state)


def test_the_servers_module_views_the_global_model_and_a_simulations_trainer_has_its_own(tmp_path):
    from fedcore.deployment.distributed import ServerCourse
    from fedcore.handlers.evaluation import evaluate_global
    cfg = small_cfg(tmp_path / "d", model__type="mlp", distribute__role="server", distribute__insecure=True,
                    distribute__server_host="127.0.0.1", distribute__server_port=0)
    deployed = ServerCourse(cfg).build().server
    sim = Course(small_cfg(tmp_path / "s", model__type="mlp")).build().server

    def shares(server):
        module = server.model.state_dict()
        return {n: module[n].data_ptr() == t.data_ptr() for n, t in server.aggregator.global_state.items()}
    assert all(shares(deployed).values()) and all(shares(sim).values())
    # the simulation's trainer trains in a module of its own, not in the server's
    trained = {t.data_ptr() for t in sim.course.trainer.model.state_dict().values()}
    assert not trained & {t.data_ptr() for t in sim.model.state_dict().values()}
    # a new global model (as an aggregation makes): evaluated in place, scored as a copy would be
    g = torch.Generator().manual_seed(3)
    deployed.aggregator.global_state = {n: torch.randn(t.shape, generator=g)
                                        for n, t in deployed.aggregator.global_state.items()}
    reference = copy.deepcopy(deployed.model)
    reference.load_state_dict(deployed.aggregator.global_state)
    test = deployed.course.data.server_test
    expected = evaluate_model(reference, test.x, test.y, "cross_entropy", 1024)
    metrics = evaluate_global(deployed)
    assert all(shares(deployed).values())
    assert metrics["test_loss"] == expected["loss"] and metrics["test_acc"] == expected["acc"]


# ---------------------------------------------------------------- a deployed server's memory
MODEL_MB = 17
HIDDEN = MODEL_MB * 2 ** 20 // 4 // 69          # an MLP 64 -> HIDDEN -> 3 holds ~69 HIDDEN floats


def _server_peak(tmp_path, procs, name: str, clients: int, streaming: str, hidden: int = HIDDEN,
                 **extra) -> int:
    """Peak RSS (bytes) of a deployed server aggregating `clients` updates of the MLP, sent by
    the protocol's load generator (bench/fleet.py: every client in one process, each
    returning the model it received, so a round costs the clients no training)."""
    cfg = write_cfg(tmp_path / f"{name}.yaml", {
        "federate.client_num": clients, "federate.total_round_num": 1, "eval.clients": False,
        "data.synthetic.dim": 64, "data.synthetic.samples_per_client": 2, "model.type": "mlp",
        "model.hidden": [hidden], "aggregator.streaming": streaming,
        "admission.norm_ratio": float("inf"), "distribute.insecure": True, "distribute.token": "t", **extra})
    out, peak = tmp_path / name, tmp_path / f"{name}.rss"
    server = procs.start(f"{name}_server", ["-m", "bench.peak_rss", str(peak), "fedcore.run", "--cfg",
                                            str(cfg), "federate.mode=distributed", "distribute.role=server",
                                            "distribute.server_port=0", f"outdir={out}"])
    port = int(wait_for(lambda: (out / "server_address").exists() and (out / "server_address").read_text(),
                        120, "the server").strip().rsplit(":", 1)[1])
    fleet = procs.start(f"{name}_fleet", ["-m", "bench.fleet", "--port", str(port), "--count", str(clients),
                                          "--token", "t", "--num-samples", "2"])
    assert wait_exit(server, 300) == 0, text(server)[-3000:]
    assert wait_exit(fleet, 60) == 0, text(fleet)[-3000:]
    return int(peak.read_text())


@pytest.mark.slow
@pytest.mark.alone   # what gRPC buffers at once follows how the processes are scheduled
def test_a_deployed_servers_memory_does_not_grow_with_the_clients(tmp_path, procs):
    model = MODEL_MB * 2 ** 20
    few = _server_peak(tmp_path, procs, "fold4", 4, "on")
    many = _server_peak(tmp_path, procs, "fold16", 16, "on")
    listed = _server_peak(tmp_path, procs, "list16", 16, "off")
    # 12 more updates: the list holds them (12 models more); the running sum does not, received
    # tensors are views of the received bytes, large messages take turns (comm/turns.py), and a
    # client waiting for its turn holds about twice distribute.stream_window (256 KiB) in the
    # server (measured on 2 shared cores: 490 and 499 MB folding; with gRPC's own window, 7.8 MB
    # a waiting client): twelve more clients cost less than one model
    assert many - few < 1.0 * model, (few, many, listed)
    assert listed - many > 8.0 * model, (few, many, listed)


@pytest.mark.slow
@pytest.mark.alone   # peaks compared between two runs: another worker's load would land on one only
def test_a_spooled_update_and_the_parked_model_are_no_models_of_the_servers_peak(tmp_path, procs):
    # A 64 MiB model, 2 clients, one round. Held in memory, the update being folded is one
    # model on top of the global model and the float64 sum (two models); spooled to the
    # outdir's disk and read a slice at a time, its pages go back as they are folded, and the
    # global model waits in a file while the round collects (runtime/parking.py): two models
    # fewer, the float64 sum left
    model = 64 * 2 ** 20
    hidden = model // 4 // 69
    spooled = _server_peak(tmp_path, procs, "spooled", 2, "on", hidden)
    in_memory = _server_peak(tmp_path, procs, "in_memory", 2, "on", hidden, **{"distribute.spool_bytes": 0})
    assert in_memory - spooled > 1.5 * model, (spooled, in_memory)
