"""What both ends of a gRPC stream share: the outbox, frame helpers, credentials, options.

An `Outbox` outlives the streams that drain it: when a connection breaks, the
messages not yet handed to gRPC stay queued (the one being sent is sent again
whole, and the receiver drops it if it already had it, by message id), and
the next stream of the same session picks up where the last one stopped.
"""
from __future__ import annotations

import itertools
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable, Iterator

import grpc

from fedcore.comm.chunking import FIRST_CHUNK, FRAME_OVERHEAD, chunk_frames
from fedcore.kernel.errors import ConfigError
from fedcore.wire.codec import WireError
from fedcore.wire import fedcore_pb2 as pb

__all__ = ["METHOD", "OwnedQueue", "Outbox", "heartbeat_frame", "bye_frame", "parse_frame", "grpc_options",
           "server_credentials", "channel_credentials", "check_tls_files", "MD_TOKEN", "MD_CLIENT_ID", "MD_SESSION",
           "MD_COURSE", "TOKEN_ENV", "REFUSED_NOTICE", "read_token", "read_tokens", "allowed_silence"]

METHOD = "/fedcore.Fedcore/Connect"
MD_TOKEN = "authorization"          # "Bearer <token>"
MD_CLIENT_ID = "fedcore-client-id"  # requested id; "0" lets the server assign one
MD_SESSION = "fedcore-session"      # random per client process: tells a reconnect from a restart
MD_COURSE = "fedcore-course"        # fingerprint of the course-defining config (comm/fingerprint.py)
MD_REFUSED = "fedcore-refused"      # trailing metadata: the server refused the call itself (not gRPC)
REFUSED = ((MD_REFUSED, "1"),)
MD_RESEND = "fedcore-resend"        # trailing metadata: the server took a large message's turn back
RESEND = ((MD_RESEND, "1"),)
TOKEN_ENV = "FEDCORE_TOKEN"         # where a process finds its token when no file or key names it
INSECURE_NOTED_ENV = "FEDCORE_INSECURE_NOTED"  # "1": fedcore.launch warned of plaintext once for all its processes
INSECURE_WARNING = ("distribute.insecure: true: plaintext gRPC without TLS; models and tokens can be read "
                    "and altered on the network")
REFUSED_NOTICE = "update_refused"   # server -> client, outside the course: an update was not aggregated


def allowed_silence(timeout: float, in_progress: bool, max_chunk: int, min_rate: float) -> float:
    """How long a peer may send nothing before it counts as dead: `timeout`, plus, while one
    of its messages is half-received, the time a whole chunk takes at `min_rate` bytes/s (a
    slow link delivers a chunk's frame only once all of it is in)."""
    return timeout + (max_chunk / min_rate if in_progress else 0.0)


def heartbeat_frame() -> bytes:
    return pb.Frame(heartbeat=pb.Heartbeat(sent_at=time.time())).SerializeToString()


def bye_frame(reason: str) -> bytes:
    return pb.Frame(bye=pb.Bye(reason=reason)).SerializeToString()


def parse_frame(raw: bytes, max_frame_bytes: int) -> pb.Frame:
    """Bytes from the stream -> a Frame with a known kind, or WireError."""
    if not isinstance(raw, (bytes, bytearray)):
        raise WireError("frame is not bytes")
    if len(raw) > max_frame_bytes:
        raise WireError(f"frame of {len(raw)} bytes exceeds the {max_frame_bytes}-byte limit")
    frame = pb.Frame()
    try:
        frame.ParseFromString(raw)
    except Exception as exc:
        raise WireError(f"bytes do not parse as a fedcore Frame: {exc}") from None
    if frame.WhichOneof("kind") is None:
        raise WireError("frame carries nothing this protocol knows")
    return frame


class OwnedQueue:
    """Outgoing items of one session, drained by one stream at a time: the stream that claims
    the queue owns it (a reconnect's stream takes over), and a stream that no longer owns it
    stops. Subclasses say how a waiting stream is woken."""

    def __init__(self, guard):
        self._items: deque = deque()
        self._guard = guard            # a lock (or condition) around the items
        self._owner: object | None = None

    def clear(self) -> None:
        with self._guard:
            self._items.clear()

    def __len__(self) -> int:
        with self._guard:
            return len(self._items)

    def claim(self) -> object:
        """Make the calling stream the only one that drains this queue; returns its token."""
        token = object()
        with self._guard:
            self._owner = token
        self.wake()
        return token

    def release(self, token: object) -> None:
        with self._guard:
            if self._owner is token:
                self._owner = None
        self.wake()

    def wake(self) -> None:
        raise NotImplementedError


