"""Central DP folded (algorithms/dp_fold.py): each update's clipped delta joins a running float64
sum as it arrives. The noise drawn a block at a time is one whole draw's; the fold is the
hand-computed clipped sum; a folding course equals the list-based one bit for bit where the
updates are folded in the same order (and to a derived bound where they are not), spilled,
with adaptive clipping, a server optimizer, empty and refused rounds."""
import gc
import json
import os

import pytest
import torch

from fedcore.algorithms import dp_fold, streaming
from fedcore.algorithms.dp import central_dp_rule
from fedcore.algorithms.dp_fold import ClippedSum, FoldingRule, NoiseStream
from fedcore.algorithms.dp_noise import OS_NOISE
from fedcore.algorithms.streaming import FoldingBuffer
from fedcore.kernel.errors import ConfigError, CourseDiverged
from fedcore.runtime import admission
from fedcore.runtime.course import Course
from fedcore.wire.spooled import is_mapped
from tests.conftest import small_cfg
from tests.test_sim_memory import _LIBC, BIG, BIG_BYTES, LARGE, _resident

SIZES = list(range(1, 41)) + [47, 48, 49, 63, 64, 65, 100, 1007, 4096, 4097, 65_539, 100_003]


@pytest.mark.parametrize("block", [16, 32, 48, 1024])
def test_noise_drawn_a_block_at_a_time_is_one_whole_draw(block):
    for numel in SIZES:
        whole_gen, stream_gen = torch.Generator().manual_seed(numel), torch.Generator().manual_seed(numel)
        whole = torch.randn(numel, generator=whole_gen, dtype=torch.float64)
        stream, parts, at, step = NoiseStream(numel, stream_gen, block), [], 0, 1
        while at < numel:                         # slices of 1, 2, 3, ... values, across the blocks
            n = min(step, numel - at)
            parts.append(stream.take(n))
            at, step = at + n, step % 37 + 1
        assert torch.equal(torch.cat(parts), whole), (numel, block)
        # and the generator is left where the whole draw leaves it (adaptive clipping's count next)
        assert torch.equal(torch.randn(1, generator=stream_gen, dtype=torch.float64),
                           torch.randn(1, generator=whole_gen, dtype=torch.float64)), (numel, block)


