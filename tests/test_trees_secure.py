"""The horizontal trees course over secure aggregation: the server unmasks only the sum of the
clients' histograms, and the trees are the plain course's.

Expected values are derived here: the fixed-point code by hand, the trees from the plain
course, the leaf bound from the code's error (clients x 2^-(F+1) per summed entry, accumulated
over a node's bins and its ancestors). The attacker is the project's own simulated server with
one stage changed: it records every message it receives."""
from __future__ import annotations

import json

import numpy as np
import pytest
from tests.conftest import lazy_module, skip_module_without

skip_module_without("trees", "xgboost")
xgb = lazy_module("xgboost")
skip_module_without("data", "sklearn")
pytest.importorskip("cryptography", reason="secure aggregation needs cryptography (extra: secagg)")

from fedcore.algorithms import trees_secure as ts  # noqa: E402
from fedcore.kernel.config import load_config  # noqa: E402
from fedcore.kernel.message import SERVER_ID  # noqa: E402
from fedcore.run import main  # noqa: E402
from fedcore.runtime.course import Course  # noqa: E402

P = 2 ** 61 - 1
COURSE = {"task": "trees", "seed": 4, "federate.client_num": 4, "data.type": "breast_cancer",
          "data.partition": "iid", "data.test_size": 0.2, "trees.num_trees": 2, "trees.max_depth": 2,
          "trees.max_bin": 8, "verbose": 0}


def test_fixed_point_codes_by_hand():
    # F = 2: 0.3 -> round(1.2) = 1, -0.6 -> round(-2.4) = -2 = p - 2, 1.1 -> round(4.4) = 4
    assert ts.encode(np.array([0.3, -0.6, 1.1]), 2, P, 3).tolist() == [1, P - 2, 4]
    total = (ts.encode(np.array([0.3]), 2, P, 3) + ts.encode(np.array([-0.6]), 2, P, 3)
             + ts.encode(np.array([1.1]), 2, P, 3)) % np.uint64(P)
    assert ts.decode(total, 2, P).tolist() == [0.75]            # (1 - 2 + 4) / 4
    assert abs(0.75 - (0.3 - 0.6 + 1.1)) <= ts.error_bound(2, 3)  # 0.05 <= 3 / 8
    # a sum of large negative codes decodes exactly beyond float64's 2^53 integers
    big = np.array([-(2.0 ** 36) - 0.25])   # its code is -(2^56 + 2^18)
    assert ts.decode(ts.encode(big, 20, P, 2), 20, P).tolist() == big.tolist()
    with pytest.raises(Exception, match="trees.secure_frac_bits"):   # N codes could wrap around p
        ts.encode(np.array([2.0 ** 30]), 32, P, 2)


def _run(over: dict, received: list | None = None, coded: dict | None = None, monkeypatch=None):
    course = Course(load_config(dict(over))).build()
    if received is not None:   # the attacker: every message the server receives, kept
        course.comm.filters.append(lambda msg, receiver: received.append(msg) or True
                                   if receiver == SERVER_ID else True)
    if coded is not None:      # what each client coded (the ground truth the attacker is after)
        from fedcore.handlers import secagg_client
        real_encode, real_advertise, last = ts.encode, secagg_client.advertise, []

        def encode(hist, *args):
            last.append(hist.copy())
            return real_encode(hist, *args)

        def advertise(client, round_, vector, weight):
            coded[(client.id, round_)] = (last.pop(), vector[:-1].copy())
            return real_advertise(client, round_, vector, weight)
        monkeypatch.setattr(ts, "encode", encode)
        monkeypatch.setattr(secagg_client, "advertise", advertise)
    course.run()
    return course


def _trees(course) -> list[dict]:
    return json.loads((course.outdir / "final_model.json").read_text())["learner"]["gradient_booster"]["model"]["trees"]


def _walk(t: dict, i: int = 0):
    if t["left_children"][i] < 0:
        return None
    return (t["split_indices"][i], t["split_conditions"][i], _walk(t, t["left_children"][i]),
            _walk(t, t["right_children"][i]))


def _depth(t: dict, i: int) -> int:
    d = 0
    while t["parents"][i] != 2147483647:
        i, d = t["parents"][i], d + 1
    return d


