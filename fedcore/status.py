"""`python -m fedcore.status ADDRESS|OUTDIR`: one screen of a course's state, for a terminal.

From an OUTDIR it reads the run's files (metrics.jsonl, summary.json, its snapshots);
from ADDRESS (host:port of a deployed server's `distribute.metrics_port`) it scrapes
/metrics (with `--token-file` where the endpoint asks for the operator's token) and parses
the Prometheus text with prometheus_client's parser (the 'ops' extra).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from fedcore.kernel.errors import EXIT_OK, ConfigError, FedcoreError, exit_code_of

__all__ = ["from_outdir", "from_address", "render", "main"]


def _last_lines(path: Path) -> list[dict]:
    records = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return records
    for line in text.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("round"), int):
            records.append(obj)
    return records


def from_outdir(folder: Path) -> dict[str, Any]:
    """A run's state as its folder tells it."""
    if not folder.is_dir():
        raise ConfigError(f"OUTDIR: '{folder}' is not a folder (or give host:port of a metrics endpoint)")
    records = _last_lines(folder / "metrics.jsonl")
    evals = [r for r in records if isinstance(r.get("test_acc"), (int, float))]
    state: dict[str, Any] = {"source": str(folder), "rounds_completed": len(records),
                             "round": records[-1]["round"] if records else None,
                             "test_acc": evals[-1]["test_acc"] if evals else None,
                             "test_acc_round": evals[-1]["round"] if evals else None,
                             "clients_last_round": records[-1].get("num_updates") if records else None}
    eps = [r["dp_epsilon"] for r in records if isinstance(r.get("dp_epsilon"), (int, float))]
    state["dp_epsilon"] = eps[-1] if eps else None
    snapshots = sorted((folder / "checkpoints").glob("round_*.pt"), key=lambda p: p.stat().st_mtime) \
        if (folder / "checkpoints").is_dir() else []
    if snapshots:
        state["snapshot"] = snapshots[-1].name
        state["snapshot_age_seconds"] = time.time() - snapshots[-1].stat().st_mtime
    try:
        summary = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError):
        summary = None
    state["finished"] = isinstance(summary, dict)
    if isinstance(summary, dict) and isinstance(summary.get("stopped_by"), str):
        state["stopped_by"] = summary["stopped_by"]
    refused: dict[str, int] = {}
    if isinstance(summary, dict):
        for kind, n in (summary.get("admission") or {}).items():
            refused[f"admission: {kind}"] = n
        for kind, n in ((summary.get("deployment") or {}).get("refused") or {}).items():
            refused[f"connection: {kind}"] = n
        clients = (summary.get("deployment") or {}).get("clients") or {}
        if clients:
            states = [c.get("state") for c in clients.values() if isinstance(c, dict)]
            state["clients"] = {s: states.count(s) for s in sorted(set(states))}
    state["refused"] = refused
    return state


def scrape(address: str, token: str | None = None, timeout: float = 5.0) -> str:
    """The Prometheus text at http://ADDRESS/metrics."""
    request = urllib.request.Request(f"http://{address}/metrics",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.read().decode()
    except urllib.error.HTTPError as exc:
        hint = " (give --token-file with the operator's token)" if exc.code == 401 else ""
        raise FedcoreError(f"{address}: /metrics answered {exc.code}{hint}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise FedcoreError(f"{address}: cannot reach /metrics ({getattr(exc, 'reason', exc)}); is "
                           "distribute.metrics_port set on that server?") from None


def from_address(address: str, token: str | None = None) -> dict[str, Any]:
    """A deployed course's state from its metrics endpoint."""
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        raise ConfigError('ADDRESS needs the optional extra \'ops\': pip install "fedcore[ops]"') from None
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(scrape(address, token)):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))

    def one(name: str, **labels) -> float | None:
        got = [v for l, v in samples.get(name, []) if all(l.get(k) == x for k, x in labels.items())]
        return got[0] if got else None

    fields = {l["field"]: v for l, v in samples.get("fedcore_record_value", [])}
    at = {l["field"]: v for l, v in samples.get("fedcore_record_round", [])}
    state: dict[str, Any] = {
        "source": address, "round": one("fedcore_round"), "rounds_completed": one("fedcore_rounds_completed_total"),
        "test_acc": fields.get("test_acc"), "test_acc_round": at.get("test_acc"),
        "dp_epsilon": one("fedcore_dp_epsilon"),
        "clients": {l["state"]: int(v) for l, v in samples.get("fedcore_clients", [])},
        "clients_expected": one("fedcore_clients_expected"),
        "refused": {f"{l['stage']}: {l['reason']}": int(v) for l, v in samples.get("fedcore_refused_total", [])},
        "bytes": {l["direction"]: int(v) for l, v in samples.get("fedcore_bytes_total", [])},
    }
    age = one("fedcore_snapshot_age_seconds")
    if age is not None:
        state["snapshot"] = f"round {int(one('fedcore_snapshot_round'))}"
        state["snapshot_age_seconds"] = age
    return state


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if not v.is_integer() else str(int(v))
    return str(v)


def render(state: dict[str, Any]) -> str:
    """The state as a few aligned lines."""
    end = "" if not state.get("finished") else \
        f"  (finished: {state['stopped_by']})" if state.get("stopped_by") else "  (finished)"
    lines = [f"course       {state['source']}{end}"]
    lines.append(f"round        {_fmt(state.get('round'))} ({_fmt(state.get('rounds_completed'))} recorded)")
    clients = state.get("clients")
    if clients:
        text = ", ".join(f"{n} {s}" for s, n in clients.items())
        if state.get("clients_expected") is not None:
            text += f" (of {_fmt(state['clients_expected'])})"
        lines.append(f"clients      {text}")
    elif state.get("clients_last_round") is not None:
        lines.append(f"clients      {state['clients_last_round']} updates in the last round")
    acc = state.get("test_acc")
    lines.append(f"test_acc     {_fmt(acc)}" + (f" (round {_fmt(state.get('test_acc_round'))})" if acc is not None else ""))
    if state.get("dp_epsilon") is not None:
        lines.append(f"dp epsilon   {_fmt(state['dp_epsilon'])}")
    if state.get("bytes"):
        lines.append("bytes        " + ", ".join(f"{k} {v:,}" for k, v in state["bytes"].items()))
    if state.get("snapshot"):
        lines.append(f"snapshot     {state['snapshot']}, {state['snapshot_age_seconds']:.0f} s old")
    else:
        lines.append("snapshot     none")
    refused = state.get("refused") or {}
    lines.append(f"refused      {sum(refused.values())}")
    for kind, n in sorted(refused.items()):
        lines.append(f"  {n:>8}  {kind}")
    return "\n".join(lines)


def _run(args) -> int:
    target = args.target
    token = None
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"--token-file: cannot read '{args.token_file}' ({exc.strerror})") from None
    if Path(target).exists() or ":" not in target:
        state = from_outdir(Path(target))
    else:
        state = from_address(target, token)
    print(render(state))
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedcore.status",
                                description="One screen of a course's state, from its outdir or its metrics endpoint.")
    p.add_argument("target", metavar="ADDRESS|OUTDIR", help="host:port of distribute.metrics_port, or a run's outdir")
    p.add_argument("--token-file", help="file with the operator's token (distribute.operator_token_file)")
    args = p.parse_args(argv)
    return exit_code_of("fedcore.status", lambda: _run(args))


if __name__ == "__main__":
    sys.exit(main())
