"""The errors a user can cause, each with its documented exit code."""
from __future__ import annotations

import os
import sys
import traceback
from typing import Callable

__all__ = ["exit_code_of", "first_line", "FedcoreError", "ConfigError", "IncompleteCourseError", "CourseDiverged", "EXIT_OK",
           "EXIT_FAILURE", "EXIT_CONFIG", "EXIT_INCOMPLETE", "EXIT_SERVER_GONE", "EXIT_DIVERGED",
           "EXIT_NOTHING_AGGREGATED", "NothingAggregated"]

EXIT_OK = 0
EXIT_FAILURE = 1      # anything else; the cause is printed in one line first
EXIT_CONFIG = 2       # bad configuration or usage
EXIT_INCOMPLETE = 3   # the completeness check failed
EXIT_SERVER_GONE = 4  # a deployed client lost its server for longer than distribute.retry_timeout
EXIT_DIVERGED = 5     # the global model became non-finite; outputs hold the last finite one
EXIT_NOTHING_AGGREGATED = 6  # a secure course ended without aggregating any round; the model is the initial one


class FedcoreError(Exception):
    """Base of the errors that end a run with a one-line message."""

    exit_code = EXIT_FAILURE


class ConfigError(FedcoreError):
    """A bad config key, type or value, a missing file, or bad usage."""

    exit_code = EXIT_CONFIG


class IncompleteCourseError(FedcoreError):
    """No path leads from the course's start to its finish."""

    exit_code = EXIT_INCOMPLETE


class CourseDiverged(FedcoreError):
    """The aggregated global model was not finite; the run's outputs hold the last finite one."""

    exit_code = EXIT_DIVERGED


class NothingAggregated(FedcoreError):
    """A secure course ended with every round skipped, aborted or refused: nothing was learnt."""

    exit_code = EXIT_NOTHING_AGGREGATED


def first_line(exc: BaseException) -> str:
    """The first line of an error's message (its class name when it has none): a foreign
    library's many-line message, cut to what fits a one-line error."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


LAUNCHED_ENV = "FEDCORE_LAUNCHED"   # "1": a process of fedcore.launch, which says `interrupted` once for all


def exit_code_of(prog: str, command: Callable[[], int], debug: bool = False,
                 interrupted: str = "interrupted") -> int:
    """Run a command-line `command` and turn what it raises into its exit code: a user's
    error is one line on stderr (with the traceback under --debug), Ctrl-C is 130, anything
    else is one line first, then the traceback. A process started by `fedcore.launch` leaves
    the `interrupted` line to its launcher: Ctrl-C reaches every process of the launch."""
    try:
        return command()
    except FedcoreError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        if debug:
            traceback.print_exc()
        return exc.exit_code
    except KeyboardInterrupt:
        if os.environ.get(LAUNCHED_ENV) != "1":
            print(f"{prog}: {interrupted}", file=sys.stderr)
        return 130
    except Exception as exc:
        print(f"{prog}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        traceback.print_exc()
        return EXIT_FAILURE
