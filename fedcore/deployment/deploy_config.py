"""A deployed course's configuration: the `distribute.*` keys and their checks, the defaults
derived from the model (message and value bounds), and the secrets kept out of the files a
run writes. Read by every deployed role (`fedcore.deployment.distributed`, `fedcore.deployment.edge_process`)."""
from __future__ import annotations

import os

from fedcore.comm.stream import TOKEN_ENV
from fedcore.comm.turns import TURN_BYTES, TURN_GRACE
from fedcore.kernel.config import declare, non_negative, positive, validator
from fedcore.kernel.errors import ConfigError
from fedcore.wire.census import values_bound

__all__ = ["SECRET_KEYS", "redacted", "message_bound", "value_bound", "loopback"]


declare("distribute.role", str, None, "this process's part in a distributed course (setting it "
        "implies federate.mode: distributed); edge: an edge aggregator of a hierarchical course",
        choices=("server", "client", "edge"))
declare("distribute.server_host", str, "127.0.0.1", "server: address to listen on (0.0.0.0 for all "
        "interfaces); client: the server's host name or address")
declare("distribute.server_port", int, 50051, "server: port to listen on (0 picks a free one and "
        "writes host:port to <outdir>/server_address); client: the server's port",
        check=lambda v: None if 0 <= v <= 65535 else "must be in 0..65535")
declare("distribute.client_id", int, 0, "client: the id to join as (1..federate.client_num; its data "
        "partition), or 0 to be assigned one", check=non_negative)
declare("distribute.own_data", bool, False, "client: all of this machine's data.root is its own data "
        "(split train/val/test by data.splits) instead of partition distribute.client_id of the "
        "shared dataset")
declare("distribute.min_clients", int, None, "server: start once this many clients have joined and "
        "distribute.join_timeout has passed (default: wait for federate.client_num)", check=positive)
declare("distribute.join_timeout", float, 60.0, "server: seconds to wait for all clients before "
        "starting with distribute.min_clients", check=positive)
declare("distribute.token", str, None, "shared secret a client presents (server: the one it accepts); "
        "prefer distribute.token_file or the FEDCORE_TOKEN environment variable, which keep it off "
        "command lines")
declare("distribute.token_file", str, None, "file holding distribute.token (read when the key is "
        "unset; then FEDCORE_TOKEN is tried)")
declare("distribute.tokens", dict, None, "server: per-client tokens {client_id: token}; a client "
        "with its own token must present it (and may omit distribute.client_id)")
declare("distribute.tokens_file", str, None, "server: YAML file mapping client ids to their tokens "
        "(read when distribute.tokens is unset)")
declare("distribute.tls.cert", str, None, "PEM certificate of this process (server: required for TLS; "
        "client: for mutual TLS)")
declare("distribute.tls.key", str, None, "PEM private key matching distribute.tls.cert")
declare("distribute.tls.ca", str, None, "PEM CA certificate(s). Server: require and verify client "
        "certificates (mutual TLS). Client: verify the server (default: system roots)")
declare("distribute.tls.server_name", str, None, "client: the name the server's certificate is "
        "issued to, when it differs from distribute.server_host")
declare("distribute.insecure", bool, False, "allow plaintext gRPC without TLS (trusted networks only; "
        "logs a warning)")
declare("distribute.chunk_size", int, 2 * 1024 * 1024, "bytes per chunk of a streamed message",
        check=lambda v: None if 1024 <= v <= 64 * 1024 * 1024 else "must be in 1 KiB..64 MiB")
declare("distribute.stream_window", int, 256 * 1024, "server: bytes a client's stream may send ahead "
        "of the server's reading (HTTP/2 flow control). Every client waiting for its turn to upload "
        "a large update holds about twice this in the server; an upload moves at most this much per "
        "round trip (256 KiB over 50 ms: 5 MB/s): raise it for large models over long links. 0: "
        "gRPC's bandwidth probe sizes it (about 8 MB a waiting client), as it does wherever the course's "
        "messages are too small to take turns (under 16 MiB)",
        check=lambda v: None if v == 0 or 64 * 1024 <= v <= 64 * 1024 * 1024 else "must be 0 or in 64 KiB..64 MiB")
declare("distribute.spool_bytes", int, 16 * 1024 * 1024, "server: a received message this large or "
        "larger is written to an unlinked file in distribute.spool_dir as it arrives and read from it "
        "mapped, a slice at a time, so the update being folded is not one more model in the server's "
        "memory; a global model this large waits in such a file while a folding round collects "
        "(docs/compression.md, large models); 0: every message and the model are held in memory",
        check=lambda v: None if v == 0 or v >= 16 * 1024 * 1024 else
        "must be 0 (off) or at least 16 MiB (16777216): smaller messages are parsed by protobuf, in memory")
