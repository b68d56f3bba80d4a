"""Run the `async_vs_sync` family and print virtual time to target accuracy, as a table.

    python -m fedcore.scenarios.compare [--family NAME] [--rounds N] [--outdir DIR]
                                        [--json FILE] [KEY=VALUE ...]

The family is `NAME.yaml` (the reference row, normally sync vanilla) and every
`NAME_*.yaml` beside it; KEY=VALUE overrides apply to every member. Members
must share the task and the devices (everything but `name`, `outdir`,
`asyn.*`, `federate.sampler*` and `algorithm.*`): a comparison of time to
target means nothing otherwise. Speed-up = reference time / member time. A
member whose course stalls (sync vanilla when devices drop out) is reported
as such and the others still run.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

__all__ = ["family_files", "strategy_label", "run_family", "format_table", "main"]

HERE = Path(__file__).resolve().parent
_FREE = ("name", "outdir", "course", "asyn.", "federate.sampler", "algorithm.")


def family_files(name: str, folder: Path = HERE) -> list[Path]:
    """The reference file first, then the synchronous members, then the others, by name."""
    ref = folder / f"{name}.yaml"
    if not ref.is_file():
        from fedcore.kernel.errors import ConfigError
        raise ConfigError(f"--family: no scenario '{ref}'")
    members = sorted(folder.glob(f"{name}_*.yaml"))
    return [ref] + sorted(members, key=lambda f: (_is_async(f), f.name))


def _is_async(path: Path) -> bool:
    tree = yaml.safe_load(path.read_text()) or {}
    asyn = tree.get("asyn") if isinstance(tree, dict) else None
    return bool(isinstance(asyn, dict) and asyn.get("use"))


def strategy_label(cfg) -> str:
    """A Table-1 style name: Sync-Vanilla, Sync-OS, Async-Goal-Rece-Unif, ..."""
    sampler = {"uniform": "Unif", "responsiveness": "Resp", "group": "Group"}.get(
        cfg["federate.sampler"], cfg["federate.sampler"])
    algo = "" if cfg["algorithm.name"] == "fedavg" else f" ({cfg['algorithm.name']})"
    if cfg["course"] == "sync":
        return "Sync-Vanilla" + algo
    from fedcore.handlers.asyn import resolve_strategy
    st = resolve_strategy(cfg)
    if not st.asynchronous:
        kind = {"goal_achieved": "OS", "time_up": "Time", "all_received": "Vanilla"}[st.trigger]
        return f"Sync-{kind}" + algo
    event = "Goal" if st.trigger == "goal_achieved" else "Time"
    manner = "Aggr" if st.manner == "after_aggregating" else "Rece"
    return f"Async-{event}-{manner}-{sampler}{algo}"


def _same_setting(ref, cfg) -> str | None:
    for key in ref._values:
        if key.startswith(_FREE):
            continue
        if ref[key] != cfg[key]:
            return key
    return None


def run_family(files: list[Path], overrides: list[str], outdir: Path | None = None,
               log=sys.stderr) -> list[dict[str, Any]]:
    """Run each member; returns one row per member (the reference first)."""
    from fedcore.kernel.config import load_config
    from fedcore.runtime.course import Course, CourseStalled
    from fedcore.kernel.errors import ConfigError
    rows, ref = [], None
    for path in files:
        cfg = load_config(path, list(overrides) + ["verbose=false"])
        if ref is None:
            ref = cfg
            if cfg["eval.target_acc"] is None:
                raise ConfigError(f"eval.target_acc: {path.name} sets no target; time to target "
                                  "needs one (add eval.target_acc=...)")
        else:
            key = _same_setting(ref, cfg)
            if key is not None:
                raise ConfigError(f"{path.name}: '{key}' differs from {files[0].name}; family members "
                                  "may differ only in name, asyn.*, federate.sampler* and algorithm.*")
        label = strategy_label(cfg)
        log.write(f"running {path.name} ({label}) ...\n")
        log.flush()
        course = Course(cfg, outdir / path.stem if outdir is not None else None)
        try:
            summary = course.run()
        except CourseStalled as exc:      # e.g. sync vanilla when devices drop out
            log.write(f"  {path.name}: {exc}\n")
            rows.append({"scenario": path.stem, "strategy": label, "stalled": True,
                         "time_to_target": None, "rounds_to_target": None, "best_test_acc": None,
                         "virtual_time": None, "rounds": None, "mean_staleness": None,
                         "never_aggregated": None})
            continue
        hist = summary.get("staleness_histogram") or {}
        n = sum(hist.values())
        rows.append({
            "scenario": path.stem, "strategy": label,
            "time_to_target": summary.get("time_to_target"),
            "rounds_to_target": summary.get("rounds_to_target"),
            "best_test_acc": summary["best_test_acc"], "virtual_time": summary["virtual_time"],
            "rounds": summary["rounds"],
            "mean_staleness": sum(int(t) * c for t, c in hist.items()) / n if n else 0.0,
            "never_aggregated": summary.get("clients_never_aggregated"), "stalled": False,
        })
    base = rows[0]["time_to_target"]
    for r in rows:
        t = r["time_to_target"]
        r["speedup"] = base / t if (base is not None and t) else None
    return rows


def format_table(rows: list[dict[str, Any]], target: float) -> str:
    """A Markdown table: time to target and speed-up over the reference row."""
    def num(v, fmt):
        return "not reached" if v is None else format(v, fmt)
    lines = [f"| strategy | virtual time to acc {target:g} (s) | speed-up | aggregations to target | "
             "best acc | mean staleness | clients never aggregated |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["stalled"]:
            lines.append(f"| {r['strategy']} | stalled | — | — | — | — | — |")
            continue
        speed = "—" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        never = "—" if r["never_aggregated"] is None else str(r["never_aggregated"])
        lines.append(f"| {r['strategy']} | {num(r['time_to_target'], '.1f')} | {speed} | "
                     f"{num(r['rounds_to_target'], 'd')} | {r['best_test_acc']:.3f} | "
                     f"{r['mean_staleness']:.2f} | {never} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from fedcore.kernel.config import load_config
    from fedcore.kernel.errors import FedcoreError
    p = argparse.ArgumentParser(prog="python -m fedcore.scenarios.compare", description=__doc__.split("\n")[0])
    p.add_argument("--family", default="async_vs_sync", help="family name (files NAME.yaml, NAME_*.yaml)")
    p.add_argument("--dir", default=str(HERE), help="folder holding the family's YAML files")
    p.add_argument("--rounds", type=int, help="federate.total_round_num for every member")
    p.add_argument("--seed", type=int, help="seed for every member")
    p.add_argument("--outdir", help="write each member's outputs under DIR/<scenario>")
    p.add_argument("--json", help="also write the rows as JSON to this file")
    p.add_argument("--threads", type=int, default=1, help="torch threads (tiny models: 1 is fastest)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = p.parse_intermixed_args(argv)
    overrides = list(args.overrides)
    if args.rounds is not None:
        overrides.append(f"federate.total_round_num={args.rounds}")
    if args.seed is not None:
        overrides.append(f"seed={args.seed}")
    import torch
    torch.set_num_threads(args.threads)
    try:
        files = family_files(args.family, Path(args.dir))
        rows = run_family(files, overrides, Path(args.outdir) if args.outdir else None)
        target = load_config(files[0], overrides)["eval.target_acc"]
    except FedcoreError as exc:
        print(f"compare: {exc}", file=sys.stderr)
        return exc.exit_code
    print(format_table(rows, target))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
