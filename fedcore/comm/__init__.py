"""Communicators: how a sent message reaches its receivers' event queues.

Nothing is imported eagerly, so a client imports its gRPC communicator without
the simulation's modules (and without torch).
"""

__all__ = ["InProcessComm"]


def __getattr__(name):
    if name == "InProcessComm":
        from fedcore.comm.inprocess import InProcessComm
        return InProcessComm
    raise AttributeError(f"module 'fedcore.comm' has no attribute {name!r}")