declare("distribute.spool_dir", str, None, "server: folder of distribute.spool_bytes' files, on a disk "
        "(a tmpfs would keep them in memory) (default: the server's outdir, else the system's "
        "temporary folder)")
declare("distribute.max_message_bytes", int, None, "largest encoded message accepted; larger "
        "ones are refused (INVALID_ARGUMENT) before being buffered (default: 4 x the model's "
        "encoded size + 1 MiB)", check=positive)
declare("distribute.max_connections", int, None, "server: connections taken at once; more are "
        "closed as they come (default: the open-files limit less 64, kept for the server's own "
        "files)", check=positive)
declare("distribute.max_connections_per_address", int, None, "server: connections one peer address "
        "may hold; those beyond it that no live session uses are closed within a second "
        "(default: a quarter of distribute.max_connections' value, at least 16; Linux only)",
        check=positive)
declare("distribute.max_streams_per_connection", int, None, "server: calls one connection may have "
        "open at once (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS; gRPC refuses more itself). Each "
        "client needs at most 3; clients in one process share one connection (default: 3 per "
        "client + 16, the server's limit on calls; 4 where every client has its own process "
        "makes a flood of calls cost the server about half as much)", check=positive)
declare("distribute.pause_after_closed_calls", bool, True, "server: after taking a call that gRPC had "
        "queued for a connection already closed for its refusals, hold back the taking of further "
        "calls for 1 ms (at most a quarter of the time), so that gRPC drops that connection's other "
        "calls itself: a rapid reset costs the server a fraction of what it did, while calls wait "
        "a little longer in gRPC's backlog (docs/threat_model.md). false: take calls "
        "as fast as they come")
declare("distribute.max_message_values", int, None, "largest number of values (fields and list "
        "entries of the encoding) a message may hold; more is refused before it is decoded "
        "(default: 64 per model tensor + 32 per client + 4096)", check=positive)
declare("distribute.min_bytes_per_second", float, 10_000.0, "slowest link served: a half-received "
        "message must keep arriving at this rate (it may take a chunk's time at this rate between "
        "frames), or its stream is closed and its memory freed", check=positive)
declare("distribute.turn_bytes_per_second", float, 1_000_000.0, "server: large messages (of "
        f"{TURN_BYTES >> 20} MiB or more) are received one at a time; while another waits, the one "
        f"being received must arrive at this rate after its first {TURN_GRACE:g} seconds, or its "
        "stream is ended (UNAVAILABLE) and its client sends it again, behind the others: a slow or "
        "trickling sender cannot hold every other upload back. A client on a slower link uploads a "
        "large message only while no other waits (a token holder keeping an upload waiting can keep "
        "it out): set this below the slowest honest link. 0: a turn is never taken back",
        check=non_negative)
declare("distribute.heartbeat_interval", float, 2.0, "seconds between heartbeats on an idle stream",
        check=positive)
declare("distribute.heartbeat_timeout", float, 10.0, "seconds without any frame after which a peer "
        "counts as dead", check=positive)
declare("distribute.round_deadline", float, None, "server, sync course: seconds after a round starts "
        "(a secure course: after each stage's request) after which clients that have not replied are "
        "dropped from it (default: derived, see distribute.deadline_factor)", check=positive)
declare("distribute.deadline_factor", float, 5.0, "server, sync course without round_deadline: a "
        "client still not replying after this many times the other clients' median reply time (at "
        "least distribute.heartbeat_timeout, at most distribute.max_round_deadline) is dropped from "
        "the round and not sampled again until it replies (a secure course: timed per stage, on the "
        "replies to that stage; one silent after the model's stage is sampled again)",
        check=lambda v: None if v >= 1 else "must be at least 1")
declare("distribute.max_round_deadline", float, 600.0, "server, sync course without round_deadline: "
        "ceiling in seconds on the derived deadline (plus the model's transfer time at "
        "distribute.min_bytes_per_second), whatever the clients' reply times; also the deadline "
        "before any client has replied", check=positive)
declare("distribute.retry_timeout", float, 60.0, "client: seconds without a server before giving up "
        "(exit code 4)", check=positive)
declare("distribute.backoff_initial", float, 0.5, "client: first reconnect delay in seconds (doubles "
        "on each failure, with jitter)", check=positive)
declare("distribute.backoff_max", float, 10.0, "client: longest reconnect delay in seconds",
        check=positive)
declare("distribute.metrics_port", int, None, "server or edge: serve Prometheus metrics at /metrics "
        "and the health checks /healthz and /readyz on this port (0 picks a free one and writes "
        "host:port to <outdir>/metrics_address; default: off; needs the 'ops' extra)",
        check=lambda v: None if 0 <= v <= 65535 else "must be in 0..65535")
