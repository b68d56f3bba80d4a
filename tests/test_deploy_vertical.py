"""A vertical course deployed as real processes (the active party serving, the passive parties
as clients) equals its simulation (SplitNN and HE-LR); a passive party that dies, or that sends
malformed activations (refused on the wire), stops the course with one line naming it."""
from __future__ import annotations

import json

import pytest
import torch
import yaml

pytest.importorskip("cryptography", reason="vertical courses need the 'vertical' extra (pip install 'fedcore[vertical]')")

from fedcore.kernel.config import load_config  # noqa: E402
from fedcore.runtime.course import Course  # noqa: E402
from tests.deploy_helpers import ROOT, serve_course, text, wait_exit, wait_for  # noqa: E402

pytestmark = pytest.mark.slow


def _cfg(tmp_path, scenario: str = "vertical_split", **over):
    """A shipped scenario (vertical_split: digits, 3 parties, Adam) with one epoch."""
    tree = yaml.safe_load((ROOT / "scenarios" / f"{scenario}.yaml").read_text())
    tree["federate"]["total_round_num"] = 1
    tree["verbose"] = False
    tree.setdefault("distribute", {}).update({"heartbeat_interval": 0.5, **over})
    path = tmp_path / "vertical.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _deployed_and_simulated(tmp_path, procs, cfg, parties: list[int]):
    """The final models (every party's, joined) of `cfg` deployed and simulated, and their
    out folders."""
    out = tmp_path / "deployed"
    launcher = procs.start("launch", [
        "-m", "fedcore.launch", "--start-method", "forkserver", "--cfg", str(cfg), f"outdir={out}",
        "--client-opt", f"vertical.party_model={tmp_path / 'party{party}.pt'}"])
    assert wait_exit(launcher, 120) == 0, text(launcher)[-3000:]
    log = text(launcher)
    for k in parties:
        assert f"client {k}: course finished" in log, log[-3000:]

    sim_dir = tmp_path / "simulated"
    Course(load_config(str(cfg), extra={"outdir": str(sim_dir)})).run()
    simulated = torch.load(sim_dir / "final_model.pt", weights_only=True)
    deployed = torch.load(out / "final_model.pt", weights_only=True)   # the active party's
    assert not any(k.startswith(tuple(f"{w}{p}" for p in parties for w in ("bottom", "w"))) for k in deployed)
    for k in parties:   # each passive party's model stays with it
        own = torch.load(tmp_path / f"party{k}.pt", weights_only=True)
        assert own and not set(own) & set(deployed)
        deployed.update(own)
    assert deployed.keys() == simulated.keys()
    for name, value in simulated.items():
        assert torch.allclose(deployed[name], value, rtol=0, atol=1e-6), name
    return out, sim_dir


def test_deployed_splitnn_equals_the_simulation(tmp_path, procs):
    cfg = _cfg(tmp_path)
    out, sim_dir = _deployed_and_simulated(tmp_path, procs, cfg, [1, 2])
    dep, sim = _records(out / "metrics.jsonl"), _records(sim_dir / "metrics.jsonl")
    assert [r["round"] for r in dep] == [r["round"] for r in sim] == [1]
    assert dep[0]["test_acc"] == pytest.approx(sim[0]["test_acc"], abs=1e-6)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["psi_intersection"] == json.loads((sim_dir / "summary.json").read_text())["psi_intersection"]


def test_deployed_he_lr_equals_the_simulation(tmp_path, procs):
    """Encryption, masks and decryption cancel exactly: only the (shared) fixed-point code
    differs from plaintext, the same in both runs."""
    cfg = _cfg(tmp_path, "vertical_lr")
    tree = yaml.safe_load(cfg.read_text())
    tree["vertical"]["he"]["key_bits"] = 384   # fast; what is compared does not depend on the key
    cfg.write_text(yaml.safe_dump(tree))
    out, sim_dir = _deployed_and_simulated(tmp_path, procs, cfg, [1])
    dep, sim = _records(out / "metrics.jsonl"), _records(sim_dir / "metrics.jsonl")
    assert dep[0]["test_acc"] == pytest.approx(sim[0]["test_acc"], abs=1e-6)


def test_a_passive_party_that_dies_stops_the_course_naming_it(tmp_path, procs):
    cfg = _cfg(tmp_path, heartbeat_timeout=3.0, insecure=True)   # loopback
    tree = yaml.safe_load(cfg.read_text())
    tree["federate"]["total_round_num"] = 1000   # still training when the party dies
    cfg.write_text(yaml.safe_dump(tree))
    out = tmp_path / "deployed"
    server, _port, client = serve_course(procs, cfg, out)
    parties = {k: client(k) for k in (1, 2)}
    wait_for(lambda: "(2 of 2)" in text(server), 60, "both passive parties to join")
    parties[1].kill()
    code = wait_exit(server, 60)
    log = text(server)
    assert code not in (0, None), log[-3000:]
    lines = [line for line in log.splitlines() if "party 1 left before the course finished" in line]
    assert len(lines) == 1 and lines[0].startswith("fedcore: vertical: party 1"), log[-3000:]


def test_a_party_sending_malformed_activations_is_refused_on_the_wire_and_named(tmp_path, procs):
    cfg = _cfg(tmp_path, insecure=True)   # loopback
    out = tmp_path / "deployed"
    server, port, client = serve_course(procs, cfg, out)
    client(2)
    procs.fedcore("client1", cfg, "distribute.role=client", f"distribute.server_port={port}",
                             "distribute.client_id=1", "plugins=[tests.vertical_attacker]")
    code = wait_exit(server, 60)
    log = text(server)
    assert code not in (0, None), log[-3000:]
    assert "refused a message: activations h is (32, 17)" in log, log[-3000:]   # on the wire, not in a handler
    assert "raised" not in log and "Traceback" not in log, log[-3000:]
    lines = [line for line in log.splitlines() if line.startswith("fedcore: vertical: party 1 left before")]
    assert len(lines) == 1 and "refused" in lines[0], log[-3000:]
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip()   # no round
