"""A deployed vertical course survives the death of a party: real processes on loopback.

A passive party SIGKILLed mid-course stops the active party with one line naming it; started
again with the active party resuming from its latest snapshot (by hand, or by
`fedcore.launch --restart`), every party goes back to its state of that round and the course
finishes with the models of the uninterrupted course (its simulation: a deployed course equals
its simulation to 1e-6, tests/test_deploy_vertical.py). The same holds when the active party is
SIGKILLed and resumed. HE-LR deployed on per-party CSV files equals its simulation.
"""
from __future__ import annotations

import json
import re

import pytest
import torch
import yaml

pytest.importorskip("cryptography", reason="vertical courses need the 'vertical' extra (pip install 'fedcore[vertical]')")

from fedcore.kernel.config import load_config  # noqa: E402
from fedcore.runtime.course import Course  # noqa: E402
from tests.deploy_helpers import server_port, text, wait_exit, wait_for  # noqa: E402

pytestmark = pytest.mark.slow

ROUNDS = 5
PAUSE = "FEDCORE_TEST_PAUSE_IN_SNAPSHOT"   # fedcore.runtime.snapshot's test hook
KILL = "FEDCORE_TEST_KILL_PARTY"           # tests.vertical_killer's

COURSE = {
    "seed": 3, "verbose": False,
    "data": {"type": "synthetic", "partition": "vertical", "test_size": 0.2,
             "synthetic": {"samples_per_client": 45, "dim": 6, "num_classes": 3}},
    "federate": {"client_num": 2, "total_round_num": ROUNDS},   # what fedcore.launch sets: P - 1
    "vertical": {"parties": 3, "keep": 0.9, "method": "splitnn", "cut": 3, "bottom_hidden": [4]},
    "train": {"batch_size": 8, "optimizer": {"type": "adam", "lr": 0.01}},
    "distribute": {"insecure": True, "heartbeat_interval": 0.2, "heartbeat_timeout": 5.0,
                   "retry_timeout": 120.0, "backoff_initial": 0.1, "backoff_max": 0.5},
}


def _cfg(tmp_path, tree=None):
    path = tmp_path / "vertical.yaml"
    path.write_text(yaml.safe_dump(tree or COURSE))
    return path


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _equals_simulation(tmp_path, cfg, out, parties, atol=1e-6):
    """The deployed course's models (the active party's final_model.pt and each passive party's
    vertical.party_model) equal the uninterrupted simulation's; its records are one per round."""
    sim_dir = tmp_path / "simulated"
    Course(load_config(str(cfg), extra={"outdir": str(sim_dir)})).run()
    simulated = torch.load(sim_dir / "final_model.pt", weights_only=True)
    deployed = torch.load(out / "final_model.pt", weights_only=True)
    for k in parties:
        deployed.update(torch.load(tmp_path / f"party{k}.pt", weights_only=True))
    assert deployed.keys() == simulated.keys()
    for name, value in simulated.items():
        assert torch.allclose(deployed[name], value, rtol=0, atol=atol), name
    dep, sim = _records(out), _records(sim_dir)
    assert [r["round"] for r in dep] == [r["round"] for r in sim] == list(range(1, ROUNDS + 1))
    assert [r["test_acc"] for r in dep] == pytest.approx([r["test_acc"] for r in sim], abs=1e-6)


def _server(procs, name, cfg, out, port=0, *extra, env=None):
    return procs.fedcore(name, cfg, "distribute.role=server", f"distribute.server_port={port}",
                         f"outdir={out}", *extra, env=env)


def _party(procs, name, cfg, tmp_path, port, k, env=None):
    """Passive party k, keeping its state in <tmp>/party<k>/client_state/<k>."""
    return procs.fedcore(name, cfg, "distribute.role=client", f"distribute.server_port={port}",
                         f"distribute.client_id={k}", f"outdir={tmp_path / f'party{k}'}",
                         f"vertical.party_model={tmp_path / 'party{party}.pt'}", env=env)


def _started(procs, cfg, tmp_path, out, env=None, party_env=None):
    server = _server(procs, "server", cfg, out, env=env)
    port = server_port(out, server)
    return server, port, {k: _party(procs, f"party{k}", cfg, tmp_path, port, k, (party_env or {}).get(k))
                          for k in (1, 2)}


