"""`python -m fedcore.run --cfg FILE.yaml [--cfg MORE.yaml ...] [KEY=VALUE ...]`: run a course.

Several `--cfg` merge in order (a later file's values win), then the overrides.
Also `--check` (completeness check only; writes its files only where `outdir`
is set), `--help-key KEY` and `--list-keys`. From Python, `fedcore.run(...)`
is `fedcore.api.run` (this module is callable for that reason).
Exit codes: 0 success, 2 bad configuration or usage, 3 incomplete course, 4 a
deployed client lost its server, 5 the global model diverged (non-finite), 130
interrupted, 1 anything else (the cause in one line before any traceback).
An interrupted simulation (Ctrl-C or SIGTERM) ends its round, snapshots it and
prints the outputs folder, the round reached and the command that resumes.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from fedcore import __version__
from fedcore.kernel.errors import EXIT_CONFIG, EXIT_OK, ConfigError, exit_code_of

# set by fedcore.launch for the processes it starts: the command that launches the course again
RESUME_COMMAND_ENV = "FEDCORE_RESUME_COMMAND"

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # usage errors exit 2 with one line, like config errors
        self.exit(EXIT_CONFIG, f"fedcore: usage: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m fedcore.run", description="Run a federated course from a YAML config.")
    p.add_argument("--cfg", action="append", metavar="FILE",
                   help="the course's YAML config; repeat to merge several in order (later wins)")
    p.add_argument("--check", action="store_true", help="completeness check only, no training; "
                   "writes config.yaml, handlers.txt and the graph only where outdir is set")
    p.add_argument("--help-key", metavar="KEY", help="describe one config key (type, default, meaning)")
    p.add_argument("--list-keys", action="store_true", help="print every config key as a Markdown table")
    p.add_argument("--debug", action="store_true", help="full tracebacks and debug logging")
    p.add_argument("--version", action="version", version=f"fedcore {__version__}")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    return p


def _run(args) -> int:
    if args.list_keys or args.help_key:
        from fedcore.kernel.key_index import describe_key, reference_markdown
        if args.list_keys:
            print(reference_markdown(packaged=True), end="")
            return EXIT_OK
        # without a config or overrides no plug-in of a user's can add keys: the packaged index
        # answers for the built-in ones, without importing the plug-ins and torch
        named = bool(args.cfg or args.overrides)
        if named:
            from fedcore.kernel.config import import_named_plugins
            import_named_plugins(args.cfg or (), args.overrides)   # a plug-in's keys are known too
        print(describe_key(args.help_key, packaged=not named))
        return EXIT_OK
    from fedcore.kernel.config import load_config
    from fedcore.kernel.key_index import precheck
    if not args.cfg:
        raise ConfigError("--cfg FILE.yaml is required (or --help-key KEY)")
    precheck(args.cfg, args.overrides)   # a typo told before torch is imported
    from fedcore.api import resolve_outdir
    cfg = load_config(args.cfg, args.overrides, extra_source="command line")
    if cfg["log_format"] != "text":
        from fedcore.runtime.log_format import apply_log_format
        apply_log_format(cfg["log_format"])
    if cfg["verbose"] >= 2:
        logging.getLogger("fedcore").setLevel(min(logging.getLogger("fedcore").getEffectiveLevel(),
                                                  logging.INFO))
    # --check writes nothing to a folder nobody named
    outdir = None if args.check and not cfg["outdir"] else resolve_outdir(cfg)
    if cfg["federate.mode"] == "distributed" or cfg.get("distribute.role") is not None:
        try:
            from fedcore.deployment.distributed import run_distributed
        except ImportError:
            raise ConfigError("federate.mode: distributed needs fedcore.deployment.distributed, which this "
                              "installation lacks; use federate.mode=standalone") from None
        if cfg["distribute.role"] == "edge":   # an edge aggregator of a hierarchical course
            from fedcore.deployment.edge_process import run_edge
            return run_edge(cfg, outdir, args.check)
        parties = {}
        if cfg["data.partition"] == "vertical":   # parties, one per process
            from fedcore.deployment.vertical_parties import PARTY_COURSES
            parties["courses"] = PARTY_COURSES
        return run_distributed(cfg, outdir, check_only=args.check, command=_command(args), **parties)
    from fedcore.runtime.checkpoint import interrupted_message
    from fedcore.runtime.course import Course
    course = Course(cfg, outdir, progress=cfg["verbose"]).build()
    try:
        return course.check_or_run(args.check)
    except KeyboardInterrupt:
        if course.monitor.started:
            print(interrupted_message(course, _command(args)), file=sys.stderr)
        raise


def _command(args) -> list[str]:
    """The command that started this run, as the resume command's start (its own outdir and
    resume_from are replaced): a server that `fedcore.launch` started is resumed by launching
    again, so the launcher's command."""
    launched = os.environ.get(RESUME_COMMAND_ENV)
    if launched:
        return json.loads(launched)
    return [sys.executable, "-m", "fedcore.run", *[a for c in args.cfg for a in ("--cfg", c)],
            *(["--debug"] if args.debug else []),
            *[o for o in args.overrides if not o.startswith(("outdir=", "resume_from="))]]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)  # overrides may follow --check etc.
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    return exit_code_of("fedcore", lambda: _run(args), args.debug)


class _CallableModule(type(sys)):
    """Lets `fedcore.run(cfg)` work after `import fedcore.run` has put this module where the
    package's `run` function was."""

    def __call__(self, *args, **kwargs):
        from fedcore.api import run
        return run(*args, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _CallableModule
