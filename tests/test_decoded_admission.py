"""Decoded updates are checked: a client whose update passes the wire's checks encoded but
decodes to values the model's dtype cannot hold (a lying scale, top-k indices that do not
decode, LoRA factors whose product overflows) is refused alone, and the course goes on.

Each attacker is the project's own client with one stage changed
(tests/decoding_adversary_plugin.py). The expectation is computed without admission: the
same course in which the attacker is honest but claims num_samples 0, so that FedAvg's own
weighted mean gives its update no weight. The course with the attacker refused must end with
exactly that model.
"""
import json
import logging
import math

import numpy as np
import pytest
import torch

from fedcore.algorithms.compression import decode_update, dequantize, encode_update, unpack4
from fedcore.algorithms.lora import exact_lora_mean, product_norm
from fedcore.algorithms.streaming import FoldingBuffer
from fedcore.comm.validation import check_content
from fedcore.kernel.errors import ConfigError
from fedcore.runtime.course import Course
from tests.conftest import need_extra, small_cfg
import tests.decoding_adversary_plugin  # noqa: F401  (its keys, for small_cfg)

BAD = 2
PLUGIN = {"plugins": ["tests.decoding_adversary_plugin"], "decoding_test.bad_client": BAD}


def _run(out, adversary, **keys):
    cfg = small_cfg(out, **{k.replace(".", "__"): v for k, v in {
        **PLUGIN, "federate.client_num": 3, "decoding_test.adversary": adversary, **keys}.items()})
    course = Course(cfg)
    course.run()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    final = torch.load(out / "final_model.pt", weights_only=True)
    return course, records, final


def _assert_refused_alone(tmp_path, caplog, adversary, kind, **keys):
    """The attacker's update is refused every round, by name; the others are aggregated; the
    final model is exactly the course's in which the attacker's update weighs nothing.
    Returns the refusal's log lines and the attacked course."""
    with caplog.at_level(logging.WARNING, logger="fedcore.admission"):
        course, records, final = _run(tmp_path / "attacked", adversary, **keys)
    _, honest_records, expected = _run(tmp_path / "expected", "zero_weight", **keys)
    summary = course.monitor.extra_summary
    assert summary["stopped_by"] == "max_rounds" and summary["admission"] == {kind: 2}
    assert [r["num_updates"] for r in records] == [2, 2]
    assert [r["num_updates"] for r in honest_records] == [3, 3]   # its zero weight counted as an update
    lines = [r.getMessage() for r in caplog.records if "refused client" in r.getMessage()]
    assert lines and lines[0].startswith(f"round 1: refused client {BAD}'s update: ")
    assert final.keys() == expected.keys()
    for name in final:
        assert bool(torch.isfinite(final[name]).all()), name
        assert torch.equal(final[name], expected[name]), name
    return lines, course


# ---------------------------------------------------------------- what the wire lets through

def _encoded(kind, tmp_path):
    server = Course(small_cfg(tmp_path, compress__type=kind, compress__topk_fraction=0.5)).build().server
    ref = server.aggregator.broadcast(1)["model"]
    model = {n: t + 0.1 * torch.arange(t.numel(), dtype=t.dtype).reshape(t.shape) / t.numel()
             for n, t in ref.items()}
    maps, _, _ = encode_update(model, ref, kind, 0.5, torch.Generator().manual_seed(0))
    return server, ref, maps


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_finite_lying_scale_passes_the_wire_and_decodes_to_inf(tmp_path, kind):
    """What the attacker has: a scale of 3.0e38 is finite, so the wire takes the update; the
    codes it scales do not stay finite in float32. A NaN or inf scale the wire refuses."""
    server, ref, maps = _encoded(kind, tmp_path)
    lying = {**maps, "scale": {n: torch.tensor(3.0e38) for n in maps["scale"]}, "num_samples": 5}
    assert check_content("updates", lying, server) is None
    name = next(iter(maps["scale"]))   # L x 3e38 (L = 127 or 7) is beyond float32's largest value, 3.4e38
    codes = maps["q8"][name] if kind == "int8" else unpack4(maps["q4"][name], ref[name].numel())
    assert int(codes.abs().max()) >= 2
    assert not torch.isfinite(dequantize(codes, torch.tensor(3.0e38), ref[name])).all()
    with pytest.raises(ValueError, match="3e\\+38 x .* levels is not finite in float32"):
        decode_update(lying, ref, kind)
    for bad in (float("nan"), float("inf")):
        refused = {**maps, "scale": {n: torch.tensor(bad) for n in maps["scale"]}, "num_samples": 5}
        assert "non-finite" in check_content("updates", refused, server)


