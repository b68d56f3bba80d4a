"""Communicators: how a sent message reaches its receivers' event queues."""
from fedcore.comm.inprocess import InProcessComm

__all__ = ["InProcessComm"]
