"""Transport security between real processes: TLS required, tokens checked, refusals clean."""
import pytest

from tests.deploy_helpers import make_certs, server_port, text, wait_exit, write_cfg

pytestmark = pytest.mark.slow


def test_plaintext_client_and_wrong_token_are_refused_by_a_tls_server(tmp_path, procs):
    certs = make_certs(tmp_path / "certs")
    cfg = write_cfg(tmp_path / "course.yaml", {"distribute.retry_timeout": 2.0,
                                               "distribute.backoff_initial": 0.1,
                                               "distribute.heartbeat_interval": 0.5})
    out = tmp_path / "server"
    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0",
                           f"outdir={out}", "distribute.token=right-token",
                           f"distribute.tls.cert={certs['server_cert']}",
                           f"distribute.tls.key={certs['server_key']}")
    port = server_port(out, server)
    client = ("distribute.role=client", f"distribute.server_port={port}", "distribute.client_id=1")
    plaintext = procs.fedcore("plaintext", cfg, *client, "distribute.insecure=true",
                              "distribute.token=right-token")
    wrong = procs.fedcore("wrong", cfg, *client, f"distribute.tls.ca={certs['ca']}",
                          "distribute.token=wrong-token")

    # Plaintext against TLS never gets through the handshake: the client gives up after
    # distribute.retry_timeout with its one documented line and exit code 4.
    assert wait_exit(plaintext, 120) == 4
    last = text(plaintext).strip().splitlines()[-1]
    assert last.startswith("fedcore: no server at 127.0.0.1:") and "giving up" in last

    # A wrong token is refused at once with UNAUTHENTICATED (a configuration error: exit 2).
    assert wait_exit(wrong, 120) == 2
    last = text(wrong).strip().splitlines()[-1]
    assert last.startswith("fedcore: distribute.token:") and "UNAUTHENTICATED" in last

    assert server.poll() is None  # still serving
    assert "wrong or missing token" in text(server)
