"""`fedcore` (or `python -m fedcore`): the version, and the commands by their short names.

`fedcore --version` says which release is installed; `fedcore run ...` is
`python -m fedcore.run ...`, and likewise launch, plot, tune, certs, dashboard and status.
"""
from __future__ import annotations

import sys

import fedcore

COMMANDS = ("run", "launch", "plot", "tune", "certs", "dashboard", "status")
USAGE = f"usage: fedcore [--version] {{{','.join(COMMANDS)}}} [ARGS ...]"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] in (["--version"], ["-V"]):
        print(f"fedcore {fedcore.__version__}")
        return 0
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "run":
        from fedcore.run import main as run
    elif command == "launch":
        from fedcore.launch import main as run
    elif command == "plot":
        from fedcore.plot import main as run
    elif command == "tune":
        from fedcore.tune.__main__ import main as run
    elif command == "certs":
        from fedcore.certs import main as run
    elif command == "dashboard":
        from fedcore.dashboard.__main__ import main as run
    elif command == "status":
        from fedcore.status import main as run
    else:
        print(f"fedcore: unknown command '{command}'; {USAGE[7:]}", file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
