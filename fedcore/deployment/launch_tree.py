"""`fedcore.launch` for a hierarchical course (`topology.edges > 0`): the edge processes.

The launcher starts the cloud as it starts any server; then this starts one process per
edge (`distribute.role=edge`, each on a free port, dialling the cloud) and tells the
launcher which edge's port each client dials. With the launcher's own tokens, the cloud
accepts the edges' tokens only and each edge only its own clients' tokens: a client can
reach its edge and nothing else, and only an edge's process holds the token the cloud
accepts for that edge (FEDCORE_CLOUD_TOKEN in its environment, never on a command line).
"""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import yaml

from fedcore.comm.stream import write_secret
from fedcore.deployment.edge_process import CLOUD_TOKEN_ENV, address_file
from fedcore.runtime.topology import assign, check_deployable_assignment

__all__ = ["LaunchTree"]


class LaunchTree:
    """The edges of a launched course: their tokens (made before the cloud starts), then their
    processes (`start`, once the cloud listens)."""

    def __init__(self, cfg, n: int):
        check_deployable_assignment(cfg)
        self.topology = assign(cfg.with_overrides(federate__client_num=n), list(range(1, n + 1)))
        self.edge_extra: dict[int, list[str]] = {e: [] for e in self.topology.edges}
        self.edge_env: dict[int, dict] = {e: dict(os.environ) for e in self.topology.edges}
        self.client_ports: dict[int, str] = {}   # each client's edge port, once they listen

    def tokens(self, client_tokens: dict[int, str], secrets_dir: Path) -> dict[int, str]:
        """With the launcher's own tokens: each edge accepts its clients' tokens and holds its
        own for the cloud; returns the cloud's tokens, the edges'. (Without, every tier uses
        the tokens the user configured.)"""
        edge_tokens = {e: secrets.token_hex(16) for e in self.topology.edges}
        for e, members in self.topology.edges.items():
            mine = write_secret(secrets_dir / f"tokens_of_edge_{e}.yaml",
                                yaml.safe_dump({c: client_tokens[c] for c in members}))
            self.edge_extra[e].append(f"distribute.tokens_file={mine}")
            self.edge_env[e][CLOUD_TOKEN_ENV] = edge_tokens[e]
        return edge_tokens

    def start(self, base: list[str], cloud_port: str, outdir: Path, spawn, timeout: float,
              supervise, children: list) -> bool:
        """Start every edge against the cloud (`spawn(argv, env)` starts a process, as the
        launcher starts its own; each goes through `supervise`, so that under
        `--restart` an edge comes back on its own port, where its clients redial), appending
        each to `children`; wait for each to listen and note each client's edge port in
        `client_ports`. False, said why, when an edge does not listen."""
        ports: dict[int, str] = {}

        def starter(e: int):
            def start(first: bool) -> subprocess.Popen:
                if first:
                    address_file(outdir, e).unlink(missing_ok=True)
                return spawn(base + self.edge_extra[e] + [
                    "distribute.role=edge", f"distribute.edge_id={e}", f"distribute.cloud_port={cloud_port}",
                    f"distribute.server_port={'0' if first else ports[e]}"], self.edge_env[e])
            return start
        started = {}
        for e in sorted(self.topology.edges):
            started[e] = supervise(f"edge {e}", starter(e))
            children.append(started[e])
        deadline = time.monotonic() + timeout
        for e, edge in started.items():
            f = address_file(outdir, e)
            while not f.exists():
                if edge.proc.poll() is not None or time.monotonic() > deadline:
                    why = (f"exited with status {edge.proc.returncode}" if edge.proc.poll() is not None
                           else f"did not listen within {timeout:g}s")
                    print(f"fedcore: edge {e} {why}", file=sys.stderr)
                    return False
                time.sleep(0.1)
            ports[e] = f.read_text().strip().rsplit(":", 1)[1]
        self.client_ports = {c: ports[e] for e, members in self.topology.edges.items() for c in members}
        return True
