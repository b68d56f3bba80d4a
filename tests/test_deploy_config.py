"""distribute.* keys: secure defaults and conflicting settings refused with one line."""
import pytest

from fedcore.kernel.errors import ConfigError
from tests.conftest import small_cfg


def _cfg(**kw):
    return small_cfg(None, federate__mode="distributed", **kw)


def test_server_needs_tls_or_an_explicit_insecure():
    with pytest.raises(ConfigError, match="distribute.insecure: true"):
        _cfg(distribute__role="server", distribute__token="t")
    cfg = _cfg(distribute__role="server", distribute__token="t", distribute__insecure=True)
    assert cfg["distribute.insecure"] is True


def test_server_needs_a_way_to_authenticate_clients():
    with pytest.raises(ConfigError, match="cannot authenticate"):
        _cfg(distribute__role="server", distribute__tls__cert="c.pem", distribute__tls__key="k.pem")
    # client certificates (a CA on the server) are a way
    _cfg(distribute__role="server", distribute__tls__cert="c.pem", distribute__tls__key="k.pem",
         distribute__tls__ca="ca.pem")


@pytest.mark.parametrize("kw, match", [
    (dict(distribute__tls__cert="c.pem"), "go together"),
    (dict(distribute__insecure=True, distribute__tls__ca="ca.pem"), "conflicts"),
    (dict(distribute__min_clients=7, distribute__insecure=True), "exceeds federate.client_num"),
    (dict(distribute__tokens={9: "x"}, distribute__insecure=True), "client ids 1..6"),
    (dict(distribute__heartbeat_interval=5.0, distribute__heartbeat_timeout=5.0,
          distribute__insecure=True), "must exceed"),
])
def test_conflicting_server_settings_are_refused(kw, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(distribute__role="server", **kw)


def test_client_id_must_name_a_partition():
    with pytest.raises(ConfigError, match="distribute.client_id: 7 exceeds"):
        _cfg(distribute__role="client", distribute__client_id=7)
    assert _cfg(distribute__role="client", distribute__client_id=6)["distribute.client_id"] == 6


def test_a_role_alone_makes_the_run_distributed_and_is_checked(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="distribute.insecure: true"):
        small_cfg(None, distribute__role="server", distribute__token="t")
    assert small_cfg(None)["distribute.role"] is None  # standalone runs need none of this
    import fedcore.deployment.distributed
    from fedcore.run import main
    seen = []
    monkeypatch.setattr(fedcore.deployment.distributed, "run_distributed",
                        lambda cfg, out, check_only, command=None: seen.append(cfg) or 0)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("federate: {client_num: 2}\n")
    assert main(["--cfg", str(cfg), "distribute.role=client", "distribute.insecure=true"]) == 0
    assert seen and seen[0]["distribute.role"] == "client"


def test_distributed_mode_needs_a_role(tmp_path):
    from fedcore.deployment.distributed import run_distributed
    with pytest.raises(ConfigError, match="distribute.role"):
        run_distributed(_cfg(), tmp_path)


def test_a_deployed_server_takes_snapshots_and_resumes_but_a_client_resumes_through_it(tmp_path):
    ckpt = tmp_path / "round_1.pt"
    ckpt.write_bytes(b"x")
    server = _cfg(distribute__role="server", distribute__insecure=True, resume_from=str(ckpt),
                  checkpoint__every=2)
    assert server["resume_from"] == str(ckpt) and server["checkpoint.every"] == 2
    assert _cfg(distribute__role="server", distribute__insecure=True, resume_from="latest")
    with pytest.raises(ConfigError, match="^resume_from: a client resumes through its server"):
        _cfg(distribute__role="client", distribute__insecure=True, resume_from=str(ckpt))
    assert small_cfg(None, checkpoint__every=1)["checkpoint.every"] == 1
