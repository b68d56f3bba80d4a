"""The client's wire, chunking, credentials and event loop import without torch, and a
numpy-form round trip matches the torch form byte for byte."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from fedcore.execution.form_boundary import FormBoundary, at_boundary
from fedcore.wire.serialization import encoded_size
from fedcore.wire.tensor_forms import convert, first_nonfinite
from fedcore.wire import fedcore_pb2 as pb
from fedcore.wire.codec import WireError, encode_value, from_value

ROOT = Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter whose imports of torch (and yaml) fail.
BLOCKED = textwrap.dedent("""
    import sys
    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "yaml"):
                raise ImportError(f"{name} is not installed here")
    sys.meta_path.insert(0, Blocker())
    try:
        import torch
    except ImportError:
        pass
    else:
        raise SystemExit("the blocker let torch in")
    import numpy as np
    from fedcore.comm.grpc_client import GrpcClientComm, backoff_delay
    from fedcore.comm.chunking import Reassembler, chunk_frames, envelope_parts
    from fedcore.comm.stream import channel_credentials, Outbox, parse_frame
    from fedcore.kernel.scheduler import WallClockScheduler
    from fedcore.kernel.worker import Client
    from fedcore.kernel.message import Message
    from fedcore.wire import fedcore_pb2 as pb
    from fedcore.wire.codec import decode_envelope, encode_value, from_value

    content = {"model": {"w": np.arange(6, dtype=np.float64).reshape(2, 3)}, "num_samples": 3}
    header = pb.Envelope(msg_type="updates", sender=1, receivers=[0], round=2)
    parts = envelope_parts(header, encode_value(content))
    reasm = Reassembler(1 << 20, 4)
    out = None
    for raw in chunk_frames(parts, 1, 4):
        out = reasm.feed(parse_frame(raw, 4 + 256).chunk) or out
    env = decode_envelope(out)
    back = from_value(env.content, "numpy")
    assert np.array_equal(back["model"]["w"], content["model"]["w"]), back

    # The client's event loop runs: it dials a port where nobody listens and gives up (exit 4).
    import socket
    from fedcore.comm.grpc_client import ServerUnreachable
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    class Cfg(dict):   # the little of a config the communicator reads
        def section(self, name):
            return {k[len(name) + 1:]: v for k, v in self.items() if k.startswith(name + ".")}

    cfg = Cfg({"distribute.server_host": "127.0.0.1", "distribute.server_port": port,
               "distribute.insecure": True, "distribute.tls.server_name": None,
               "distribute.chunk_size": 1 << 16, "distribute.max_message_bytes": None,
               "distribute.heartbeat_interval": 0.2, "distribute.heartbeat_timeout": 1.0,
               "distribute.min_bytes_per_second": 1000.0, "distribute.retry_timeout": 1.0,
               "distribute.backoff_initial": 0.05, "distribute.backoff_max": 0.2,
               "distribute.client_id": 1, "distribute.token": "t", "model.type": "logreg"})
    comm = GrpcClientComm(cfg, WallClockScheduler(), tensor_form="numpy")
    comm.start()
    try:
        comm.wait_welcome()
    except ServerUnreachable as exc:
        print("gave up with exit code", exc.exit_code)
    print("loaded:", sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "yaml")))
