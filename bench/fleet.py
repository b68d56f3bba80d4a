"""A fleet load generator: many lightweight protocol clients in one process (asyncio).

    python -m bench.fleet --port P --first 1 --count 2500 --token T --num-samples 2

Each client is a coroutine on one `grpc.aio` channel shared by the process: it
opens its stream with the protocol's metadata, is welcomed, joins, and answers
every `models` message with an update (the received model itself, and its
sample count), as a FedAvg client that trained zero steps would; it leaves on
`finish`. Heartbeats, chunking and the SHA-256 checks are the real ones
(`fedcore.comm.chunking`, `fedcore.comm.stream`); the update is encoded once
per round and process, since all its clients send the same bytes. It imports
no torch.

On stdout, one line per round as the first of its clients sees the round's
model: `round R t=<monotonic seconds>`, `finish t=...` for the course's end, then
`fleet done clients=N finished=M reconnects=K`. A broken stream is dialled again.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import secrets
import sys
import time

import grpc

from fedcore.comm.chunking import FIRST_CHUNK, FRAME_OVERHEAD, Reassembler, chunk_frames, envelope_parts
from fedcore.comm.stream import (METHOD, MD_CLIENT_ID, MD_COURSE, MD_SESSION, MD_TOKEN, grpc_options,
                                 heartbeat_frame, parse_frame)
from fedcore.wire import fedcore_pb2 as pb
from fedcore.wire.codec import decode_envelope, encode_value, from_value, uvarint

CHUNK = 2 * 1024 * 1024


class Fleet:
    def __init__(self, args):
        self.args = args
        self.seen_rounds: set[int] = set()
        self.finished = 0
        self.reconnects = 0
        self.broken: dict[str, int] = {}   # why streams broke, by status code and detail
        self._update: tuple[bytes, bytes] | None = None   # (model content bytes, encoded update)

    def update_content(self, env: pb.Envelope) -> bytes:
        """The update for this round's model, encoded once for all clients of the process."""
        if not isinstance(env.content, pb.Value):   # a model of 16 MiB or more (wire/large.py)
            key = ("round", env.round)
            if self._update is None or self._update[0] != key:
                self._update = None   # the last round's update goes before this one is built
                model = from_value(env.content, "numpy")["model"]
                self._update = (key, encode_value({"model": model, "num_samples": self.args.num_samples}))
            return self._update[1]
        model = next((e.value.SerializeToString() for e in env.content.map.entries if e.key == "model"), b"")
        if self._update is None or self._update[0] != model:
            # {"model": <the received model>, "num_samples": n}, keys in the order encode_value uses
            tail = encode_value({"num_samples": self.args.num_samples})   # a map Value: tag, len, entry
            entry_model = b"\x0a\x05model" + b"\x12" + uvarint(len(model)) + model
            entries = b"\x0a" + uvarint(len(entry_model)) + entry_model + _strip_map(tail)
            self._update = (model, b"\x4a" + uvarint(len(entries)) + entries)
        return self._update[1]

    async def client(self, channel, cid: int) -> None:
        """One client: streams until `finish`; a broken stream is dialled again (same session,
        so the server resumes it) and the last message is sent again with its id (the server
        drops it if it had it), as `GrpcClientComm` does."""
        a = self.args
        md = ((MD_CLIENT_ID, str(cid)), (MD_SESSION, secrets.token_hex(8)), (MD_COURSE, ""),
              (MD_TOKEN, "Bearer " + a.token))
        state = {"last": None, "id": 0, "joined": False, "done": False}
        rng = random.Random(cid)
        attempt = 0
        while not state["done"]:
            try:
                await self._stream(channel, cid, md, state)
                attempt = 0
            except grpc.aio.AioRpcError as exc:
                if state["done"]:
                    break   # the server closed a finished client's stream (it stops once all have left)
                if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT):
                    print(f"client {cid}: {exc.code().name}: {exc.details()}", file=sys.stderr, flush=True)
                    return
                self.reconnects += 1
                when = "after its welcome" if state["welcomed"] else "before a welcome"
                why = f"{exc.code().name}: {(exc.details() or '')[:80]} ({when})"
                self.broken[why] = self.broken.get(why, 0) + 1
                attempt += 1
            if not state["done"]:
                await asyncio.sleep(rng.uniform(0.25, 0.5) * min(8, 2 ** attempt))

    async def _stream(self, channel, cid: int, md, state: dict) -> None:
        out: asyncio.Queue = asyncio.Queue()
        a = self.args
        state["welcomed"] = False

        def send(msg_type: str, round_: int, content: bytes) -> None:
            header = pb.Envelope(msg_type=msg_type, sender=cid, receivers=[0], round=round_)
            state["id"] += 1
            state["last"] = (envelope_parts(header, content), state["id"])
            put(state["last"])

        def put(item) -> None:
            for frame in chunk_frames(item[0], item[1], CHUNK, a.first_chunk):
                out.put_nowait(frame)

        async def requests():
            while True:
                try:
                    frame = await asyncio.wait_for(out.get(), a.heartbeat)
                except asyncio.TimeoutError:
                    frame = heartbeat_frame()
                if frame is None:
                    return
                yield frame

        call = channel.stream_stream(METHOD)(requests(), metadata=md)
        reasm = Reassembler(1 << 30, CHUNK)
        try:
            async for raw in call:
                frame = parse_frame(raw, CHUNK + FRAME_OVERHEAD)
                kind = frame.WhichOneof("kind")
                if kind == "welcome":
                    state["welcomed"] = True
                    if not state["joined"]:
                        state["joined"] = True
                        send("join_in", 0, encode_value({"client_id": cid, "num_samples": a.num_samples}))
                    elif state["last"] is not None:
                        put(state["last"])
                elif kind == "chunk":
                    data = reasm.feed(frame.chunk)
                    if data is None:
                        continue
                    env = decode_envelope(data)
                    if env.msg_type == "models":
                        if env.round not in self.seen_rounds:
                            self.seen_rounds.add(env.round)
                            print(f"round {env.round} t={time.monotonic():.4f}", flush=True)
                        send("updates", env.round, self.update_content(env))
                    elif env.msg_type == "finish":
                        if not self.finished:
                            print(f"finish t={time.monotonic():.4f}", flush=True)
                        self.finished += 1
                        state["done"] = True
                        out.put_nowait(pb.Frame(bye=pb.Bye(reason="finished")).SerializeToString())
                        out.put_nowait(None)   # the server ends the stream once it has the bye
        finally:
            call.cancel()

    async def run(self) -> None:
        a = self.args
        # Distinct options per channel keep gRPC from sharing one connection among them.
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{a.port}",
                                              options=grpc_options(CHUNK, server=False) + [("fedcore.conn", i)])
                    for i in range(a.channels or a.count)]
        tasks = []
        for i, cid in enumerate(range(a.first, a.first + a.count)):
            tasks.append(asyncio.create_task(self.client(channels[i % len(channels)], cid)))
            if i % 100 == 99:
                await asyncio.sleep(0.1)    # connect in waves, not all in one instant
        await asyncio.gather(*tasks)
        for ch in channels:
            await ch.close()
        for why, n in sorted(self.broken.items(), key=lambda kv: -kv[1]):
            print(f"streams broken {n}x: {why}", file=sys.stderr, flush=True)
        print(f"fleet done clients={a.count} finished={self.finished} reconnects={self.reconnects}",
              flush=True)


def _strip_map(value: bytes) -> bytes:
    """The entries of an encoded map Value (drop its tag and length)."""
    i = 1
    while value[i] & 0x80:
        i += 1
    return value[i + 1:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--first", type=int, default=1, help="the first client id of this process")
    p.add_argument("--count", type=int, required=True, help="clients in this process")
    p.add_argument("--token", required=True)
    p.add_argument("--num-samples", type=int, default=2)
    p.add_argument("--heartbeat", type=float, default=5.0, help="seconds between idle heartbeats")
    p.add_argument("--first-chunk", type=int, default=FIRST_CHUNK,
                   help="bytes of a message's first chunk (as the course's clients size it)")
    p.add_argument("--channels", type=int, default=8,
                   help="HTTP/2 connections shared by the clients (0: one per client, as in a real fleet)")
    args = p.parse_args(argv)
    asyncio.run(Fleet(args).run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
