"""The horizontal trees course's records hold each client's bytes and the virtual time its reply
arrived. Expected values are derived here: a histogram upload is the wire envelope
(`encode_envelope`, the bytes a deployment sends) of k open nodes x features x bins x (g, h)
float64 values and the client's row count; the time model's stamp is latency + bytes / bandwidth
each way plus rows / compute speed."""
from __future__ import annotations

import json

import numpy as np
import pytest
from tests.conftest import skip_module_without
import torch

skip_module_without("trees", "xgboost")

import fedcore  # noqa: E402
from fedcore.kernel.config import load_config  # noqa: E402
from fedcore.scenarios.data import build_federated_data  # noqa: E402
from fedcore.wire.serialization import encode_envelope  # noqa: E402

LATENCY, UP, DOWN, SPEED = 0.01, 2.0e4, 1.0e5, 100.0


def _csv(path) -> str:
    rng = np.random.default_rng(4)
    x = np.stack([np.arange(60) % 7, rng.integers(0, 7, 60), rng.integers(0, 7, 60)], axis=1)
    y = (x[:, 0] + rng.normal(size=60) > 3).astype(int)
    path.write_text("a,b,c,label\n" + "".join(f"{r[0]},{r[1]},{r[2]},{v}\n" for r, v in zip(x, y)))
    return str(path)


def test_per_client_bytes_and_time_are_the_wire_and_time_models(tmp_path):
    over = {"task": "trees", "seed": 1, "federate.client_num": 3, "data.type": "csv",
            "data.root": _csv(tmp_path / "t.csv"), "data.test_size": 0, "trees.num_trees": 2,
            "trees.max_depth": 2, "trees.max_bin": 16, "verbose": 0,
            "time.profiles": {"type": "constant", "latency": LATENCY, "upload_bandwidth": UP,
                              "download_bandwidth": DOWN, "compute_speed": SPEED}}
    res = fedcore.run(dict(over), outdir=str(tmp_path / "out"))
    data = build_federated_data(load_config(dict(over)))
    rows = {c: sum(len(getattr(d, s).y) for s in ("train", "val", "test")) for c, d in data.clients.items()}
    features, bins = 3, 7                 # three columns, each taking the values 0..6: 7 cuts
    recs = res.records
    assert [r["round"] for r in recs] == [1, 2, 3, 4, 5]
    totals = dict.fromkeys(rows, 0)
    for r in recs:
        for c in rows:
            totals[c] += r[f"bytes_client_{c}"]
            assert r[f"bytes_client_{c}_total"] == totals[c]
    for prev, r in zip(recs, recs[1:]):   # histogram rounds: level 0 (the root), then level 1
        k = 1 if r["round"] in (2, 4) else 2   # both roots split (checked below): two open nodes
        up = {}
        for c, n in rows.items():
            content = {"sketch": torch.zeros(0, dtype=torch.float64),
                       "hist": torch.zeros(k * features * bins * 2, dtype=torch.float64),
                       "trees": torch.zeros(0, dtype=torch.uint8), "num_samples": n}
            up[c] = len(encode_envelope("updates", c, [0], r["round"], 1.5, content))
            assert up[c] > 8 * k * features * bins * 2
        down = {c: r[f"bytes_client_{c}"] - up[c] for c in rows}
        assert len(set(down.values())) == 1   # one broadcast to every client
        assert sum(up.values()) == r["bytes_up"] and sum(down.values()) == r["bytes_down"]
        for c, n in rows.items():
            want = prev["virtual_time"] + LATENCY + down[c] / DOWN + n / SPEED + LATENCY + up[c] / UP
            assert r[f"virtual_time_client_{c}"] == pytest.approx(want, rel=1e-12)
        assert r["virtual_time"] == max(r[f"virtual_time_client_{c}"] for c in rows)
    trees = json.loads((tmp_path / "out" / "final_model.json").read_text())["learner"]["gradient_booster"]
    assert all(t["left_children"][0] > 0 for t in trees["model"]["trees"])