def test_a_last_block_under_16_values_would_not_be_the_whole_draw():
    # why the stream merges such a tail into the block before it: 33 = 16 + 16 + 1 differs
    whole = torch.randn(33, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    naive = torch.cat([torch.randn(n, generator=g, dtype=torch.float64) for n in (16, 16, 1)])
    assert not torch.equal(naive, whole)
    with pytest.raises(ValueError):
        NoiseStream(10, g, block=24)


def test_the_fold_is_the_clipped_sum_by_hand(monkeypatch):
    monkeypatch.setattr(streaming, "SUM_PIECE", 4)   # slices straddle the pieces and the entries
    monkeypatch.setattr(streaming, "FOLD_STEP", 3)
    base = {"w": torch.ones(5), "b": torch.full((2,), 2.0), "n": torch.tensor(7)}
    # deltas: norm 13 (3, 4, 12) -> clipped to C = 6.5 (a half), norm 1 -> kept; binary-exact values
    one = {"w": base["w"] + torch.tensor([3.0, 4.0, 0.0, 0.0, 12.0]), "b": base["b"].clone(), "n": torch.tensor(9)}
    two = {"w": base["w"].clone(), "b": base["b"] + torch.tensor([0.0, -1.0]), "n": torch.tensor(1)}
    total = ClippedSum()
    assert total.add(one, base, 6.5, 1, 10.0) == 13.0 and total.add(two, base, 6.5, 2, 0.0) == 1.0
    got = {n: torch.cat(p) for n, p in total.sum.items()}
    assert got["w"].tolist() == [1.5, 2.0, 0.0, 0.0, 6.0] and got["b"].tolist() == [0.0, -1.0]
    assert (total.clipped, total.below, total.present, total.weight) == (1, 1, 2, 10.0)
    rule = central_dp_rule(6.5, 0.0, 0, expected=4)
    model, metrics = rule.combined(total, 1, base)
    assert list(model) == ["w", "b", "n"] and metrics == {"dp_clipped": 1}
    assert model["w"].tolist() == [1 + 1.5 / 4, 1.5, 1.0, 1.0, 2.5] and model["b"].tolist() == [2.0, 1.75]
    assert model["n"].item() == 7 and model["w"].dtype == torch.float32   # integers: the global's


def test_the_folded_noise_is_the_list_rules_draws_and_the_server_model_takes_no_update():
    base = {"w": torch.zeros(40, dtype=torch.float64)}
    rule = central_dp_rule(1.0, 2.0, 5, expected=3)
    total = rule.start()
    rule.fold(total, {"w": torch.zeros(40, dtype=torch.float64)}, base, 0)   # an empty round's
    model, metrics = rule.combined(total, 2, base)
    z = torch.randn(40, generator=torch.Generator().manual_seed((5 * 1_000_003) * 100_003 + 2 + 7),
                    dtype=torch.float64)
    assert torch.equal(model["w"], z * 2.0 / 3) and metrics == {"dp_clipped": 0}
    assert total.present == 0   # the server's own model is not a participant


def test_os_noise_is_drawn_a_block_at_a_time_fresh_each_release(monkeypatch):
    monkeypatch.setattr(dp_fold, "NOISE_BLOCK", 4096)
    rule = central_dp_rule(2.0, 1.5, lambda round_: OS_NOISE, expected=1)
    base = {"w": torch.zeros(50_000, dtype=torch.float64)}
    released = []
    for _ in range(2):
        total = rule.start()
        rule.fold(total, base, base, 1)     # a zero delta: what is released is the noise alone
        released.append(rule.combined(total, 1, base)[0]["w"])
    # std sigma C = 3 (to 2%: 6.7 standard errors of 50,000 draws), mean 0, no two releases alike
    assert released[0].std().item() == pytest.approx(3.0, rel=0.02) and abs(released[0].mean().item()) < 0.08   # 6 standard errors
    assert not (released[0] == released[1]).any()


def test_another_fold_order_is_the_same_sum_to_float64_rounding():
    torch.manual_seed(0)
    base = {"w": torch.randn(3000)}
    models = [{"w": base["w"] + torch.randn(3000) * s} for s in (0.001, 0.01, 0.02, 0.05)]
    rule = central_dp_rule(0.5, 1.0, 1, expected=4)
    results = []
    for order in (models, models[::-1]):
        total = rule.start()
        for i, m in enumerate(order):
            rule.fold(total, m, base, i + 1)
        results.append(rule.combined(total, 1, base)[0]["w"])
    # the float64 sums of the same 4 clipped terms (|each entry| <= C = 0.5) in two orders differ
    # by at most 3 roundings of values below 4 C: 3 * 2^-53 * 2, far below half a float32 ulp of
    # g + mean, so the cast to float32 differs by at most one ulp of the result
    ulp = torch.finfo(torch.float32).eps * torch.maximum(results[0].abs(), results[1].abs())
    assert ((results[0] - results[1]).abs() <= ulp).all()


DP = dict(privacy__dp__mode="central", federate__sample_client_num=3, federate__total_round_num=4,
          eval__clients=False, privacy__dp__noise_multiplier=0.5, privacy__dp__clip_norm=0.3)
ADAPTIVE = dict(privacy__dp__clip_each_step=False, privacy__dp__adaptive_clip__target_quantile=0.5,
                privacy__dp__adaptive_clip__count_stddev=1.0)


def _pair(tmp_path, monkeypatch, tweak=None, **kw):
    """The same course listed and folded; the clients of each fold, in the order folded."""
    orders: dict[int, tuple[ClippedSum, list[int]]] = {}   # each sum kept: its id is not reused
    fold = FoldingRule.fold

    def watched(self, total, model, base, client, weight=1.0):
        orders.setdefault(id(total), (total, []))[1].append(client)
        return fold(self, total, model, base, client, weight)
    monkeypatch.setattr(FoldingRule, "fold", watched)
    out = {}
    for mode in ("off", "on"):
        course = Course(small_cfg(tmp_path / mode, aggregator__streaming=mode, **{**DP, **kw})).build()
        if tweak:
            tweak(course)
        try:
            course.run()
        except CourseDiverged as stop:   # a simulated round whose updates were all refused
            course.stopped = str(stop)
        out[mode] = course
    assert isinstance(out["on"].server.buffer, FoldingBuffer) and isinstance(out["off"].server.buffer, list)
    return out["off"], out["on"], [clients for _, clients in orders.values()]


def _records(path):
    rows = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [{k: v for k, v in r.items() if k != "wall_time"} for r in rows]


@pytest.mark.parametrize("kw", [
    {},
    ADAPTIVE,
    {"server_optimizer__type": "adam", "server_optimizer__lr": 0.05},
    {**ADAPTIVE, "aggregator__spill": "on", "model__type": "mlp", "model__hidden": [16]},
    {"aggregator__spill": "on", "server_optimizer__type": "sgdm"},
    {"algorithm__name": "fedprox", "model__type": "mlp", "model__hidden": [16], "model__dtype": "float64"},
])
def test_a_folding_dp_course_equals_the_list_based_one_bit_for_bit(tmp_path, monkeypatch, kw):
    listed, folded, orders = _pair(tmp_path, monkeypatch, **kw)
    # the premise: each round's updates folded in client-id order, as the list folds them
    assert orders and all(o == sorted(o) for o in orders), orders
    for name, t in listed.server.aggregator.global_state.items():
        assert torch.equal(folded.server.aggregator.global_state[name], t), name
    rec, ref = _records(tmp_path / "on"), _records(tmp_path / "off")
    assert rec == ref and sum(r["dp_clipped"] for r in rec) > 0
    if kw.get("aggregator__spill") == "on":
        assert folded.server.buffer.running.spill   # the sum was kept in a file, and without a server
        # optimizer (its step in memory for a small model) the model released from it too
        assert any(map(is_mapped, folded.server.aggregator.global_state.values())) == ("server_optimizer__type" not in kw)
    if "privacy__dp__adaptive_clip__target_quantile" in kw:
        assert len({r["dp_clip_norm"] for r in rec}) == len(rec)    # the clip norm moved each round


def test_empty_and_refused_rounds_fold_as_the_list_does(tmp_path, monkeypatch):
    def tweak(course):
        server, sample = course.server, course.server.sampler.sample
        # round 2's sample is empty (noise alone); every update of round 4 is refused
        server.sampler.sample = lambda k, c: [] if server.round == 2 else sample(k, c)
    admit = admission.admit_updates
    monkeypatch.setattr(admission, "admit_updates",
                        lambda server, updates: [] if server.round == 4 else admit(server, updates))
    listed, folded, _ = _pair(tmp_path, monkeypatch, tweak, **ADAPTIVE)
    rec = _records(tmp_path / "on")
    assert rec == _records(tmp_path / "off")
    assert [r["round"] for r in rec if r["num_updates"] == 0][:1] == [2]   # noise alone, accounted
    assert rec[1]["dp_epsilon"] > rec[0]["dp_epsilon"] and len(rec) == 3
    # the refused round is no release: the course stops there with the last model, in both
    assert "round 4: every update of the round was refused" in folded.stopped == listed.stopped
    for name, t in listed.server.aggregator.global_state.items():
        assert torch.equal(folded.server.aggregator.global_state[name], t), name


def test_central_dp_folds_and_the_rules_that_need_every_update_do_not(tmp_path):
    course = Course(small_cfg(tmp_path / "dp", aggregator__streaming="on", **DP)).build()
    assert streaming.folds(course.server.aggregator) and streaming._why_not(course.server) is None
    with pytest.raises(ConfigError, match="aggregator.streaming"):
        Course(small_cfg(tmp_path / "x", aggregator__streaming="on", aggregator__robust_rule="median")).build()
    secure = Course(small_cfg(tmp_path / "sec", secure_aggregation__enabled=True, **{
        **DP, "federate__sample_client_num": None})).build()
    assert not hasattr(secure.server.aggregator, "folding_rule")   # the clients clip: its own path
    with pytest.raises(ConfigError, match="central DP cannot wrap algorithm.name fednova"):
        small_cfg(tmp_path / "nova", algorithm__name="fednova", **DP)   # its rule reads more than the model
    ftrl = Course(small_cfg(tmp_path / "ftrl", privacy__dp__mode="ftrl", federate__sample_client_num=3,
                            federate__total_round_num=2)).build()
    assert not streaming.folds(ftrl.server.aggregator)   # DP-FTRL keeps its list (docs/algorithms/dp.md)


@pytest.mark.skipif(_LIBC is None or not os.path.exists("/proc/self/status"),
                    reason="needs Linux's /proc and glibc's malloc_trim")
def test_what_a_folding_dp_simulation_holds_does_not_grow_with_the_clients_per_round(tmp_path, monkeypatch):
    """Resident bytes above the built course (its data, the global model, the trainer), in
    models, at each update's fold as it is sent, at each noise slice of the release and once
    the round's model is made."""
    monkeypatch.setattr(streaming, "FOLD_STEP", 2 ** 16)   # a slice's float64 temporaries: 0.1 model
    monkeypatch.setattr(dp_fold, "NOISE_BLOCK", 2 ** 16)
    peaks: list[tuple[int, str]] = []
    for cls, method in ((FoldingBuffer, "fold_sent"), (NoiseStream, "take"), (FoldingRule, "combined")):
        original = getattr(cls, method)

        def watched(self, *args, _original=original, _method=method, **kw):
            out = _original(self, *args, **kw)
            peaks.append((_resident(), _method))
            return out
        monkeypatch.setattr(cls, method, watched)
    most = {}
    # the first course in a process also loads what any course needs once (kernels, modules)
    for name, k, spill in (("warm", 2, "on"), ("two", 2, "on"), ("eight", 8, "on"), ("held", 8, "off")):
        course = Course(small_cfg(tmp_path / name, **{
            **LARGE, **BIG, **DP, "federate__sample_client_num": k, "federate__total_round_num": 2,
            "aggregator__spill": spill, "privacy__dp__clip_each_step": False}))
        course.build()
        gc.collect()
        built, peaks[:] = _resident(), []
        course.run()
        assert {m for _, m in peaks} == {"fold_sent", "take", "combined"}   # folded as sent
        most[name] = (max(p for p, _ in peaks) - built) / BIG_BYTES
    # spilled: a slice's temporaries where the built course held the global model, whatever k
    assert most["eight"] <= 0.25 and abs(most["eight"] - most["two"]) <= 0.25, most
    # held in memory: the float64 sum (two models) and the update, or the next model, beside it
    assert most["held"] >= most["eight"] + 2.5, most
