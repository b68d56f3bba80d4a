"""W4 events: the scheduler and dispatch alone, 10^6 events through no-op handlers.

    python -m bench.w4_events [--events 1000000] [--workers 100] [--reps 3]

Two measurements: `dispatch` schedules deliveries of ready-made messages and runs them
through `Worker.deliver` to a no-op handler (heap + dispatch); `send` has every handler
send the next message itself (Worker.send -> in-process communicator: byte count, time
model, scheduling), 1000 message chains in flight. Last line: events per second of each
and the `dispatch` figure against the 200,000 events/s target.
"""
from __future__ import annotations

import argparse
import time

_clocks = {"cpu": time.process_time, "wall": time.perf_counter}
CLOCK = "cpu"   # events per CPU second of this process: robust when other processes share the cores
from types import SimpleNamespace

from fedcore.comm.inprocess import InProcessComm, _Delivery
from fedcore.kernel.message import Message
from fedcore.kernel.scheduler import PRIORITY_MESSAGE, Scheduler
from fedcore.runtime.timing import TimeModel
from fedcore.kernel.worker import Client, HandlerTable


def _noop(worker, msg) -> None:
    """Does nothing: what is measured is everything around it."""


def _world(n_workers: int):
    course = SimpleNamespace(scheduler=Scheduler(), timing=TimeModel({}))
    course.comm = InProcessComm(course.scheduler, course.timing, lambda m, r, n: None)
    table = HandlerTable("client")
    workers = [Client(i, table, course) for i in range(1, n_workers + 1)]
    for w in workers:
        course.comm.attach(w)
    return course, table, workers


def dispatch_rate(n_events: int, n_workers: int, chunk: int = 10_000) -> float:
    """Events/s for scheduling and dispatching deliveries to a no-op handler."""
    course, table, workers = _world(n_workers)
    table.register("receiving_ping", _noop)
    sched = course.scheduler
    msg = Message("ping", 0, (1,), 1, 0.0, None)
    clock = _clocks[CLOCK]
    t0, done, now = clock(), 0, 0.0
    while done < n_events:
        k = min(chunk, n_events - done)
        for i in range(k):
            sched.schedule(now + i * 1e-6, PRIORITY_MESSAGE, _Delivery(workers[i % n_workers], msg))
        sched.run()
        now, done = sched.now, done + k
    assert sched.processed == n_events
    return n_events / (clock() - t0)


def send_rate(n_events: int, n_workers: int, chains: int = 1000) -> float:
    """Events/s when each no-op-like handler sends the next message through the communicator."""
    course, table, workers = _world(n_workers)
    left = [n_events - chains]

    def forward(worker, msg) -> None:
        if left[0] > 0:
            left[0] -= 1
            worker.send("ping", worker.id % n_workers + 1, None)
    table.register("receiving_ping", forward, sends=("ping",))
    for c in range(chains):
        workers[c % n_workers].send("ping", (c + 1) % n_workers + 1, None)
    clock = _clocks[CLOCK]
    t0 = clock()
    course.scheduler.run()
    assert course.scheduler.processed == n_events
    return n_events / (clock() - t0)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument("--workers", type=int, default=100)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--clock", choices=sorted(_clocks), default="cpu",
                   help="cpu: per CPU second of this process (default); wall: per elapsed second")
    a = p.parse_args(argv)
    global CLOCK
    CLOCK = a.clock
    d = max(dispatch_rate(a.events, a.workers) for _ in range(a.reps))
    s = max(send_rate(a.events, a.workers) for _ in range(a.reps))
    print(f"W4 dispatch: {d:,.0f} events/s; send+dispatch: {s:,.0f} events/s "
          f"({a.events:,} events, {a.workers} workers, best of {a.reps}, {CLOCK} clock)")
    print(f"dispatch_events_per_s={d:.0f} send_events_per_s={s:.0f} target=200000 "
          f"met={'yes' if d >= 200_000 else 'no'}")


if __name__ == "__main__":
    main()
