"""Tokens: per-client by default, never on a command line, never in an output file."""
import os
import stat
import time
from pathlib import Path

import pytest
import yaml

from fedcore.deployment.distributed import ServerCourse
from fedcore.launch import write_private
from tests.conftest import small_cfg
from tests.deploy_helpers import text, wait_exit, write_cfg
from tests.deploy_helpers import children as _children


@pytest.mark.slow
def test_launch_gives_each_client_its_own_token_off_the_command_line_and_out_of_the_outputs(tmp_path, procs):
    cfg = write_cfg(tmp_path / "course.yaml", {"federate.client_num": 2, "federate.total_round_num": 1})
    out = tmp_path / "out"
    # the launcher is forked from the test's fork server; the processes it starts (spawn) are fresh
    # interpreters, whose command lines and environments /proc shows as they were given
    launch = procs.start("launch", ["-m", "fedcore.launch", "--start-method", "spawn", "--cfg", str(cfg),
                                    f"outdir={out}"])
    seen: dict[int, tuple[str, str]] = {}  # pid -> (command line, FEDCORE_TOKEN or "")
    deadline = time.monotonic() + 240
    while launch.poll() is None and time.monotonic() < deadline:
        for pid in _children(launch.pid):
            try:
                cmd = (Path(f"/proc/{pid}") / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                env = (Path(f"/proc/{pid}") / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            token = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"FEDCORE_TOKEN=")), "")
            seen[pid] = (cmd, token)
        time.sleep(0.2)
    code = wait_exit(launch, 60)
    log = text(launch)
    assert code == 0, log[-3000:]
    assert log.count("plaintext gRPC without TLS") == 1   # one warning for the launch, not one per process

    tokens = {t for _, t in seen.values() if t}
    servers = [c for c, _ in seen.values() if "distribute.role=server" in c]
    guardians = [t for c, t in seen.values() if "launch_guard.py" in c]
    assert guardians == [""]  # the guardian holds no token either
    assert len(seen) == 4 and len(tokens) == 2  # one token per client, the server has none in its env
    assert servers and "distribute.tokens_file=" in servers[0]
    tokens_file = Path(servers[0].split("distribute.tokens_file=")[1].split()[0])
    assert not tokens_file.exists()  # removed when the launch ended
    for cmd, _ in seen.values():
        assert "token=" not in cmd.replace("tokens_file=", "") and not any(t in cmd for t in tokens)
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"config.yaml", "summary.json", "metrics.jsonl", "final_model.pt"}
    for p in files:
        data = p.read_bytes()
        assert not any(t.encode() in data for t in tokens), p
    assert not any(t in log for t in tokens)


def test_tokens_file_is_private_and_secrets_are_redacted_from_config_yaml(tmp_path):
    path = write_private(tmp_path / "tokens.yaml", {1: "secret-one", 2: "secret-two"})
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert yaml.safe_load(path.read_text()) == {1: "secret-one", 2: "secret-two"}
    cfg = small_cfg(tmp_path / "out", federate__mode="distributed", distribute__role="server",
                    distribute__insecure=True, distribute__token="shared-secret",
                    distribute__tokens={1: "secret-one"})
    course = ServerCourse(cfg, tmp_path / "out")
    course.write_header()
    written = (tmp_path / "out" / "config.yaml").read_text()
    assert "shared-secret" not in written and "secret-one" not in written and "<redacted>" in written
    # where each value came from is written as in simulation (redacting kept the sources)
    sources = yaml.safe_load((tmp_path / "out" / "config_sources.yaml").read_text())
    assert sources["distribute.token"] == sources["federate.mode"] != "default"
    assert "shared-secret" not in (tmp_path / "out" / "config_sources.yaml").read_text()
    assert course.cfg["distribute.token"] == "shared-secret"  # the running course keeps its secrets


def test_a_client_reads_its_token_from_a_file_or_the_environment(tmp_path, monkeypatch):
    from fedcore.comm.stream import read_token, read_tokens
    from fedcore.kernel.errors import ConfigError
    f = tmp_path / "token"
    f.write_text("from-file\n")
    assert read_token({"token": None, "token_file": str(f)}) == "from-file"
    monkeypatch.setenv("FEDCORE_TOKEN", "from-env")
    assert read_token({"token": None, "token_file": None}) == "from-env"
    assert read_token({"token": "from-key", "token_file": str(f)}) == "from-key"
    (tmp_path / "empty").write_text("")
    with pytest.raises(ConfigError, match="distribute.token_file"):
        read_token({"token": None, "token_file": str(tmp_path / "empty")})
    (tmp_path / "tokens.yaml").write_text("1: a\n5: b\n")
    with pytest.raises(ConfigError, match=r"distribute.tokens_file: entry 5"):
        read_tokens({"tokens": None, "tokens_file": str(tmp_path / "tokens.yaml")}, 3)
