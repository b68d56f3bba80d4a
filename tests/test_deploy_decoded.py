"""A deployed client whose compressed update carries a finite but lying scale: real processes.

The liar is the project's own client process with one stage changed
(tests/decoding_adversary_plugin.py): each scale of its int8 update is 3.0e38, which the
wire's finiteness check lets through and which decodes beyond float32. The server must refuse
that client's update alone each round, by name, and tell it; the honest clients' updates are
aggregated and the course ends with exactly the model of its simulation in which the liar's
(honest) update weighs nothing (num_samples 0), to the tolerance a deployment equals its
simulation (tests/test_deploy_compression.py).
"""
import json

import pytest
import torch

from fedcore.runtime.course import Course
from tests.conftest import small_cfg
from tests.deploy_helpers import serve_course, text, wait_exit, write_cfg
import tests.decoding_adversary_plugin  # noqa: F401  (its keys, for small_cfg)

pytestmark = pytest.mark.slow

KEYS = {"compress.type": "int8", "plugins": ["tests.decoding_adversary_plugin"],
        "decoding_test.bad_client": 2, "eval.clients": False}
REFUSED = "compressed update not finite once decoded"


def test_a_deployed_lying_scale_is_refused_for_its_client_alone(tmp_path, procs):
    cfg = write_cfg(tmp_path / "course.yaml", {
        **KEYS, "decoding_test.adversary": "huge_scale", "distribute.insecure": True,
        "distribute.token": "t", "distribute.heartbeat_interval": 0.5})
    out = tmp_path / "out"
    server, _, client = serve_course(procs, cfg, out)
    clients = {k: client(k) for k in (1, 2, 3)}
    assert wait_exit(server, 240) == 0, text(server)[-3000:]
    assert all(wait_exit(clients[k], 60) == 0 for k in (1, 3)), [text(clients[k])[-2000:] for k in (1, 3)]
    # the liar is told, and says so in its exit status and last line
    assert wait_exit(clients[2], 60) == 1
    assert f"the server refused 2 of its updates (last in round 2: {REFUSED})" in text(clients[2])
    assert "round 1: refused client 2's update: entry " in text(server)
    assert "scale 3e+38 x 127 levels is not finite in float32" in text(server)

    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_by"] == "max_rounds" and summary["admission"] == {REFUSED: 2}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["num_updates"] for r in records] == [2, 2]

    sim = tmp_path / "expected"
    Course(small_cfg(sim, federate__client_num=3, **{k.replace(".", "__"): v for k, v in {
        **KEYS, "decoding_test.adversary": "zero_weight"}.items()})).run()
    deployed = torch.load(out / "final_model.pt", weights_only=True)
    expected = torch.load(sim / "final_model.pt", weights_only=True)
    assert deployed.keys() == expected.keys()
    for name in expected:
        assert bool(torch.isfinite(deployed[name]).all()), name
        assert torch.allclose(deployed[name], expected[name], rtol=0, atol=1e-6), name
