"""Compressed updates: each encoding's error bound, unbiased rounding, exact error feedback,
what the server accepts and decodes, and a compressed course in simulation."""
import json
import math

import pytest
import torch

from fedcore.algorithms.compression import (decode_update, densify, dequantize, encode_update, pack4,
                                            quantize, rounding_generator, top_k, unpack4)
from fedcore.comm.validation import check_content
from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from tests.conftest import small_cfg


def _x(n=257, seed=3):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.3


@pytest.mark.parametrize("levels", [127, 7])
def test_quantization_error_is_at_most_one_step(levels):
    # codes = floor(x/s + u), u in [0, 1): |x/s - code| < 1, so |x - code*s| < s = max|x| / L
    x = _x()
    codes, scale = quantize(x, levels, torch.Generator().manual_seed(0))
    assert float(scale) == pytest.approx(float(x.abs().max()) / levels, rel=1e-6)
    assert int(codes.abs().max()) <= levels
    err = (dequantize(codes, scale, x) - x).abs().max()
    assert err <= float(scale) * (1 + 1e-5)


@pytest.mark.parametrize("levels", [127, 7])
def test_stochastic_rounding_is_unbiased(levels):
    # each decoded entry is floor or ceil of x/s times s: variance <= s^2/4, so the mean of
    # N draws is within 6 * s / (2 sqrt N) of x (every one of 64 entries, at 6 sigma)
    x, draws = _x(64), 4000
    g = torch.Generator().manual_seed(1)
    total = torch.zeros(64, dtype=torch.float64)
    for _ in range(draws):
        codes, scale = quantize(x, levels, g)
        total += dequantize(codes, scale, x).double()
    s = float(x.abs().max()) / levels
    assert ((total / draws - x.double()).abs() <= 6 * s / (2 * math.sqrt(draws))).all()


