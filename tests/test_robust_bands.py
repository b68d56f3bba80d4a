"""The robust rules read a round's deltas a band of columns at a time (algorithms/combine.py
`Columns`): banded, each rule gives what it gives on the whole float64 matrix (the vector
functions of algorithms/robust.py, checked by hand in test_robust.py): the median bit for
bit, the rules that sum (over rows, or norms and distances over the bands) to float64
rounding, Krum choosing the same clients; a model of up to ONE_BAND values is one band, bit for bit for every
rule; a band's block stays within BAND_BYTES however many clients send; and a deployed server
running the median does not grow with its clients."""
import pytest
import torch

from fedcore.algorithms import combine
from fedcore.algorithms.combine import Columns, flatten, float_names, replace_combination, unflatten
from fedcore.algorithms.fedavg import FedAvgAggregator
from fedcore.algorithms.streaming import round_buffer
from fedcore.algorithms.robust import (centered_clip, coordinate_median, krum_select, make_rule,
                                       trimmed_mean)
from fedcore.kernel.contract import ReceivedUpdate
from tests.conftest import small_cfg

RULES = {"median": {}, "trimmed_mean": {"aggregator__trim_ratio": 0.2},
         "krum": {"aggregator__byzantine_num": 1}, "multi_krum": {"aggregator__byzantine_num": 2},
         "norm_bound": {"aggregator__norm_bound": 1.5},
         "centered_clip": {"aggregator__cc_tau": 0.8, "aggregator__cc_iters": 3}}
EXACT = ("median",)   # per column, no sum (torch's sums over rows may take another order in a narrower block)


def _module(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4)).to(dtype)


def _updates(global_state, k=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(k):
        model = {}
        for n, t in global_state.items():
            if t.is_floating_point():
                model[n] = t + (1 + i % 3) * torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype)
            else:
                model[n] = t + i   # BatchNorm's counter: averaged as usual
        out.append(ReceivedUpdate(i + 1, {"model": model, "num_samples": float(3 + i)}, 1))
    return out


def _reference(name, cfg):
    """The rule on the whole stacked float64 matrix with robust.py's vector functions."""
    history = {}

    def rule(deltas, weights, client_ids, round_):
        names = list(deltas[0])
        vecs = torch.stack([flatten(d, names) for d in deltas])
        w = torch.tensor(weights, dtype=torch.float64)
        if name in ("krum", "multi_krum"):
            f = cfg["aggregator.byzantine_num"]
            chosen = krum_select(vecs, f, 1 if name == "krum" else len(deltas) - f)
            wc = w[chosen]
            out = (vecs[chosen] * (wc / wc.sum())[:, None]).sum(dim=0)
        elif name == "median":
            out = coordinate_median(vecs)
        elif name == "trimmed_mean":
            out = trimmed_mean(vecs, cfg["aggregator.trim_ratio"])
        elif name == "norm_bound":
            norms = vecs.norm(dim=1)
            scale = torch.clamp(cfg["aggregator.norm_bound"] / norms, max=1.0)
            out = ((vecs * scale[:, None]) * (w / w.sum())[:, None]).sum(dim=0)
        else:
            center = history.get("v", torch.zeros(vecs.shape[1], dtype=torch.float64))
            if cfg["aggregator.cc_center"] == "median":
                center = coordinate_median(vecs)
            out, _ = centered_clip(vecs, w, center, cfg["aggregator.cc_tau"], cfg["aggregator.cc_iters"])
            history["v"] = out
        return unflatten(out, deltas[0], names), {}
    return rule


def _aggregate(rule, cfg, dtype, rounds=2):
    """The global models after `rounds` aggregations with `rule` (each round's updates drawn
    around the then global model)."""
    agg = FedAvgAggregator(_module(dtype), cfg, 7)
    replace_combination(agg, rule, "test")
    states = []
    for r in range(1, rounds + 1):
        agg.aggregate(_updates(agg.global_state, seed=r), r)
        states.append({n: t.clone() for n, t in agg.global_state.items()})
    return states


def _small_bands(monkeypatch, width=5):
    """Bands of `width` columns (they cross the entries' boundaries) for 7 clients."""
    monkeypatch.setattr(combine, "ONE_BAND", 0)
    monkeypatch.setattr(combine, "MIN_BAND", 1)
    monkeypatch.setattr(combine, "BAND_BYTES", 8 * 7 * width)


@pytest.mark.parametrize("name", list(RULES))
def test_a_model_of_one_band_combines_bit_for_bit_as_the_whole_matrix(name):
    cfg = small_cfg(None, aggregator__robust_rule=name, **RULES[name])
    for dtype in (torch.float32, torch.float64):
        got = _aggregate(make_rule(cfg), cfg, dtype)
        expected = _aggregate(_reference(name, cfg), cfg, dtype)
        for g, e in zip(got, expected):
            assert all(torch.equal(g[n], e[n]) for n in e), (name, dtype)


