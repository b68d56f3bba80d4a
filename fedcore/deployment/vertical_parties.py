"""A vertical course deployed: the active party serves (the server role), each passive party
connects as a client with its party number as client id, gRPC between them, wall-clock time.

Both halves are the server's and client's courses of `fedcore.deployment.distributed` with the
vertical course's parts in place of a model and an aggregator: one party's table, its worker and
the simulation's handlers (`vertical_party`, handlers/vertical_deploy.py). A passive party that
leaves before the course finished stops it, naming the party.
"""
from __future__ import annotations

import torch

from fedcore.deployment.distributed import ClientCourse, ServerCourse, _measured_time
from fedcore.kernel import registry
from fedcore.kernel.scheduler import PRIORITY_TIMER
from fedcore.runtime.course import StartEvent

__all__ = ["PartyServerCourse", "PartyClientCourse", "PARTY_COURSES"]

ACTIVE = 0
CPU = torch.device("cpu")   # a vertical course trains on the CPU, as in simulation


class PartyServerCourse(ServerCourse):
    """The active party's process."""

    @property
    def client_ids(self) -> list[int]:
        return self._all_ids

    @client_ids.setter
    def client_ids(self, ids) -> None:
        self._all_ids = list(ids)

    def build(self, data=None) -> "PartyServerCourse":
        from fedcore.comm.grpc_server import GrpcServerComm
        self.timing = _measured_time()
        self.comm = GrpcServerComm(self.cfg, self.scheduler, self._count_bytes, self._lost, self._maybe_stop)
        self.comm.device = self.device = CPU
        if self.outdir is not None:
            self.comm.spool_dir = str(self.outdir)
        self.comm.on_new_session = lambda client_id, returning: self._departed.discard(client_id)
        self.comm.update_gate = lambda msg: True   # no `updates` in a vertical course
        self.comm.attach(registry.components.get("vertical_party")(self, ACTIVE))
        self.comm.max_message, self.comm.max_values = \
            registry.components.get("vertical_party_bounds")(self.cfg, self.table)
        resumed = getattr(self, "vertical_resume", None)
        self.comm.resumed_round = resumed["round"] if resumed else 0   # told in every welcome
        return self

    def _count_bytes(self, msg, receiver: int, nbytes: int) -> None:
        self.party_bytes(msg, receiver, nbytes)   # per party, and the monitor's totals

    def _watch(self) -> None:
        """Periodic: heartbeat expiry (a lost party stops the course), finishing."""
        d = self.cfg.section("distribute")
        for cid, reason in self.comm.expire(d["heartbeat_timeout"]):
            self._lost(cid, reason)
        self._maybe_stop()
        period = min(d["heartbeat_interval"], d["heartbeat_timeout"] / 4)
        self.scheduler.schedule(self.scheduler.clock + period, PRIORITY_TIMER, self._watch)


class PartyClientCourse(ClientCourse):
    """A passive party's process: its own table only."""

    def build(self, client_id: int, comm) -> "PartyClientCourse":
        self.timing = _measured_time()
        self.comm = comm
        comm.device = self.device = CPU
        self.process_cfg = comm.cfg   # with this process's outdir: where the party keeps its state
        party = registry.components.get("vertical_party")(self, client_id)
        comm.on_new_server = StartEvent(party, "start")
        comm.attach(party)
        return self

    def bounds(self) -> tuple[int, int]:
        return registry.components.get("vertical_party_bounds")(self.cfg, self.table)

    def end_with(self, exc: Exception) -> None:
        """End this party's process with `exc` (its one line, its exit status), raised by its
        scheduler outside the delivery of a message (which reports a handler's error and goes on)."""
        from fedcore.comm.handover import Raise
        self.scheduler.call_soon(Raise(exc))


PARTY_COURSES = (PartyServerCourse, PartyClientCourse)   # for run_distributed (fedcore.run)
