"""`python -m fedcore.tune --cfg BASE.yaml --space SPACE.yaml --method M [--trials N] [--budget B]`.

Exit codes as `python -m fedcore.run`: 0 success, 2 bad configuration or
usage (one line on stderr), 130 interrupted (the study resumes when started
again with the same --outdir), 1 anything else.
"""
from __future__ import annotations

import argparse
import logging
import sys

from fedcore.kernel.errors import EXIT_CONFIG, EXIT_OK, exit_code_of

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(EXIT_CONFIG, f"fedcore.tune: usage: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    from fedcore.tune import METHOD_NAMES
    p = _Parser(prog="python -m fedcore.tune", description="Hyper-parameter search over federated courses.")
    p.add_argument("--cfg", required=True, help="the base course's YAML config")
    p.add_argument("--space", required=True, help="the search space's YAML")
    p.add_argument("--method", required=True, choices=METHOD_NAMES)
    p.add_argument("--trials", type=int, help="configurations to try (grid: all points by default)")
    p.add_argument("--budget", type=float, help="per trial: rounds (default the base's "
                   "federate.total_round_num) or virtual seconds (--budget-unit virtual_time)")
    p.add_argument("--budget-unit", default="rounds", choices=("rounds", "virtual_time"))
    p.add_argument("--min-budget", type=float, help="sha/hyperband/pruners: smallest budget (default budget/eta^2)")
    p.add_argument("--eta", type=int, default=3, help="sha/hyperband/pruners: keep 1/eta per rung (default 3)")
    p.add_argument("--pruner", default="none", choices=("none", "median", "sha", "hyperband"),
                   help="tpe: Optuna pruner deciding after each budget step")
    p.add_argument("--sample", default="random", choices=("random", "grid"),
                   help="sha: start from random draws (--trials of them) or from the space's grid")
    p.add_argument("--arms", type=int, help="fedex: candidate configurations drawn from the space")
    p.add_argument("--metric", default="val_acc", help="objective: a record key (default val_acc)")
    p.add_argument("--direction", choices=("maximize", "minimize"),
                   help="default: minimize for *loss metrics, else maximize")
    p.add_argument("--seed", type=int, default=0, help="the search's own seed (the courses keep theirs)")
    p.add_argument("--outdir", help="the study's folder (default runs/<timestamp>-tune-<method>)")
    p.add_argument("--jobs", type=int, default=1, help="trials run at once, each in its own process")
    p.add_argument("--debug", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from fedcore.tune import tune
    def study() -> int:
        result = tune(args.cfg, args.space, args.method, args.trials, args.budget, args.budget_unit,
                      args.metric, args.direction, args.seed, args.outdir, args.jobs, args.min_budget,
                      args.eta, args.pruner, args.arms, args.sample, progress=True)
        s = result.summary
        print(f"{s['method']}: best {s['metric']} {s['best_objective']} with {s['best_params']} "
              f"(trial {s['best_trial']}); {s['trials']} trials, {s['rounds_spent']} rounds; "
              f"best config in {result.best_config}")
        return EXIT_OK

    return exit_code_of("fedcore.tune", study, args.debug,
                        "interrupted; run the same command again to resume")


if __name__ == "__main__":
    sys.exit(main())
