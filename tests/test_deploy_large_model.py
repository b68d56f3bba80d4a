"""A 100 MB model crosses real gRPC streams in chunks, both ways, bit for bit.

Server and client communicators run in this process on loopback; the
receiving ends are plain recorders, so the test sees exactly what the
reassembly and decoding produced.
"""
import threading

import torch

from fedcore.comm.grpc_client import GrpcClientComm
from fedcore.comm.grpc_server import GrpcServerComm
from fedcore.kernel.message import Message
from fedcore.kernel.scheduler import ImmediateScheduler
from tests.conftest import small_cfg

MB100 = 25_000_000  # float32 elements


class _Recorder:
    def __init__(self, worker_id):
        self.id = worker_id
        self.handlers = type("T", (), {"entries": {"receiving_blob": None}})()
        self.got = []
        self.event = threading.Event()
        self.finished = False

    def deliver(self, msg):
        self.got.append(msg)
        self.event.set()


def test_a_100_mb_model_round_trips_through_chunking(tmp_path):
    common = dict(federate__mode="distributed", federate__client_num=1, distribute__insecure=True,
                  distribute__token="t", distribute__chunk_size=4 * 1024 * 1024,
                  distribute__heartbeat_interval=0.5, distribute__heartbeat_timeout=30.0)
    server_cfg = small_cfg(None, distribute__role="server", distribute__server_port=0, **common)
    server = GrpcServerComm(server_cfg, ImmediateScheduler(), lambda *a: None, lambda *a: None)
    at_server = _Recorder(0)
    server.attach(at_server)
    port = server.start()
    client = GrpcClientComm(small_cfg(None, distribute__role="client", distribute__client_id=1,
                                      distribute__server_port=port, **common), ImmediateScheduler())
    at_client = _Recorder(1)
    try:
        client.start()
        assert client.wait_welcome() == 1
        client.attach(at_client)
        model = {"w": torch.randn(MB100, generator=torch.Generator().manual_seed(0)),
                 "b": torch.arange(10, dtype=torch.int64)}
        client.send(Message("blob", 1, (0,), 3, 1.0, {"model": model, "num_samples": 5}))
        assert at_server.event.wait(120)
        up = at_server.got[0].content
        assert up["num_samples"] == 5 and torch.equal(up["model"]["b"], model["b"])
        assert torch.equal(up["model"]["w"], model["w"])

        server.send(Message("blob", 0, (1,), 3, 2.0, up))
        del up
        assert at_client.event.wait(120)
        down = at_client.got[0]
        assert (down.msg_type, down.sender, down.round) == ("blob", 0, 3)
        assert torch.equal(down.content["model"]["w"], model["w"])
        assert len(at_server.got) == 1 and len(at_client.got) == 1  # nothing delivered twice
    finally:
        client.close()
        server.stop(0.5)
