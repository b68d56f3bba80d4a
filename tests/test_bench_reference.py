"""The benchmarks' plain-PyTorch reference loop does exactly the work of a fedcore FedAvg
course: same sampled clients, batches and weighted average, hence the same final model."""
import torch

from bench.common import LazyClientData, bench_cfg, bench_data, client_shard, max_abs_diff, \
    run_fedcore, run_plain


def _cfg(**kw):
    base = {"federate.client_num": 12, "federate.sample_client_num": 5,
            "federate.total_round_num": 3, "model.type": "logreg", "train.batch_size": 4,
            "train.optimizer.lr": 0.05, "torch_threads": 1}
    base.update(kw)
    return bench_cfg(**base)


def test_plain_reference_equals_fedcore_fedavg():
    data = bench_data(12, 10, seed=3, test_n=20)
    for cfg in (_cfg(**{"train.local_steps": 1}), _cfg(**{"train.local_epochs": 2})):
        fed, plain = run_fedcore(cfg, data), run_plain(cfg, data)
        assert max_abs_diff(fed.final_state, plain.final_state) == 0.0
        assert len(fed.wall_rounds) == len(plain.cpu_rounds) == 3


def test_plain_reference_equals_fedcore_scaffold_on_both_stores(tmp_path):
    data = bench_data(12, 10, seed=3, test_n=20)
    for store in ("memory", "disk"):
        cfg = _cfg(**{"train.local_steps": 2, "algorithm.name": "scaffold", "state.store": store,
                      "state.path": str(tmp_path / store)})
        fed, plain = run_fedcore(cfg, data), run_plain(cfg, data)
        assert max_abs_diff(fed.final_state, plain.final_state) == 0.0


def test_client_shards_depend_only_on_seed_plus_id():
    teacher = torch.randn(784, 10)
    a, b = client_shard(5, 2, 6, teacher), client_shard(4, 3, 6, teacher)   # 5+2 == 4+3
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    lazy = LazyClientData(5, 2, 6, teacher)
    assert torch.equal(lazy.train.x, a.x) and len(lazy.test) == 0


def test_time_to_accuracy_stops_both_loops_at_the_same_round_with_the_same_model():
    # W6's references at a small size: image shards, stop at the first round reaching the target
    data = bench_data(12, 20, seed=1, test_n=100, images=True)
    cfg = _cfg(**{"train.local_steps": 1, "federate.total_round_num": 30, "eval.freq": 1})
    target = 0.8   # reached after several rounds
    fed, plain = run_fedcore(cfg, data, until_acc=target), run_plain(cfg, data, until_acc=target)
    assert fed.accuracy == plain.accuracy
    assert plain.accuracy[-1] >= target and all(a < target for a in plain.accuracy[:-1])
    assert 1 < len(plain.wall_rounds) == len(fed.wall_rounds) < 30
    assert max_abs_diff(fed.final_state, plain.final_state) == 0.0


def test_lenet5_vectorized_stays_within_1e5_of_sequential_at_a_small_size():
    # W2's and W6's model under the vectorized executor, kept small
    data = bench_data(6, 16, seed=2, test_n=20, images=True)

    def cfg(executor):
        return _cfg(**{"federate.client_num": 6, "federate.sample_client_num": None,
                       "model.type": "lenet5", "train.local_epochs": 1, "train.batch_size": 8,
                       "executor": executor})
    courses = []
    seq = run_fedcore(cfg("sequential"), data)
    vec = run_fedcore(cfg("vectorized"), data, before_run=courses.append)
    assert courses[0].trainer.batched_fits > 0 and courses[0].trainer.sequential_fits == 0
    from fedcore.execution.client_conv import ClientConv2d   # on CPU, each client's own dense convolution
    assert any(isinstance(m, ClientConv2d) for m in courses[0].trainer.engine.model.modules())
    assert max_abs_diff(seq.final_state, run_plain(cfg("sequential"), data).final_state) == 0.0
    assert max_abs_diff(seq.final_state, vec.final_state) < 1e-5


def test_w6_measurement_reports_the_round_at_target_for_plain_and_fedcore(tmp_path):
    import argparse
    from bench.w6_time_to_accuracy import measure_one
    before = torch.get_num_threads()
    a = argparse.Namespace(target=0.3, clients=12, samples=20, per_round=4, max_rounds=30,
                           test_samples=100, threads=1, save=None)
    try:
        runs = {name: measure_one(name, a) for name in ("plain", "sequential")}
    finally:
        torch.set_num_threads(before)
    for r in runs.values():
        assert r["reached"] and r["acc"] >= 0.3 and r["wall_s"] > 0 and r["rss_mb"] > 0
    assert runs["plain"]["rounds"] == runs["sequential"]["rounds"] < 30
    assert runs["plain"]["acc"] == runs["sequential"]["acc"]