def _killing(tmp_path):
    """The course's config with tests.vertical_killer loaded (inert unless its variable is set)."""
    tree = yaml.safe_load(yaml.safe_dump(COURSE))
    tree["plugins"] = ["tests.vertical_killer"]
    return _cfg(tmp_path, tree)


STEPS = 19   # party 1 dies after this many steps: in round 3 (an epoch of ~50 aligned rows is ~7 batches)


def test_a_passive_party_killed_and_started_again_by_hand_rejoins_from_the_last_snapshot(tmp_path, procs):
    """Party 1 is SIGKILLed in round 3 (by its own hand, tests.vertical_killer: no timing); the
    active party stops, naming it and its last snapshot; it is resumed (resume_from=latest) and
    party 1 started again by hand; party 2, never stopped, reconnects and goes back to the
    snapshot's round like party 1."""
    cfg = _killing(tmp_path)
    out = tmp_path / "deployed"
    server, port, parties = _started(procs, cfg, tmp_path, out,
                                     party_env={1: {KILL: f"1:{STEPS}:{tmp_path / 'killed'}"}})
    assert wait_exit(parties[1], 120) == -9, text(parties[1])[-3000:]
    assert wait_exit(server, 60) == 1, text(server)[-3000:]
    lines = [x for x in text(server).splitlines() if "party 1 left before the course finished" in x]
    assert len(lines) == 1 and lines[0].startswith("fedcore: vertical: party 1"), text(server)[-3000:]
    r = int(re.search(r"resume_from=latest \(the snapshot of round (\d+)\)", lines[0]).group(1))
    assert 1 <= r < ROUNDS

    again = _server(procs, "server_again", cfg, out, port, "resume_from=latest")
    party1 = _party(procs, "party1_again", cfg, tmp_path, port, 1)
    assert wait_exit(again, 120) == 0, text(again)[-3000:]
    for p in (party1, parties[2]):
        assert wait_exit(p, 60) == 0, text(p)[-3000:]
    assert f"resuming from the snapshot of round {r}" in text(again)
    assert f"party 1 goes on from its state of round {r}" in text(party1)
    assert f"party 2 goes on from its state of round {r}" in text(parties[2])
    _equals_simulation(tmp_path, cfg, out, [1, 2])


def test_the_active_party_killed_and_resumed_goes_on_with_every_party_from_its_snapshot(tmp_path, procs):
    cfg = _cfg(tmp_path)
    out = tmp_path / "deployed"
    server, port, parties = _started(procs, cfg, tmp_path, out, env={PAUSE: "3:60:after"})
    wait_for(lambda: "test pause after the snapshot write of round_3.pt" in text(server), 120,
             "the snapshot of round 3")
    server.kill()
    server.wait(10)
    again = _server(procs, "server_again", cfg, out, port, "resume_from=latest")
    assert wait_exit(again, 120) == 0, text(again)[-3000:]
    for k, p in parties.items():
        assert wait_exit(p, 60) == 0, text(p)[-3000:]
        assert f"party {k} goes on from its state of round 3" in text(p)
    _equals_simulation(tmp_path, cfg, out, [1, 2])


def test_a_passive_party_killed_under_launch_restart_comes_back_and_the_course_finishes(tmp_path, procs):
    """`fedcore.launch --restart 2`: party 1 SIGKILLs itself once, in round 3 (tests.vertical_killer);
    the active party stops naming it (exit 1), and the launcher starts both again, the active
    party resuming from its latest snapshot (party 1 is found by no pid: it dies by its own hand)."""
    cfg = _killing(tmp_path)
    out = tmp_path / "deployed"
    marker = tmp_path / "killed"
    launcher = procs.start("launch", [
        "-m", "fedcore.launch", "--start-method", "forkserver", "--restart", "2", "--cfg", str(cfg),
        f"outdir={out}", "--client-opt", f"vertical.party_model={tmp_path / 'party{party}.pt'}"],
        env={KILL: f"1:{STEPS}:{marker}"})
    assert wait_exit(launcher, 180) == 0, text(launcher)[-3000:]
    log = text(launcher)
    assert marker.exists() and "fedcore.launch: client 1 died (killed by SIGKILL)" in log, log[-3000:]
    assert "fedcore: vertical: party 1 left before the course finished" in log, log[-3000:]
    assert "resuming from the snapshot of round" in log, log[-3000:]
    for k in (1, 2):
        assert f"client {k}: course finished" in log, log[-3000:]
    _equals_simulation(tmp_path, cfg, out, [1, 2])