def test_four_bit_codes_pack_two_per_byte():
    codes = torch.tensor([-7, 7, 0, -1, 3, 5, -6], dtype=torch.int8)   # odd length: one pad nibble
    packed = pack4(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == 4
    assert int(packed[0]) == (-7 + 8) | ((7 + 8) << 4)
    assert torch.equal(unpack4(packed, 7), codes)


def test_top_k_keeps_the_largest_entries_exactly():
    x = torch.tensor([0.1, -5.0, 0.2, 3.0, -0.3, 0.0, 4.0, -0.05])
    idx, values = top_k(x, 0.3)                          # ceil(0.3 * 8) = 3 entries
    assert idx.tolist() == [1, 3, 6] and values.tolist() == [-5.0, 3.0, 4.0]
    assert densify(idx, values, x).tolist() == [0, -5.0, 0, 3.0, 0, 0, 4.0, 0]


@pytest.mark.parametrize("idx", [[1, 1], [3, 1], [-1, 2], [2, 8]])
def test_bad_top_k_indices_are_refused(idx):
    with pytest.raises(ValueError):
        densify(torch.tensor(idx, dtype=torch.int32), torch.ones(2), torch.zeros(8))


def _models():
    ref = {"w": _x(40, 1).reshape(5, 8), "b": _x(5, 2), "count": torch.tensor(3)}
    model = {"w": ref["w"] + _x(40, 4).reshape(5, 8), "b": ref["b"] + _x(5, 5), "count": torch.tensor(4)}
    return ref, model


def test_error_feedback_keeps_what_was_not_sent_exactly():
    ref, model = _models()
    previous = {"w": _x(40, 6).reshape(5, 8), "b": _x(5, 7)}
    _, sent, left = encode_update(model, ref, "topk", 0.25, None, previous)
    for n in ("w", "b"):
        # top-k sends entries of (update + residual) as they are: the split is exact
        assert torch.equal(sent[n] + left[n], (model[n] - ref[n]) + previous[n])
        assert int((sent[n] != 0).sum()) == math.ceil(0.25 * model[n].numel())
    _, sent, left = encode_update(model, ref, "int8", 1.0, torch.Generator().manual_seed(0), previous)
    for n in ("w", "b"):   # float32 arithmetic: equal to the rounding of one subtraction
        target = (model[n] - ref[n]) + previous[n]
        assert torch.allclose(sent[n] + left[n], target, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["int8", "int4", "topk"])
def test_the_server_decodes_what_the_client_meant(kind):
    ref, model = _models()
    maps, sent, _ = encode_update(model, ref, kind, 0.5, torch.Generator().manual_seed(2))
    decoded = decode_update(maps, ref, kind)
    assert torch.equal(decoded["count"], model["count"])
    for n in ("w", "b"):
        assert torch.equal(decoded[n], ref[n] + sent[n])


def _server(tmp_path, **kw):
    return Course(small_cfg(tmp_path, **kw)).build().server


@pytest.mark.parametrize("kind", ["int8", "int4", "topk"])
def test_the_wire_check_takes_compressed_updates_only(tmp_path, kind):
    server = _server(tmp_path, compress__type=kind, compress__topk_fraction=0.5)
    ref = server.aggregator.broadcast(1)["model"]
    model = {n: t + 0.1 for n, t in ref.items()}
    maps, _, _ = encode_update(model, ref, kind, 0.5, torch.Generator().manual_seed(0))
    assert check_content("updates", {**maps, "num_samples": 5}, server) is None
    assert check_content("updates", {"model": model, "num_samples": 5}, server) is not None
    name = next(iter(ref))
    key = "topk_index" if kind == "topk" else ("q8" if kind == "int8" else "q4")
    bad = {**maps, key: {**maps[key], name: maps[key][name].reshape(-1)[:1]}, "num_samples": 5}
    assert "is (1,)" in check_content("updates", bad, server)


@pytest.mark.extra("secagg")
def test_compression_is_refused_where_the_update_is_more_than_a_model():
    for extra in ({"algorithm__name": "scaffold"}, {"secure_aggregation__enabled": True},
                  {"asyn__use": True}):
        with pytest.raises(ConfigError, match="compress.type"):
            small_cfg(compress__type="int8", **extra)


def _records(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_a_compressed_course_sends_fewer_bytes_and_keeps_residuals(tmp_path):
    sizes = {}
    for kind in ("none", "int8", "int4", "topk"):
        out = tmp_path / kind
        course = Course(small_cfg(out, data__synthetic__dim=400, compress__type=kind,
                                  compress__topk_fraction=0.1))
        course.run()
        sizes[kind] = _records(out)[0]["bytes_up"]
        assert math.isfinite(_records(out)[-1]["test_loss"])
        if kind == "topk":   # error feedback is on: each client keeps its remainder
            floats = {n for n, t in course.server.aggregator.global_state.items() if t.is_floating_point()}
            residual = course.trainer.store.load(1)["compression_residual"]
            assert set(residual) == floats and any(bool(t.any()) for t in residual.values())
    # a 400x3 logistic regression: 1203 float32 entries; int8 ~1/4, int4 ~1/8, 10% top-k ~1/5
    assert sizes["int8"] < sizes["none"] / 3 and sizes["int4"] < sizes["int8"] * 0.7
    assert sizes["topk"] < sizes["none"] / 3


def test_seeded_rounding_streams_differ_per_client_and_round():
    a = torch.rand(4, generator=rounding_generator(0, 1, 1))
    assert not torch.equal(a, torch.rand(4, generator=rounding_generator(0, 2, 1)))
    assert not torch.equal(a, torch.rand(4, generator=rounding_generator(0, 1, 2)))
    assert torch.equal(a, torch.rand(4, generator=rounding_generator(0, 1, 1)))


def test_the_server_refuses_an_update_whose_indices_it_cannot_decode(tmp_path):
    from fedcore.kernel.message import Message
    course = Course(small_cfg(tmp_path, compress__type="topk", compress__topk_fraction=0.5))
    course.build()
    server = course.server
    server.round, server.selected, server.buffer = 1, {1, 2}, []
    ref = server.aggregator.broadcast(1)["model"]
    maps, _, _ = encode_update({n: t + 1 for n, t in ref.items()}, ref, "topk", 0.5, None)
    name = next(iter(ref))
    bad = dict(maps, topk_index={**maps["topk_index"], name: maps["topk_index"][name].flip(0)})
    handle = server.handlers.entries["receiving_updates"].fn
    handle(server, Message("updates", 1, (0,), 1, 0.0, {**bad, "num_samples": 4}))
    assert server.selected == {2}          # client 1 replied: the round does not wait for it
    assert [u.client_id for u in server.buffer] == [1]
    handle(server, Message("updates", 2, (0,), 1, 0.0, {**maps, "num_samples": 4}))
    # the round aggregated client 2's update alone (the mean of one update is that update);
    # admission refused client 1's and counted it
    assert server.round == 2 and course.monitor.extra_summary["admission"]["undecodable compressed update"] == 1
    decoded = decode_update(maps, ref, "topk")
    assert all(torch.equal(server.aggregator.global_state[n], decoded[n]) for n in ref)
