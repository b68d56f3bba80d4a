"""Watch a course from Python and stop it once it reaches a target accuracy.

A `Callback` sees every round's record as it is written and the summary at the end;
raising `StopRun` in `on_record` ends the course after that round, with its outputs
written as for any other end. Run it as a script:

    python docs/examples/target_callback.py --target 0.7
"""
import argparse
from pathlib import Path

import fedcore
from fedcore.runtime.monitor import Callback, StopRun

QUICKSTART = Path(__file__).resolve().parents[2] / "scenarios" / "quickstart.yaml"


class StopAtTarget(Callback):
    """Ends the course at the first evaluated round whose test accuracy reaches `target`."""

    def __init__(self, target: float):
        self.target, self.seen = target, []

    def on_record(self, record: dict) -> None:
        acc = record.get("test_acc")
        self.seen.append((record["round"], acc))
        if acc is not None and acc >= self.target:
            print(f"round {record['round']}: test_acc {acc:.3f} reached {self.target}; stopping")
            raise StopRun

    def on_end(self, summary: dict) -> None:
        print(f"stopped after {summary['rounds']} rounds ({summary.get('stopped_by', 'rounds done')})")


def main(argv=None) -> fedcore.api.RunResult:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=float, default=0.7)
    p.add_argument("--outdir", default=None, help="default: runs/<timestamp>-quickstart")
    args = p.parse_args(argv)
    watcher = StopAtTarget(args.target)
    extra = {"outdir": args.outdir} if args.outdir else {}
    return fedcore.run(QUICKSTART, callbacks=[watcher], verbose=False, **extra)


if __name__ == "__main__":
    main()