def test_secure_course_grows_the_plain_trees(tmp_path):
    plain = _run({**COURSE, "outdir": str(tmp_path / "plain")})
    secure = _run({**COURSE, "outdir": str(tmp_path / "secure"), "secure_aggregation.enabled": True})
    a, b = _trees(plain), _trees(secure)
    assert len(a) == len(b) == 2
    for ta, tb in zip(a, b):
        assert _walk(ta) == _walk(tb) and _walk(ta) is not None   # same features and thresholds
    # tree 1 (same gradients in both): each leaf within the code's derived bound
    n, f_bits, lam, eta = 4, 32, 1.0, 0.3
    e, bins = ts.error_bound(f_bits, n), COURSE["trees.max_bin"] + 1
    t, u = a[0], b[0]
    for i, left in enumerate(t["left_children"]):
        if left >= 0:
            continue
        d_sum = (_depth(t, i) + 1) * bins * e          # |dG|, |dH|: root sums over bins, then a cumsum per level
        h = t["sum_hessian"][i] + lam
        g = abs(t["split_conditions"][i]) * h / eta
        bound = eta * (d_sum * h + g * d_sum) / (h * (h - d_sum))
        ulp = float(np.spacing(np.float32(abs(t["split_conditions"][i]))))
        assert abs(t["split_conditions"][i] - u["split_conditions"][i]) <= bound + ulp
    for ta, tb in zip(a[1:], b[1:]):
        np.testing.assert_allclose(tb["split_conditions"], ta["split_conditions"], rtol=1e-5, atol=1e-7)
    rec = secure.monitor.records
    assert rec[0].get("secagg_survivors") is None and all(r["secagg_survivors"] == 4 for r in rec[1:])


def _chi2(values: np.ndarray) -> float:
    """Chi-square statistic of values in [0, p) against 8 equal buckets (uniform: 7 d.o.f.)."""
    counts = np.bincount((values.astype(np.float64) / P * 8).astype(np.int64).clip(0, 7), minlength=8)
    want = len(values) / 8
    return float(((counts - want) ** 2 / want).sum())


def test_a_recording_server_cannot_recover_a_clients_histogram(tmp_path, monkeypatch):
    received: list = []
    coded: dict = {}
    course = _run({**COURSE, "outdir": str(tmp_path / "s"), "secure_aggregation.enabled": True},
                  received, coded, monkeypatch)
    masked = [m for m in received if m.msg_type == "secagg_masked_input"]
    assert len(masked) == 4 * 4 and len(coded) == 4 * 4   # 4 secure rounds, 4 clients each
    # a deployed server sizes the stages' slow-link allowance on the longest masked input:
    # 2 open nodes at depth 1 x 30 columns x (8 + 1) bins x (g, h), and the weight
    longest = course.server.aggregator.longest_masked()
    assert longest == 2 * 30 * 9 * 2 + 1 and max(len(m.content["masked"]) for m in masked) <= longest
    by_client: dict[int, list] = {}
    for m in masked:
        hist, q = coded[(m.sender, m.round)]
        y = m.content["masked"].numpy().astype(np.uint64)
        assert len(y) == len(q) + 1
        by_client.setdefault(m.sender, []).append((hist, q, y[:-1]))
    critical = 40.52   # chi-square, 7 degrees of freedom: exceeded with probability 1e-6
    for c, rounds in by_client.items():
        q = np.concatenate([r[1] for r in rounds])
        y = np.concatenate([r[2] for r in rounds])
        mask = (y + np.uint64(P) - q) % np.uint64(P)
        assert _chi2(mask) < critical and _chi2(y) < critical   # y = code + a uniform mask
        assert _chi2(q) > 100 * critical                        # the code itself is far from uniform
        for hist, _q, yy in rounds:   # the server's best reading of one input is not the histogram
            assert not np.allclose(ts.decode(yy, 32, P), hist, atol=1.0)
    # nothing the server received from a client carries its histogram or its code
    for m in received:
        content = m.content if isinstance(m.content, dict) else {}
        for v in content.values():
            arr = np.asarray(v.numpy() if hasattr(v, "numpy") else [], dtype=np.float64).ravel()
            for hist, q, _y in by_client.get(m.sender, []):
                if arr.size == hist.size:
                    assert not np.allclose(arr, hist) and not np.array_equal(arr, q.astype(np.float64))
    assert len(_trees(course)) == 2


@pytest.mark.parametrize("mode", ["bagging", "cyclic"])
def test_secure_trees_in_bagging_or_cyclic_is_refused_in_one_line(tmp_path, capsys, mode):
    (tmp_path / "c.yaml").write_text("task: trees\n")
    code = main(["--check", "--cfg", str(tmp_path / "c.yaml"), f"trees.mode={mode}",
                 "secure_aggregation.enabled=true", f"outdir={tmp_path / 'o'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "secure_aggregation.enabled" in err and "histogram" in err


def test_a_secure_level_without_every_client_stops_the_course(tmp_path):
    """Client 2's masked input never arrives: the others' sum is unmasked (its masks rebuilt
    from their shares), but a tree level grown from some clients' rows is another tree."""
    from fedcore.kernel.errors import NothingAggregated
    from fedcore.kernel.scheduler import HandlerError
    over = {**COURSE, "outdir": str(tmp_path / "s"), "secure_aggregation.enabled": True,
            "secure_aggregation.stage_timeout": 5.0}
    course = Course(load_config(over)).build()
    course.comm.filters.append(lambda msg, receiver: not (msg.msg_type == "secagg_masked_input" and msg.sender == 2))
    named = r"round 2 of the trees course: clients \[1, 3, 4\] of \[1, 2, 3, 4\]"
    with pytest.raises(HandlerError, match=named) as caught:
        course.run()
    assert isinstance(caught.value.__cause__, NothingAggregated)
    assert [r["round"] for r in course.monitor.records] == [1]   # the sketches' round only