def test_compression_under_edge_aggregators_is_refused_at_config_time():
    """Edges collect their clients' updates without the server's decoding (so without its
    checks): such a course is refused in one line rather than run undecoded."""
    with pytest.raises(ConfigError, match="compress.type: int8 cannot be used here .*edge aggregators"):
        small_cfg(compress__type="int8", topology__edges=2)


# ---------------------------------------------------------------- courses: refused alone

@pytest.mark.parametrize("kind,adversary,reason", [
    ("int8", "huge_scale", "compressed update not finite once decoded"),
    ("int4", "huge_scale", "compressed update not finite once decoded"),
    ("int8", "nan_scale", "compressed update not finite once decoded"),
    ("int4", "inf_scale", "compressed update not finite once decoded"),
    ("topk", "nan_value", "compressed update not finite once decoded"),
    ("topk", "index_out_of_range", "undecodable compressed update"),
    ("topk", "index_duplicate", "undecodable compressed update"),
])
def test_a_compressed_update_that_does_not_decode_to_finite_values_is_refused_alone(
        tmp_path, caplog, kind, adversary, reason):
    lines, _ = _assert_refused_alone(tmp_path, caplog, adversary, reason,
                                     **{"compress.type": kind, "compress.topk_fraction": 0.5})
    if adversary == "huge_scale":
        assert "scale 3e+38 x" in lines[0] and "not finite in float32" in lines[0]


def test_a_folding_round_refuses_the_lying_scale_before_it_touches_the_sum(tmp_path, caplog):
    """The folding path admits each update as it arrives: the lying one never reaches the sum."""
    _, course = _assert_refused_alone(tmp_path, caplog, "huge_scale", "compressed update not finite once decoded",
                                      **{"compress.type": "int8", "aggregator.streaming": "on"})
    assert isinstance(course.server.buffer, FoldingBuffer)


def test_the_norm_rule_measures_what_a_sparse_update_decodes_to(tmp_path, caplog):
    """Top-k values of 1e30 are finite, and so is what they decode to: admission.norm_ratio,
    which measures the decoded update's distance from the global model, refuses it."""
    keys = {"compress.type": "topk", "compress.topk_fraction": 0.5, "admission.norm_ratio": 10.0}
    lines, _ = _assert_refused_alone(tmp_path, caplog, "huge_value", "update norm far above the round's others",
                                     **keys)
    assert "exceeds admission.norm_ratio=10 x the median" in lines[0]


# ---------------------------------------------------------------- LoRA: the product is checked

def test_the_product_norm_is_the_frobenius_norm_of_b_a():
    g = torch.Generator().manual_seed(0)
    for scale in (1.0, 1e30):
        a, b = torch.randn(3, 7, generator=g) * scale, torch.randn(5, 3, generator=g) * scale
        an, bn = a.double().numpy() / scale, b.double().numpy() / scale   # numpy, without overflow
        expected = np.linalg.norm(bn @ an) * scale * scale
        assert product_norm(a, b) == pytest.approx(expected, rel=1e-12)
    assert product_norm(torch.zeros(2, 4), torch.ones(3, 2)) == 0.0
    assert product_norm(torch.full((2, 4), float("nan")), torch.ones(3, 2)) == math.inf


LM = {"data.type": "synthetic_text", "data.partition": "natural", "data.synthetic_text.authors": 3,
      "data.synthetic_text.documents": 12, "data.text.seq_len": 16, "eval.clients": False,
      "model.type": "causal_lm", "model.causal_lm.layers": 1, "model.causal_lm.heads": 2,
      "model.causal_lm.hidden": 16, "model.causal_lm.max_positions": 32, "model.lora.r": 4,
      "train.local_steps": 2, "train.batch_size": 8, "train.optimizer.type": "adamw",
      "train.optimizer.lr": 0.02}


@pytest.mark.parametrize("adversary", ["lora_product", "lora_refactor"])
def test_lora_factors_whose_product_the_dtype_cannot_hold_are_refused_alone(tmp_path, caplog, adversary):
    need_extra("llm", "transformers", "peft")
    value = tests.decoding_adversary_plugin.LORA[adversary]
    # what the attacker has: finite factors whose exact mean would not be finite in float32
    a, b = torch.zeros(4, 16), torch.zeros(48, 4)
    a[0, :], b[:, 0] = value, value
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    if adversary == "lora_refactor":   # the product itself is finite in float32...
        assert torch.isfinite(b @ a).all()
    new_a, new_b = exact_lora_mean([(a, b)], [1.0], 4)
    assert not torch.isfinite(new_b).all()   # ...but the re-factorized B = U S is not
    lines, _ = _assert_refused_alone(tmp_path, caplog, adversary, "LoRA product beyond the model's dtype", **LM)
    assert "Frobenius norm" in lines[0] and "beyond float32's largest value" in lines[0]