""")


def test_client_side_imports_and_runs_without_torch():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", BLOCKED], env=env, capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines() == ["gave up with exit code 4", "loaded: []"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.uint8, torch.bool,
                                   torch.float16])
def test_numpy_and_torch_forms_share_one_wire(dtype):
    t = (torch.arange(12) % 3).to(dtype).reshape(3, 4)
    a = t.numpy()
    assert encode_value({"x": t}) == encode_value({"x": a})
    assert encoded_size({"x": a}) == len(encode_value({"x": a})) == encoded_size({"x": t})
    v = pb.Value.FromString(encode_value(t))
    back = from_value(v, "numpy")
    assert isinstance(back, np.ndarray) and back.dtype == a.dtype and np.array_equal(back, a)
    back.reshape(-1)[0] = 1           # decoded arrays are writable copies
    assert torch.equal(from_value(v, "torch"), t)


def test_numpy_form_refuses_what_it_cannot_hold():
    with pytest.raises(WireError, match="complex"):
        encode_value(np.zeros(2, dtype=np.complex64))
    v = pb.Value.FromString(encode_value(torch.zeros(2, dtype=torch.bfloat16)))
    with pytest.raises(WireError, match="bfloat16"):
        from_value(v, "numpy")
    assert first_nonfinite({"m": {"w": np.array([1.0, np.nan])}}) == "content.m.w"
    assert first_nonfinite({"m": {"w": np.array([1, 2])}}) is None


def test_big_endian_arrays_travel_little_endian():
    a = np.arange(4, dtype=">f8")
    assert encode_value(a) == encode_value(a.astype("<f8"))


class _NumpyEcho:
    """A trainer in numpy form: returns the received model plus the mean of its data."""
    tensor_form = "numpy"
    store = "the trainer's store"

    def fit(self, client_id, data, received, round_):
        from fedcore.kernel.contract import FitResult
        assert isinstance(data.train.x, np.ndarray) and isinstance(received["model"]["w"], np.ndarray)
        w = received["model"]["w"] + data.train.x.mean()
        return FitResult({"model": {"w": w}, "num_samples": len(data.train.y)}, 1.0)


def test_the_boundary_converts_in_and_out():
    from scenarios.data import ClientData, Split
    torch_trainer = type("T", (), {"tensor_form": "torch"})()
    assert at_boundary(torch_trainer) is torch_trainer
    b = at_boundary(_NumpyEcho())
    assert isinstance(b, FormBoundary) and b.store == "the trainer's store"
    s = Split(torch.ones(4, 2, dtype=torch.float64), torch.zeros(4, dtype=torch.int64))
    data = ClientData(s, s, s)
    res = b.fit(1, data, {"model": {"w": torch.zeros(2, dtype=torch.float64)}}, 0)
    assert torch.equal(res.content["model"]["w"], torch.ones(2, dtype=torch.float64))
    assert res.content["num_samples"] == 4
    assert b._their_data(1, data) is b._their_data(1, data)   # converted once per client
    assert convert([torch.ones(1)], "numpy")[0].dtype == np.float32


@pytest.mark.slow
def test_torchless_client_over_tls_with_tokens_and_a_server_restart(tmp_path, procs):
    """Against a real server: admitted over mutual TLS with its own token, refused (exit 2)
    with another client's token, and back after the server's restart. (Exit 4 once the
    server is gone for good is the first test's, without a server to wait for.)"""
    from tests.deploy_helpers import make_certs, server_port, text, wait_exit, wait_for, write_cfg
    certs = make_certs(tmp_path / "certs")
    cfg = write_cfg(tmp_path / "course.yaml", {
        "distribute.tokens": {1: "one", 2: "two", 3: "three"}, "distribute.tls.ca": certs["ca"],
        "distribute.tls.cert": certs["server_cert"], "distribute.tls.key": certs["server_key"],
        "distribute.heartbeat_interval": 0.2, "distribute.heartbeat_timeout": 2.0})
    out = tmp_path / "out"
    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0",
                           f"outdir={out}")
    port = server_port(out, server)
    probe = [str(ROOT / "tests" / "torchless_probe.py"), str(port), certs["ca"], certs["client_cert"],
             certs["client_key"]]

    refused = procs.start("refused", [*probe, "two", "30"])
    assert wait_exit(refused, 60) == 0
    assert "exit 2: ConfigError" in text(refused) and "loaded: []" in text(refused)

    client = procs.start("client", [*probe, "one", "60"])
    wait_for(lambda: "welcomed as client 1" in text(client), 60, "the torch-free client's welcome")
    server.kill()
    server.wait(10)
    again = procs.fedcore("server2", cfg, "distribute.role=server", f"distribute.server_port={port}",
                          f"outdir={tmp_path / 'out2'}")
    wait_for(lambda: "client 1 connected" in text(again), 60, "the reconnect to the new server")
    assert client.poll() is None, text(client)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_the_torch_forms_finiteness_check_sees_nan_and_inf_in_every_float_dtype(dtype):
    from fedcore.wire.tensor_forms import get_form
    torch_form = get_form("torch")
    t = torch.randn(5, 3).to(dtype)
    assert torch_form.all_finite(t) and torch_form.all_finite(t.t())
    for bad in (float("nan"), float("inf"), -float("inf")):
        u = t.clone()
        u[2, 1] = bad
        assert not torch_form.all_finite(u) and not torch_form.all_finite(u.t())   # views too
    assert torch_form.all_finite(torch.randn(3, requires_grad=True).to(dtype))
    assert torch_form.all_finite(torch.tensor([1, 2]))                  # integers are finite
