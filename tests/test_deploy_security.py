"""Transport security between real processes: TLS required, tokens checked, refusals clean."""
import json
import re
import subprocess
import sys
import time

import grpc
import pytest

from tests.deploy_helpers import _env, make_certs, server_port, text, wait_exit, write_cfg

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
    # distribute.retry_timeout with its one documented line and exit code 4, asking whether
    # the server speaks TLS (each connection was closed at once).
    assert wait_exit(plaintext, 120) == 4
    last = text(plaintext).strip().splitlines()[-1]
    assert last.startswith("fedcore: no server at 127.0.0.1:") and "giving up" in last
    assert last.endswith("; the server closed each connection at once: does it speak TLS, where "
                         "this client is plaintext (distribute.insecure)?"), last

    # A wrong token is refused at once with UNAUTHENTICATED (a configuration error: exit 2).
    assert wait_exit(wrong, 120) == 2
    last = text(wrong).strip().splitlines()[-1]
    assert last.startswith("fedcore: distribute.token:") and "UNAUTHENTICATED" in last

    assert server.poll() is None  # still serving
    assert "wrong or missing token" in text(server)


def test_failed_tls_handshakes_write_nothing_to_the_servers_log(tmp_path, procs):
    # gRPC logs an INFO line for every failed TLS handshake, as fast as an outsider makes them
    # fail (2.4 MB/s measured); fedcore keeps gRPC to its errors unless GRPC_VERBOSITY says
    # otherwise. 200 connections sending bytes that are not TLS leave the log as it was.
    import socket
    from tests.deploy_helpers import interrupt, wait_for
    certs = make_certs(tmp_path / "certs")
    cfg = write_cfg(tmp_path / "course.yaml", {"distribute.token": "t"})
    out = tmp_path / "server"
    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0",
                           f"outdir={out}", f"distribute.tls.cert={certs['server_cert']}",
                           f"distribute.tls.key={certs['server_key']}")
    port = server_port(out, server)
    before = len(text(server))
    for _ in range(200):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"GET / HTTP/1.1\r\n\r\n" * 4)
            try:
                s.recv(4096)   # the server's alert, or its close
            except OSError:
                pass
    time.sleep(1.0)
    grown = text(server)[before:]
    assert "Handshake failed" not in grown and len(grown) < 1000, grown[:2000]
    interrupt(server)
    wait_for(lambda: server.poll() is not None, 60, "the server to stop")


def test_a_join_with_a_wrong_fingerprint_learns_no_configuration_value(tmp_path, procs):
    """A token holder without the config probes the server with wrong fingerprints: every
    course-defining key wrong at once, then each key alone. Each refusal names keys, and its
    text holds nothing but the fixed sentence and those names: no value, the seed included."""
    from tests.hostile import Hostile, load_proto
    pb = load_proto(tmp_path / "proto")
    cfg = write_cfg(tmp_path / "course.yaml", {"seed": 48271, "model.type": "mlp", "model.hidden": [23],
                                               "train.optimizer.lr": 0.0731, "distribute.insecure": True,
                                               "distribute.token": "shared"})
    # the server's keys, as a fresh process declares them: this one may have imported modules
    # that declare more (keys that only one side knows are not compared)
    ours = json.loads(subprocess.run(
        [sys.executable, "-c", "import json, sys, fedcore; from fedcore.comm.fingerprint import course_keys; "
         "print(json.dumps(course_keys(fedcore.configure(sys.argv[1]))))", str(cfg)],
        capture_output=True, text=True, check=True, env=_env()).stdout)
    assert ours["seed"] == 48271 and len(ours) > 30
    out = tmp_path / "server"
    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0",
                           f"outdir={out}")
    port = server_port(out, server)
    prefix = "course config differs from the server's: "

    def refusal(fingerprint: str) -> str:
        # A connection that only brought refusals is closed half a second after its refusal;
        # a loaded machine may not have read the status by then, and the probe then sees the
        # socket closed (UNAVAILABLE). It tries again, as a client does.
        for _attempt in range(5):
            probe = Hostile(pb, port, 1, "shared", course=fingerprint).start()
            try:
                assert probe.wait_for("never", timeout=30) is None
            finally:
                probe.close()
            if probe.status != grpc.StatusCode.UNAVAILABLE:
                break
        assert probe.status == grpc.StatusCode.FAILED_PRECONDITION, probe.details
        return probe.details

    everything = refusal(";".join(f"{k}=000000000000" for k in ours))
    assert everything == prefix + ", ".join(sorted(ours)[:8])
    texts = [everything]
    for key in ours:
        texts.append(refusal(f"{key}=000000000000"))
        assert texts[-1] == prefix + key
    for t in texts:   # what follows the sentence is key names only
        assert set(t.removeprefix(prefix).split(", ")) <= set(ours)
    # and, value by value: none of the server's values appears where a name or the sentence
    # does not already hold that text (a value such as "synthetic" is also part of a key name)
    names = prefix + " ".join(ours)
    for key, value in ours.items():
        for shown in {str(value), json.dumps(value, default=str)}:
            if len(shown) >= 2 and shown not in names:
                assert not any(shown in t for t in texts), (key, shown)
    # the model type's value as a word of its own ('mlp' is also inside a key's name, model.mlp_dropout)
    assert all("48271" not in t and "0.0731" not in t and not re.search(r"\bmlp\b", t) for t in texts)
    assert server.poll() is None and "course config differs" in text(server)


def test_a_tls_client_of_a_plaintext_server_is_told_the_handshake_failed(tmp_path, procs):
    certs = make_certs(tmp_path / "certs")
    cfg = write_cfg(tmp_path / "course.yaml", {"distribute.retry_timeout": 2.0,
                                               "distribute.backoff_initial": 0.1})
    out = tmp_path / "server"
    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0",
                           f"outdir={out}", "distribute.insecure=true")
    port = server_port(out, server)
    client = procs.fedcore("tls", cfg, "distribute.role=client", f"distribute.server_port={port}",
                           "distribute.client_id=1", f"distribute.tls.ca={certs['ca']}")
    assert wait_exit(client, 120) == 4
    last = text(client).strip().splitlines()[-1]
    assert last.startswith("fedcore: no server at 127.0.0.1:") and last.endswith(
        "; the TLS handshake failed: is the server plaintext (distribute.insecure) or its "
        "certificate from another authority?")