def _csv(path, header, rows):
    path.write_text("\n".join([",".join(header)] + [",".join(map(str, r)) for r in rows]) + "\n")
    return str(path)


def test_deployed_he_lr_on_per_party_csv_files_equals_its_simulation(tmp_path, procs):
    """Each party reads only its own file; the passive party learns the class count from the
    active party's psi_result."""
    g = torch.Generator().manual_seed(5)
    n = 48
    x = torch.randn(n, 5, generator=g, dtype=torch.float64)
    y = (x[:, 0] + x[:, 3] > 0).long() + (x[:, 4] > 0.8).long()     # three classes
    ids = [f"s{i:03d}" for i in range(n)]
    active = _csv(tmp_path / "active.csv", ["id", "a", "b", "label"],
                  [(ids[i], round(float(x[i, 0]), 6), round(float(x[i, 1]), 6), int(y[i])) for i in range(0, n - 4)])
    passive = _csv(tmp_path / "passive.csv", ["id", "c", "d", "e"],
                   [(ids[i], *(round(float(v), 6) for v in x[i, 2:])) for i in range(4, n)])
    tree = {"seed": 1, "verbose": False, "data": {"partition": "vertical", "label_column": "label", "test_size": 0.25},
            "federate": {"client_num": 1, "total_round_num": 2},
            "vertical": {"parties": 2, "method": "he_lr", "files": [active, passive], "he": {"key_bits": 384}},
            "model": {"dtype": "float64"}, "train": {"batch_size": 8, "optimizer": {"type": "sgd", "lr": 0.3}},
            "distribute": {"insecure": True, "heartbeat_interval": 0.5}}
    cfg = _cfg(tmp_path, tree)
    out = tmp_path / "deployed"
    launcher = procs.start("launch", [
        "-m", "fedcore.launch", "--start-method", "forkserver", "--cfg", str(cfg), f"outdir={out}",
        "--client-opt", f"vertical.party_model={tmp_path / 'party{party}.pt'}"])
    assert wait_exit(launcher, 120) == 0, text(launcher)[-3000:]
    sim_dir = tmp_path / "simulated"
    Course(load_config(str(cfg), extra={"outdir": str(sim_dir)})).run()
    simulated = torch.load(sim_dir / "final_model.pt", weights_only=True)
    deployed = torch.load(out / "final_model.pt", weights_only=True)
    own = torch.load(tmp_path / "party1.pt", weights_only=True)
    assert set(own) == {"w1"} and own["w1"].shape == (3, 3)   # three columns, the active party's three classes
    deployed.update(own)
    assert deployed.keys() == simulated.keys() == {"w0", "bias", "w1"}
    for name, value in simulated.items():
        assert torch.allclose(deployed[name], value, rtol=0, atol=1e-6), name
        assert value.abs().sum() > 0, name   # trained
    dep, sim = _records(out), _records(sim_dir)
    assert [r["test_acc"] for r in dep] == pytest.approx([r["test_acc"] for r in sim], abs=1e-6)


def test_a_passive_party_without_its_state_of_the_snapshot_stops_in_one_line(tmp_path, procs):
    """The course resumed from its snapshot of round 4, party 1's state folder emptied: party 1
    exits 1 with one line (not a handler's error reported while it waits on), and the active
    party stops naming it."""
    cfg = _cfg(tmp_path)
    out = tmp_path / "deployed"
    server, port, parties = _started(procs, cfg, tmp_path, out)
    for p in (server, *parties.values()):
        assert wait_exit(p, 120) == 0, text(p)[-3000:]
    for f in (tmp_path / "party1" / "client_state" / "1").iterdir():
        f.unlink()
    again = _server(procs, "server_again", cfg, out, port, f"resume_from={out / 'checkpoints' / 'round_4.pt'}")
    party1, party2 = (_party(procs, f"party{k}_again", cfg, tmp_path, port, k) for k in (1, 2))
    assert wait_exit(party1, 60) == 1, text(party1)[-3000:]
    lines = [x for x in text(party1).splitlines() if x.startswith("fedcore:")]
    assert len(lines) == 1 and lines[0].startswith(
        "fedcore: vertical: party 1 holds no usable state of round 4 ("), text(party1)[-3000:]
    assert "Traceback" not in text(party1)
    assert wait_exit(again, 60) == 1, text(again)[-3000:]
    assert "fedcore: vertical: party 1 left before the course finished" in text(again)
    assert "party 2 goes on from its state of round 4" in text(party2)
