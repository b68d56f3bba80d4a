"""Secure aggregation between real processes: the same course as in simulation, and a client
SIGKILLed after the share stage whose masks are rebuilt from the survivors' shares."""
import json

import pytest
import torch

from tests.conftest import need_extra

need_extra("secagg")

from fedcore.algorithms.secagg_identity import write_roster
from fedcore.runtime.course import Course
from tests.conftest import small_cfg
from tests.deploy_helpers import FORK, server_port, text, wait_exit, write_cfg

pytestmark = pytest.mark.slow

KEYS = {"secure_aggregation.enabled": True, "eval.clients": False, "model.dtype": "float64"}


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _same_model(deployed_dir, simulated_dir):
    deployed = torch.load(deployed_dir / "final_model.pt", weights_only=True)
    simulated = torch.load(simulated_dir / "final_model.pt", weights_only=True)
    assert deployed.keys() == simulated.keys()
    for entry in simulated:
        assert torch.allclose(deployed[entry], simulated[entry], rtol=0, atol=1e-6), entry


def test_a_secure_course_over_grpc_equals_its_simulation(tmp_path, procs):
    cfg = write_cfg(tmp_path / "course.yaml", {**KEYS, "distribute.heartbeat_interval": 0.5})
    out = tmp_path / "deployed"
    launcher = procs.start("launch", ["-m", "fedcore.launch", *FORK, "--cfg", str(cfg), f"outdir={out}"])
    assert wait_exit(launcher, 300) == 0, text(launcher)[-3000:]
    assert "refused" not in text(launcher) and "client 3: course finished" in text(launcher)

    sim_dir = tmp_path / "simulated"
    Course(small_cfg(sim_dir, federate__client_num=3,
                     **{k.replace(".", "__"): v for k, v in KEYS.items()})).run()
    _same_model(out, sim_dir)
    dep, sim = _records(out / "metrics.jsonl"), _records(sim_dir / "metrics.jsonl")
    assert [r["round"] for r in dep] == [r["round"] for r in sim] == [1, 2]
    for d, s in zip(dep, sim):
        assert d["num_updates"] == s["num_updates"] == 3
        assert d["secagg_messages"] == s["secagg_messages"] == 3 * 9
        assert d["secagg_bytes"] == s["secagg_bytes"]


def test_a_client_killed_after_sharing_is_recovered(tmp_path, procs):
    faults = {"plugins": ["tests.secagg_kill_plugin"], "secagg_test.kill_client": 4,
              "federate.client_num": 4, "distribute.insecure": True, "distribute.token": "t",
              "distribute.heartbeat_interval": 0.2, "distribute.heartbeat_timeout": 3.0,
              "distribute.retry_timeout": 2.0}
    roster, key_files = write_roster(tmp_path, [1, 2, 3, 4])     # the operator's part
    cfg = write_cfg(tmp_path / "course.yaml", {**KEYS, **faults, "secure_aggregation.roster": str(roster)})
    out = tmp_path / "deployed"
    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0",
                           f"outdir={out}")
    port = server_port(out, server)
    clients = [procs.fedcore(f"client{k}", cfg, "distribute.role=client", f"distribute.server_port={port}",
                             f"distribute.client_id={k}", f"secure_aggregation.signing_key={key_files[k]}")
               for k in (1, 2, 3, 4)]
    assert wait_exit(server, 240) == 0, text(server)[-3000:]
    assert wait_exit(clients[3], 10) == -9                  # SIGKILLed itself after sharing
    for c in clients[:3]:
        assert wait_exit(c, 60) == 0
    log = text(server)
    assert "client 4 lost in round 1" in log
    assert "client(s) [4] dropped after sharing; their masks are rebuilt" in log
    rec = _records(out / "metrics.jsonl")
    assert [r["num_updates"] for r in rec] == [3, 3] and rec[0]["secagg_dropped"] == 1

    # The simulation in which client 4 always vanishes after sharing sums the same survivors.
    trace = tmp_path / "devices.json"
    trace.write_text(json.dumps([{"client_id": c, "dropout": 1.0 if c == 4 else 0.0} for c in range(1, 5)]))
    sim_dir = tmp_path / "simulated"
    Course(small_cfg(sim_dir, federate__client_num=4, time__profiles={"type": "trace", "path": str(trace)},
                     **{k.replace(".", "__"): v for k, v in KEYS.items()})).run()
    _same_model(out, sim_dir)