class Outbox(OwnedQueue):
    """Queued outgoing items (encoded messages or single frames) of one session."""

    def __init__(self, chunk_size: int, ids: Iterator[int] | None = None, first_size: int = FIRST_CHUNK):
        """`ids` numbers the messages; share one counter among outboxes whose receiver must see
        increasing ids across them (a server's successive sessions with the same client).
        `first_size` bounds a message's first chunk (`chunking.first_chunk_size`)."""
        self._cond = threading.Condition()
        super().__init__(self._cond)
        self.chunk_size, self.first_size = chunk_size, first_size
        self._ids = ids if ids is not None else itertools.count(1)

    def put_message(self, parts: tuple[bytes, ...], sha: bytes | None = None) -> int:
        """Queue one encoded envelope (as parts; `sha` its SHA-256 when already known)."""
        with self._cond:
            mid = next(self._ids)
            self._items.append(("msg", mid, parts, sha))
            self._cond.notify_all()
            return mid

    def put_frame(self, frame: bytes) -> None:
        with self._cond:
            self._items.append(("frame", 0, frame, None))
            self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def frames(self, token: object, alive: Callable[[], bool], interval: float,
               on_idle: Callable[[], bytes | None],
               on_message: Callable[[int], None] | None = None,
               ready: Callable[[], bool] = lambda: True) -> Iterator[bytes]:
        """Frames to write, for as long as this stream owns the outbox and `alive()` holds.

        An item is removed only when the stream asks for the frame after its
        last one, i.e. once gRPC has taken all of it; a heartbeat (from
        `on_idle`, which may return None to end the stream) fills idle intervals,
        and every interval until `ready()` (queued items wait for it: a call the
        server refuses takes what it is sent with it, unread).
        `on_message(size)` is told each message's size as its first frame goes.
        """
        def mine() -> bool:
            return self._owner is token and alive()

        while True:
            with self._cond:
                if (not self._items or not ready()) and mine():
                    self._cond.wait(interval)
                if not mine():
                    return
                item = self._items[0] if self._items and ready() else None
            if item is None:
                idle = on_idle()
                if idle is None:
                    return
                yield idle
                continue
            kind, mid, body, sha = item
            if kind == "frame":
                yield body
            else:
                if on_message is not None:
                    on_message(sum(len(part) for part in body))
                for frame in chunk_frames(body, mid, self.chunk_size, self.first_size, sha=sha):
                    if not mine():
                        return
                    yield frame
            with self._cond:
                if self._items and self._items[0] is item:
                    self._items.popleft()
                    self._cond.notify_all()
            bye = kind == "frame" and pb.Frame.FromString(body).WhichOneof("kind") == "bye"
            item = body = None   # a sent update is not kept alive while the stream waits for more
            if bye:
                return

    def wait_empty(self, timeout: float) -> bool:
        """Block until everything queued was handed over (or `timeout`); True if empty."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._items:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True


def host_port(host: str, port: int) -> str:
    """`host:port` as gRPC and a server_address file take it: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


# ---------------------------------------------------------------- gRPC settings