declare("distribute.metrics_host", str, "127.0.0.1", "address distribute.metrics_port listens on "
        "(0.0.0.0 for all interfaces; the dashboard then needs distribute.operator_token_file)")
declare("distribute.dashboard", bool, False, "server: also serve the live dashboard at /dashboard/ "
        "on distribute.metrics_port")
declare("distribute.operator_token_file", str, None, "file holding the operator's token: /metrics "
        "and /dashboard/ then answer only requests with the header 'Authorization: Bearer <token>' "
        "(the health checks stay open to probes)")


@validator
def _check_distribute(cfg) -> None:
    role = cfg["distribute.role"]
    if role is None:  # a role makes the run distributed, whatever federate.mode says
        return
    if role == "client" and cfg["resume_from"]:
        raise ConfigError("resume_from: a client resumes through its server (distribute.role=server "
                          "resume_from=latest); drop resume_from from the client's command")
    cert, key, ca = cfg["distribute.tls.cert"], cfg["distribute.tls.key"], cfg["distribute.tls.ca"]
    insecure = cfg["distribute.insecure"]
    if bool(cert) != bool(key):
        raise ConfigError("distribute.tls.cert and distribute.tls.key go together: set both or neither")
    if insecure and (cert or ca):
        raise ConfigError("distribute.insecure: true conflicts with distribute.tls.*; drop one of them")
    if cfg["distribute.heartbeat_interval"] >= cfg["distribute.heartbeat_timeout"]:
        raise ConfigError("distribute.heartbeat_timeout must exceed distribute.heartbeat_interval")
    n = cfg["federate.client_num"]
    if role == "server":
        if not insecure and not cert:
            raise ConfigError("distribute.tls.cert: the server needs a TLS certificate and key "
                              "(distribute.tls.cert, distribute.tls.key), or distribute.insecure: true "
                              "to run plaintext on a trusted network")
        if not (cfg["distribute.token"] or cfg["distribute.tokens"] or cfg["distribute.token_file"]
                or cfg["distribute.tokens_file"] or os.environ.get(TOKEN_ENV) or ca or insecure):
            raise ConfigError("distribute.token: the server cannot authenticate clients: set "
                              "distribute.tokens_file, distribute.token_file, FEDCORE_TOKEN or "
                              "distribute.tls.ca (client certificates)")
        for k, v in (cfg["distribute.tokens"] or {}).items():
            if not isinstance(k, int) or not 1 <= k <= n or not isinstance(v, str) or not v:
                raise ConfigError(f"distribute.tokens: entry {k!r}: keys must be client ids 1..{n} "
                                  "and values non-empty strings")
        spool = cfg["distribute.spool_dir"]
        if spool is not None and cfg["distribute.spool_bytes"] and not (
                os.path.isdir(spool) and os.access(spool, os.W_OK | os.X_OK)):
            raise ConfigError(f"distribute.spool_dir: {spool} is not a writable folder")
        m = cfg["distribute.min_clients"]
        if m is not None and m > n:
            raise ConfigError(f"distribute.min_clients: {m} exceeds federate.client_num {n}")
    elif role == "client" and cfg["distribute.client_id"] > n:
        raise ConfigError(f"distribute.client_id: {cfg['distribute.client_id']} exceeds "
                          f"federate.client_num {n}")


def loopback(host: str) -> bool:
    """Whether `host` names this machine only (127.0.0.0/8, ::1, localhost)."""
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@validator
def _check_operations(cfg) -> None:
    """The dashboard shows the course's records: beyond this machine only to its operator."""
    if (cfg["distribute.dashboard"] and cfg["distribute.metrics_port"] is not None
            and not loopback(cfg["distribute.metrics_host"]) and not cfg["distribute.operator_token_file"]):
        raise ConfigError(f"distribute.dashboard: served on {cfg['distribute.metrics_host']}, beyond "
                          "this machine, it needs distribute.operator_token_file (or "
                          "distribute.metrics_host=127.0.0.1)")


SECRET_KEYS = ("distribute.token", "distribute.tokens")


def redacted(cfg):
    """`cfg` with its secrets replaced, for the files a run writes."""
    values = {k: ("<redacted>" if k in SECRET_KEYS and v else v) for k, v in cfg._values.items()}
    return type(cfg)(values, cfg.sources)


def message_bound(model) -> int:
    """The default distribute.max_message_bytes: room for four copies of the model's encoded
    tensors (an update with deltas or control variates) plus 1 MiB of names and framing."""
    return 4 * sum(t.numel() * t.element_size() for t in model.state_dict().values()) + 2 ** 20


def value_bound(model, cfg) -> int:
    """The default distribute.max_message_values, from the model's tensors and the clients."""
    return values_bound(len(model.state_dict()), cfg["federate.client_num"])
