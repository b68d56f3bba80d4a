"""A hostile server: the project's own server with one stage changed (run as a process).

`python -m tests.hostile_server COURSE.yaml MODE PORT_FILE` serves the course's
config with fedcore's `GrpcServerComm` (authentication, welcome, framing all
its own); only what an admitted stream gets after its welcome differs, by MODE:

- `huge`: a 'models' message announcing 900 MB, its chunks sent as fast as the client reads;
- `empty-values`: a 'models' message just under the client's byte bound, made of empty
  values (2 bytes each, each a protobuf object and a Python object once decoded);
- `rewelcome`: a heartbeat, then the call ends (every call welcomed, no round ever starts).
"""
from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from fedcore.comm.chunking import chunk_frames
from fedcore.comm.grpc_server import GrpcServerComm
from fedcore.comm.stream import heartbeat_frame
from fedcore.wire import fedcore_pb2 as pb
from fedcore.wire.codec import uvarint


def empty_values_envelope(nbytes: int, receiver: int) -> bytes:
    """A 'models' envelope of about `nbytes` holding nbytes / 2 empty values."""
    items = b"\x0a\x00" * (nbytes // 2 - 64)
    value = b"\x42" + uvarint(len(items)) + items
    head = pb.Envelope(msg_type="models", sender=0, receivers=[receiver], round=1).SerializeToString()
    return head + b"\x3a" + uvarint(len(value)) + value


class HostileServer(GrpcServerComm):
    mode = "rewelcome"
    client_bound = 0   # the byte bound the course's clients derive from its model

    async def _stream(self, s, token, context) -> None:
        await context.write(pb.Frame(welcome=pb.Welcome(
            client_id=s.client_id, server_session=self.server_session,
            max_chunk_bytes=self.chunk_size)).SerializeToString())
        if self.mode == "rewelcome":
            await context.write(heartbeat_frame())
            await asyncio.sleep(0.2)
            return
        if self.mode == "huge":
            total, data = 900 * 10 ** 6, bytes(self.chunk_size)
            for off in range(0, total, self.chunk_size):
                frame = pb.Frame(chunk=pb.Chunk(message_id=1, offset=off, total_size=total, data=data,
                                                sha256=bytes(32) if off == 0 else b""))
                await context.write(frame.SerializeToString())
        else:
            data = empty_values_envelope(self.client_bound - 4096, s.client_id)
            for frame in chunk_frames((data,), 1, self.chunk_size):
                await context.write(frame)
        await asyncio.sleep(30)


def main(cfg_path: str, mode: str, port_file: str) -> None:
    import fedcore
    from fedcore.deployment.deploy_config import message_bound
    from fedcore.scenarios.data import build_federated_data
    from fedcore.scenarios.models import build_model
    from fedcore.kernel.scheduler import WallClockScheduler

    cfg = fedcore.configure(cfg_path, federate__mode="distributed", distribute__role="server",
                            distribute__server_port=0)
    comm = HostileServer(cfg, WallClockScheduler(), lambda *a: None, lambda *a: None)
    comm.mode = mode
    data = build_federated_data(cfg)
    comm.client_bound = message_bound(build_model(cfg, data.input_shape, data.num_classes))
    port = comm.start()
    Path(port_file).write_text(str(port))
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main(*sys.argv[1:4])
