"""`python -m fedcore.dashboard OUTDIR [OUTDIR ...] [--port P]`: watch runs in a browser.

Serves on 127.0.0.1 only (this machine's browser; reach it from another through an SSH
tunnel), until Ctrl-C. Each OUTDIR is a run's (or a tuning study's) output folder; one
that does not exist yet is watched until the run writes there.
"""
from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

from fedcore.kernel.errors import EXIT_OK, ConfigError, exit_code_of

__all__ = ["main"]


def _run(args) -> int:
    from fedcore.dashboard.app import Dashboard
    from fedcore.dashboard.server import DashboardServer
    for folder in args.outdirs:
        if Path(folder).exists() and not Path(folder).is_dir():
            raise ConfigError(f"OUTDIR: '{folder}' is a file; name a run's output folder")
    try:
        server = DashboardServer(Dashboard([Path(f) for f in args.outdirs]), "127.0.0.1", args.port)
    except OSError as exc:
        raise ConfigError(f"--port: cannot listen on 127.0.0.1:{args.port} ({exc.strerror or exc}); "
                          "choose another port or 0 for a free one") from None
    print(f"dashboard of {len(args.outdirs)} run{'s' if len(args.outdirs) > 1 else ''} at {server.url} "
          "(Ctrl-C stops it)", flush=True)
    server.start()
    try:
        threading.Event().wait()
    finally:
        server.stop()
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedcore.dashboard",
                                description="A live dashboard of runs' outputs, in the browser.")
    p.add_argument("outdirs", nargs="+", metavar="OUTDIR", help="run or study output folders")
    p.add_argument("--port", type=int, default=8050, help="port on 127.0.0.1 (default 8050; 0: a free one)")
    args = p.parse_args(argv)
    return exit_code_of("fedcore.dashboard", lambda: _run(args), interrupted="dashboard stopped")


if __name__ == "__main__":
    sys.exit(main())
