"""Analytics over secure aggregation: the statistics are those of the plain course, and a
curious server (the project's server with its masked-input stage changed to keep what it
receives) holds only masked vectors, from which no client's sums can be read."""
import json

import numpy as np
import pytest

import fedcore
from fedcore.runtime.course import Course
from fedcore.kernel.config import load_config
from tests.conftest import skip_module_without

skip_module_without("data", "sklearn")   # the wine table; imported where used (seconds to import)
pytest.importorskip("cryptography", reason="secure aggregation needs cryptography (extra: secagg)")

SCENARIO = "scenarios/analytics.yaml"
SUMS_ONLY = {"analytics.statistics": ["count", "sum", "mean", "variance", "histogram", "quantiles"],
             "analytics.quantile_rounds": 2, "verbose": 0}


def test_secure_statistics_equal_the_plain_ones(tmp_path):
    plain = fedcore.run(SCENARIO, outdir=str(tmp_path / "plain"), **{k.replace(".", "__"): v for k, v in SUMS_ONLY.items()})
    secure = fedcore.run(SCENARIO, outdir=str(tmp_path / "secure"), secure_aggregation__enabled=True,
                         **{k.replace(".", "__"): v for k, v in SUMS_ONLY.items()})
    a = json.loads((plain.outdir / "statistics.json").read_text())
    b = json.loads((secure.outdir / "statistics.json").read_text())
    assert a == b
    assert all(r["secagg_survivors"] == 5 for r in secure.records)


def test_a_curious_server_sees_only_masked_sums(tmp_path):
    from fedcore.handlers import secure_aggregation
    cfg = load_config(SCENARIO, extra={**SUMS_ONLY, "secure_aggregation.enabled": True,
                                       "outdir": str(tmp_path)})
    course = Course(cfg, tmp_path).build()
    seen: dict[int, np.ndarray] = {}

    def keep_and_collect(server, msg):   # the one changed stage: keep each masked input
        if msg.round == 1:
            seen[msg.sender] = msg.content["masked"].numpy().astype(np.uint64).copy()
        secure_aggregation.collect_masked_input(server, msg)
    course.server_table.register("receiving_secagg_masked_input", keep_and_collect, replaces=True,
                                 sends=("secagg_inputs_collected",))
    course.run()
    request = {"model": {"request": course.server.aggregator.global_state["request"][:0]}}
    modulus = cfg["secure_aggregation.modulus"]
    own = {cid: course.trainer.fit(cid, course.clients[cid].data, request, 1).content["sums"].numpy()
           .astype(np.uint64) for cid in course.client_ids}
    assert sorted(seen) == course.client_ids
    for cid, masked in seen.items():
        vec = masked[:-1]
        assert not np.array_equal(vec, own[cid])
        # the counts (round 1's first entries) are small; masked, they spread over the field
        assert np.mean(vec[:3] > np.uint64(2 ** 40)) == 1.0
    total = sum(int(v) for v in np.stack(list(seen.values()))[:, 0]) % modulus
    assert total != int(sum(own[c][0] for c in own))   # the masks do not cancel without unmasking
    # what the server learnt is the sum: round 1's counts per cultivar of the union
    stats = json.loads((tmp_path / "statistics.json").read_text())["statistics"]["alcohol"]
    assert [stats[g]["count"] for g in ("class_0", "class_1", "class_2")] == [59, 71, 48]


def test_a_round_without_sums_stops_the_course():
    """A skipped secure round reaches the aggregator empty: the course stops (exit 6) rather
    than describe the union without it."""
    from fedcore.algorithms.analytics import AnalyticsAggregator, AnalyticsRequest, plan_of
    from fedcore.kernel.errors import EXIT_NOTHING_AGGREGATED, NothingAggregated
    cfg = load_config(SCENARIO, extra=SUMS_ONLY)
    agg = AnalyticsAggregator(AnalyticsRequest(plan_of(cfg, (13,), 3)), cfg, 5)
    with pytest.raises(NothingAggregated, match="round 1 has no sums") as caught:
        agg.aggregate([], 1)
    assert caught.value.exit_code == EXIT_NOTHING_AGGREGATED == 6