ADVERSARY = {**KEYS, "plugins": ["tests.secagg_adversary_plugin"], "federate.client_num": 4,
             "distribute.heartbeat_interval": 0.5}


def test_a_lying_server_over_grpc_gets_no_share_and_exits_non_zero(tmp_path, procs):
    """The server shows two survivor sets ({1,2,3} to clients 1 and 2, {1,3,4} to 3 and 4): each
    gathers two signatures, short of the quorum of 3, so every client refuses to unmask."""
    cfg = write_cfg(tmp_path / "course.yaml", {**ADVERSARY, "secagg_test.adversary": "split_server",
                                               "federate.total_round_num": 1})
    out = tmp_path / "deployed"
    launcher = procs.start("launch", ["-m", "fedcore.launch", *FORK, "--cfg", str(cfg), f"outdir={out}"])
    assert wait_exit(launcher, 300) == 6, text(launcher)[-3000:]     # nothing was aggregated
    log = text(launcher)
    for k in (1, 2, 3, 4):
        assert (f"client {k}: round 1: secure aggregation refused: 2 valid signature(s) from survivors "
                "on the survivor set I signed, fewer than 3") in log
    assert "no round of the course could be aggregated" in log
    (rec,) = _records(out / "metrics.jsonl")
    assert rec["secagg_aborted"] == 1 and rec["secagg_refusals"] == 4 and rec["num_updates"] == 0


def test_a_server_withholding_a_clients_shares_over_grpc_gets_no_input_from_it(tmp_path, procs):
    """Client 1 is routed no share: it refuses before masking (its self mask alone would not
    protect its input), and the course sums the other three every round."""
    cfg = write_cfg(tmp_path / "course.yaml", {**ADVERSARY, "secagg_test.adversary": "withholding_server"})
    out = tmp_path / "deployed"
    launcher = procs.start("launch", ["-m", "fedcore.launch", *FORK, "--cfg", str(cfg), f"outdir={out}"])
    assert wait_exit(launcher, 300) == 0, text(launcher)[-3000:]
    assert ("client 1: round 1: secure aggregation refused: good shares from 0 neighbour(s) reached me, "
            "fewer than the threshold 2") in text(launcher)
    assert [r["num_updates"] for r in _records(out / "metrics.jsonl")] == [3, 3]


def test_a_client_sending_garbage_shares_over_grpc_is_excluded_and_the_rest_train(tmp_path, procs):
    keys = {**ADVERSARY, "secagg_test.adversary": "garbage_shares", "secagg_test.bad_client": 4}
    cfg = write_cfg(tmp_path / "course.yaml", keys)
    out = tmp_path / "deployed"
    launcher = procs.start("launch", ["-m", "fedcore.launch", *FORK, "--cfg", str(cfg), f"outdir={out}"])
    assert wait_exit(launcher, 300) == 0, text(launcher)[-3000:]
    log = text(launcher)
    assert "client 4 excluded: its shares failed their checks at client(s) [1, 2, 3]" in log
    assert [r["num_updates"] for r in _records(out / "metrics.jsonl")] == [3, 3]
    # the same adversary in simulation: the same model
    sim_dir = tmp_path / "simulated"
    Course(small_cfg(sim_dir, **{k.replace(".", "__"): v for k, v in keys.items()})).run()
    _same_model(out, sim_dir)
