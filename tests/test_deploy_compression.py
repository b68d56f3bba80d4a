"""Compressed updates over gRPC between real processes equal their simulation.

Stochastic rounding and error feedback are seeded per (seed, client, round) and kept
per client, so a deployed course makes the same updates as its simulation; the bytes
the server counts as they come off the wire equal the simulation's `bytes_up`, which
is the size of the encoded (compressed) updates.
"""
import json

import pytest
import torch

from fedcore.runtime.course import Course
from tests.conftest import small_cfg
from tests.deploy_helpers import FORK, text, wait_exit, write_cfg

pytestmark = pytest.mark.slow

COURSES = {"int4": {"compress.type": "int4", "compress.error_feedback": True},
           "topk": {"compress.type": "topk", "compress.topk_fraction": 0.2}}
DIM = {"data.synthetic.dim": 200}


def _records(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_compressed_courses_deploy_as_they_simulate(tmp_path, procs):
    launched = {}
    for name, keys in COURSES.items():
        cfg = write_cfg(tmp_path / f"{name}.yaml", {**DIM, **keys, "eval.clients": False})
        out = tmp_path / name
        launched[name] = (out, procs.start(name, ["-m", "fedcore.launch", *FORK, "--cfg", str(cfg),
                                                  f"outdir={out}"]))
    plain = tmp_path / "plain"
    Course(small_cfg(plain, federate__client_num=3, data__synthetic__dim=200)).run()
    for name, (out, launcher) in launched.items():
        assert wait_exit(launcher, 300) == 0, text(launcher)[-3000:]
        sim = tmp_path / f"sim_{name}"
        Course(small_cfg(sim, federate__client_num=3, eval__clients=False,
                         **{k.replace(".", "__"): v for k, v in {**DIM, **COURSES[name]}.items()})).run()
        deployed = torch.load(out / "final_model.pt", weights_only=True)
        simulated = torch.load(sim / "final_model.pt", weights_only=True)
        for entry in simulated:
            assert torch.allclose(deployed[entry], simulated[entry], rtol=0, atol=1e-6), (name, entry)
        dep, simr, unc = _records(out), _records(sim), _records(plain)
        assert [r["num_updates"] for r in dep] == [r["num_updates"] for r in simr] == [3, 3]
        for d, s, u in zip(dep, simr, unc):
            assert d["bytes_up"] == s["bytes_up"]          # counted off the wire == encoded size
            assert d["bytes_up"] < u["bytes_up"] / 2       # and the encoding is what travelled