@pytest.mark.parametrize("name", list(RULES))
def test_banded_rules_equal_the_whole_matrix(name, monkeypatch):
    cfg = small_cfg(None, aggregator__robust_rule=name, **RULES[name])
    expected = {d: _aggregate(_reference(name, cfg), cfg, d) for d in (torch.float32, torch.float64)}
    _small_bands(monkeypatch)
    for dtype, want in expected.items():
        got = _aggregate(make_rule(cfg), cfg, dtype)
        for g, e in zip(got, want):
            for n in e:
                if name in EXACT or not e[n].is_floating_point():
                    assert torch.equal(g[n], e[n]), (name, dtype, n)
                elif dtype == torch.float64:   # sums taken in another order
                    assert torch.allclose(g[n], e[n], rtol=1e-12, atol=1e-12), (name, n)
                else:                          # ... then rounded to float32: at most an ulp apart
                    assert torch.allclose(g[n], e[n], rtol=2 ** -23, atol=0), (name, n)


@pytest.mark.parametrize("banded", [False, True])
def test_centered_clip_from_the_rounds_median_combines_as_the_whole_matrix(banded, monkeypatch):
    cfg = small_cfg(None, aggregator__robust_rule="centered_clip", aggregator__cc_center="median",
                    **RULES["centered_clip"])
    want = _aggregate(_reference("centered_clip", cfg), cfg, torch.float64)
    if banded:
        _small_bands(monkeypatch)
    got = _aggregate(make_rule(cfg), cfg, torch.float64)
    for g, e in zip(got, want):
        for n in e:
            if banded and e[n].is_floating_point():   # the iterations' sums taken in another order
                assert torch.allclose(g[n], e[n], rtol=1e-12, atol=1e-12), n
            else:
                assert torch.equal(g[n], e[n]), n


def test_a_bands_block_stays_within_its_bound_however_many_rows(monkeypatch):
    monkeypatch.setattr(combine, "ONE_BAND", 100)
    monkeypatch.setattr(combine, "MIN_BAND", 8)
    monkeypatch.setattr(combine, "BAND_BYTES", 8 * 64)
    model = {"w": torch.zeros(1000), "b": torch.zeros(30), "n": torch.zeros((), dtype=torch.int64)}
    for k in (2, 8, 64):
        rows = [{n: t + i for n, t in model.items()} for i in range(k)]
        cols = Columns(rows, float_names(model), model)
        bands = list(cols.bands())
        assert bands[0][0] == 0 and bands[-1][1] == cols.n == 1030
        assert all(b0[1] == b1[0] for b0, b1 in zip(bands, bands[1:]))    # contiguous, no gap
        for a, b in bands:
            block = cols.band(a, b)
            # BAND_BYTES, or MIN_BAND columns where k rows of them take more
            assert block.shape == (k, b - a) and block.numel() * 8 <= max(8 * 64, 8 * k * 8)
        whole = torch.stack([torch.cat([r["w"], r["b"]]).double() for r in rows])
        assert torch.equal(torch.cat([cols.band(a, b) for a, b in bands], dim=1), whole)


def test_a_large_model_that_cannot_fold_says_what_a_round_holds(caplog):
    import logging
    from fedcore.runtime.course import Course
    cfg = small_cfg(None, model__type="mlp", model__hidden=[64500], data__synthetic__dim=64,
                    aggregator__robust_rule="median", federate__sample_client_num=5)
    with caplog.at_level(logging.WARNING, logger="fedcore.course"):
        course = Course(cfg).build()
        for round_ in (1, 2):   # said as the first round starts, once
            course.server.round = round_
            round_buffer(course.server)
    said = [r.getMessage() for r in caplog.records if "updates are not folded" in r.getMessage()]
    assert len(said) == 1 and "aggregator.robust_rule median needs every update at once" in said[0]
    assert "holds its 5 updates" in said[0] and "5 x 18 MB" in said[0]


@pytest.mark.slow
@pytest.mark.alone   # peaks compared between runs: another worker's load would land on one only
def test_a_deployed_median_does_not_grow_with_the_clients(tmp_path, procs):
    from tests.test_streaming import HIDDEN, MODEL_MB, _server_peak
    model = 2 * MODEL_MB * 2 ** 20                  # 34 MiB: an MLP twice as wide
    rule = {"aggregator.robust_rule": "median"}
    few = _server_peak(tmp_path, procs, "median4", 4, "auto", 2 * HIDDEN, **rule)
    many = _server_peak(tmp_path, procs, "median16", 16, "auto", 2 * HIDDEN, **rule)
    # each update waits in its file (distribute.spool_bytes) and the median reads a band of
    # BAND_BYTES (8 MiB) at a time. What a client adds is its waiting stream's window (~0.75
    # MB) and the page-cache folio of its file that a band's read maps (up to 2 MiB): twelve
    # more, about 1.1 models of 34 MiB; holding each delta and its row of the stacked matrix
    # in float64, as the rule did on the whole matrix, cost 4 models a client (48 models)
    assert many - few < 2.0 * model, (few / model, many / model)