def grpc_options(chunk_size: int, server: bool) -> list[tuple[str, int]]:
    """Message limits just above one chunk frame, and keepalive that survives NATs."""
    limit = 2 * (chunk_size + FRAME_OVERHEAD)  # frames above chunk size but below this get a clear error
    opts = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
    if server:
        # A connection must finish its handshake within seconds and may not sit idle without
        # a call for long, so idle or half-open sockets cannot hold the server's file descriptors.
        opts += [("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
                 ("grpc.keepalive_permit_without_calls", 1),
                 ("grpc.http2.max_ping_strikes", 0),
                 ("grpc.server_handshake_timeout_ms", 5_000),
                 ("grpc.max_connection_idle_ms", 10_000),
                 # a connection whose peer no longer answers pings (process stopped, network
                 # gone) is closed, ending its streams even where a write waits on flow control;
                 # the answer may queue behind a chunk on a slow link, hence the long timeout
                 ("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 120_000),
                 # gRPC opens its port for sharing by default: a second server on the same port
                 # would start, and the clients would split between the two, each course stalled
                 ("grpc.so_reuseport", 0)]
    else:
        # The ping's answer may queue behind a chunk on a slow link: liveness is the heartbeats'
        # job (distribute.heartbeat_timeout, paced by bytes); keepalive only holds NATs open.
        opts += [("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 60_000),
                 ("grpc.keepalive_permit_without_calls", 1)]
    return opts


def write_secret(path: Path, text: str) -> Path:
    """Write a new file readable by its owner only (created 0600, never wider; never an old file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    return path


def read_token(d: dict) -> str | None:
    """This process's token: `distribute.token`, else the file `distribute.token_file`, else
    the environment variable FEDCORE_TOKEN (so a token never has to be on a command line)."""
    if d.get("token"):
        return d["token"]
    if d.get("token_file"):
        token = _read("distribute.token_file", d["token_file"]).decode(errors="replace").strip()
        if not token:
            raise ConfigError(f"distribute.token_file: '{d['token_file']}' is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def read_tokens(d: dict, num_clients: int) -> dict[int, str]:
    """Server: per-client tokens from `distribute.tokens` or the YAML file `distribute.tokens_file`."""
    tokens, key = d.get("tokens"), "distribute.tokens"
    if not tokens and d.get("tokens_file"):
        import yaml   # the server's side only: a client needs no YAML
        key = "distribute.tokens_file"
        try:
            tokens = yaml.safe_load(_read(key, d["tokens_file"]))
        except yaml.YAMLError:
            raise ConfigError(f"{key}: '{d['tokens_file']}' is not YAML") from None
        if not isinstance(tokens, dict):
            raise ConfigError(f"{key}: '{d['tokens_file']}' must map client ids to tokens")
    out = {}
    for k, v in (tokens or {}).items():
        if not isinstance(k, int) or not 1 <= k <= num_clients or not isinstance(v, str) or not v:
            raise ConfigError(f"{key}: entry {k!r}: keys must be client ids 1..{num_clients} "
                              "and values non-empty strings")
        out[k] = v
    return out


def _read(key: str, path: str | None) -> bytes | None:
    if not path:
        return None
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{key}: file '{p}' does not exist")
    return p.read_bytes()


def check_tls_files(tls: dict, server: bool) -> None:
    """Refuse, in one line, TLS files gRPC would reject only once it starts (a server then
    reports a port it cannot listen on, a client a server it cannot reach): the certificate
    and key must load as a pair, the CA as certificates."""
    import ssl
    cert, key, ca = tls.get("cert"), tls.get("key"), tls.get("ca")
    for name, path in (("cert", cert), ("key", key), ("ca", ca)):
        _read(f"distribute.tls.{name}", path)   # a missing file named first
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.set_ciphers("DEFAULT:@SECLEVEL=0")   # whether the files fit, not Python's policy on key sizes

    def no_passphrase():   # never a prompt: gRPC takes no passphrase either
        raise ValueError("encrypted")
    if cert and key:
        try:
            ctx.load_cert_chain(cert, key, password=no_passphrase)
        except (ssl.SSLError, ValueError, OSError) as exc:
            if str(exc) == "encrypted":
                raise ConfigError(f"distribute.tls.key: '{key}' is encrypted; gRPC needs the key without "
                                  "a passphrase (keep the file readable by the course's user only)") from None
            raise ConfigError(f"distribute.tls.key: '{key}' and distribute.tls.cert '{cert}' are not a PEM "
                              f"certificate and its own private key ({_ssl_reason(exc)})") from None
    if ca:
        try:
            ctx.load_verify_locations(cafile=ca)
        except (ssl.SSLError, ValueError, OSError) as exc:
            raise ConfigError(f"distribute.tls.ca: '{ca}' holds no PEM certificate ({_ssl_reason(exc)})") from None


def _ssl_reason(exc: Exception) -> str:
    """OpenSSL's reason, readable: 'key values mismatch', 'pem lib', ..."""
    import re
    reason = getattr(exc, "reason", None) or re.sub(r"^\[\w+\]\s*|\s*\(_ssl\.c:\d+\)$", "", str(exc))
    return (reason or type(exc).__name__).replace("_", " ").lower()


def server_credentials(tls: dict) -> grpc.ServerCredentials:
    """TLS for the server; mutual TLS (client certificates required) when a CA is given."""
    cert = _read("distribute.tls.cert", tls.get("cert"))
    key = _read("distribute.tls.key", tls.get("key"))
    ca = _read("distribute.tls.ca", tls.get("ca"))
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=ca is not None)


def channel_credentials(tls: dict) -> grpc.ChannelCredentials:
    """TLS for a client: the CA that signed the server's certificate (system roots if none),
    and the client's own certificate when the server asks for one."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read("distribute.tls.ca", tls.get("ca")),
        private_key=_read("distribute.tls.key", tls.get("key")),
        certificate_chain=_read("distribute.tls.cert", tls.get("cert")))
