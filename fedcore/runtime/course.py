"""A course: the workers, their handlers and plug-ins, assembled from a config and run.

`Course.build()` makes the data, one global model and one shared client
model, the algorithm's trainer and aggregator, the time model, the workers and
their handler tables. `Course.run()` writes the run's header files, refuses an
incomplete course, raises `start` on every worker and processes events until
the queue is empty.
"""
from __future__ import annotations

import contextlib
import os
import stat
import gc
import logging
from pathlib import Path
from typing import Any

import torch

from fedcore.kernel import registry
from fedcore.runtime.checkpoint import Checkpointer, load_tensor_file, resume, stop_at_round_end
from fedcore.comm.inprocess import InProcessComm
from fedcore.kernel.completeness import CheckResult, require_complete
from fedcore.kernel.files import make_folder, set_private, write_atomic
from fedcore.runtime.device import DeviceStateStore, apply_determinism, place_data, resolve_device
from fedcore.kernel.errors import ConfigError, CourseDiverged, FedcoreError, NothingAggregated, first_line
from fedcore.kernel.model_ops import model_device
from fedcore.execution.executor import close_executor, install_executor
from fedcore.execution.form_boundary import make_trainer
from fedcore.runtime.loggers import make_loggers
from fedcore.runtime.monitor import Callback, Monitor, StopRun
from fedcore.runtime.progress import make_progress
from fedcore.execution.random_layers import draw_on_client_stream
from fedcore.kernel.scheduler import PRIORITY_TIMER, Scheduler, WallClockScheduler
from fedcore.runtime.server_optimizer import install as install_server_optimizer
from fedcore.kernel.state import make_state_store
from fedcore.runtime.timing import TimeModel
from fedcore.kernel.worker import Client, HandlerTable, Server

__all__ = ["Course", "CourseStalled", "load_initial_model", "raise_if_diverged"]


def check_model_reads_data(model: torch.nn.Module, data, cfg) -> None:
    """Evaluate `model` on two of the server's test samples (eval mode, no gradient, no random
    draw), so a model that cannot read the data (token ids into a model of float features, a
    language model's per-position logits against one label a sample) fails here, in one line,
    rather than inside the first fit."""
    split = getattr(data, "server_test", None)
    if cfg["task"] != "train" or split is None or not len(split.y):   # analytics: a request, no predictor
        return
    n = min(2, len(split.y))
    x, y = split.x.narrow(0, 0, n), split.y.narrow(0, 0, n)
    device = model_device(model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(x.to(device))
            if cfg["train.loss"] == "mse":
                torch.nn.functional.mse_loss(out.reshape(y.shape), y.to(device))
            else:   # per sample, or per position ([N, classes, T] against [N, T]) as evaluation takes it
                torch.nn.functional.cross_entropy(out, y.to(device))
    except Exception as exc:   # noqa: BLE001 - any failure here is the pair not fitting: one line
        raise ConfigError(f"model.type: {cfg['model.type']} cannot read data.type {cfg['data.type']} "
                          f"(samples {list(x.shape[1:])} of {str(x.dtype).replace('torch.', '')}, "
                          f"labels {list(y.shape[1:])} of {str(y.dtype).replace('torch.', '')}): "
                          f"{type(exc).__name__}: {first_line(exc)}") from None
    finally:
        model.train(was_training)


class CourseStalled(FedcoreError):
    """The event queue ran dry before the course finished."""


def load_initial_model(model: torch.nn.Module, path: str) -> None:
    """Load `model.init_from` (a torch.save'd state_dict) into `model`."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"model.init_from: file '{p}' does not exist")
    state = load_tensor_file(p, "model.init_from", "a loadable state_dict")
    if isinstance(state, dict) and "round" in state and isinstance(state.get("global_state"), dict):
        raise ConfigError(f"model.init_from: '{p}' is a course checkpoint, not a model's state_dict; "
                          "continue that course with resume_from, or start from its final_model.pt")
    try:
        model.load_state_dict(state)
    except (RuntimeError, TypeError, AttributeError) as exc:
        expected = model.state_dict()
        given = state if isinstance(state, dict) else {}
        missing = [k for k in expected if k not in given]
        unexpected = [k for k in given if k not in expected]
        wrong = [k for k in expected if k in given and torch.is_tensor(given[k])
                 and tuple(given[k].shape) != tuple(expected[k].shape)]
        parts = [f"{label} {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
                 for label, names in (("missing", missing), ("unexpected", unexpected),
                                      ("of another shape", wrong)) if names]
        why = "; ".join(parts) or first_line(exc)
        raise ConfigError(f"model.init_from: '{p}' does not fit model.type ({why})") from None


def check_share_params(model: torch.nn.Module, cfg) -> None:
    """Each `federate.share_params` pattern must name some entry: a typo would otherwise keep
    the whole model local and the course would train nothing together, silently."""
    import fnmatch
    patterns = cfg["federate.share_params"] or []
    names = list(model.state_dict())
    for p in patterns:
        if not isinstance(p, str) or not any(fnmatch.fnmatchcase(n, p) for n in names):
            shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            raise ConfigError(f"federate.share_params: pattern {p!r} matches no entry of model.type "
                              f"{cfg['model.type']} ({shown})")


class Course:
    """One federated course in simulation (virtual time, one process)."""

    def __init__(self, cfg, outdir: str | Path | None = None, progress: bool | int = False,
                 callbacks: list[Callback] | tuple = ()):
        """`progress` is a `verbose` level (False: none); `callbacks` are extra side outputs
        that see every record and the summary, after the progress display and `loggers`."""
        self.cfg = cfg
        set_private(cfg.get("outputs.private", True))   # the modes of every file this process writes
        outdir = outdir if outdir is not None else cfg["outdir"]
        self.outdir = Path(outdir) if outdir is not None else None
        self.log = logging.getLogger("fedcore.course")
        self.scheduler = Scheduler()
        total = cfg["federate.total_round_num"]
        shown = make_progress(progress, total, cfg["progress.interval"],
                              wall_clock=cfg["federate.mode"] == "distributed")
        side_outputs = ([shown] if shown else []) + make_loggers(cfg, self.outdir) + list(callbacks)
        self.monitor = Monitor(self.outdir, cfg["eval.target_acc"], total_rounds=total,
                               callbacks=side_outputs)
        self.server_table = HandlerTable("server")
        self.client_table = HandlerTable("client")
        self.extra_tables: list[HandlerTable] = []  # roles that plug-ins add (e.g. attackers)
        self.tier_graph = None   # the workers' tree, where edge aggregators make one (handlers/edge)
        self.num_clients = cfg["federate.client_num"]
        self.client_ids = list(range(1, self.num_clients + 1))
        self.built = False

    # ------------------------------------------------------------ assembly
    def build(self, data: Any = None) -> "Course":
        cfg = self.cfg
        if cfg["data.partition"] == "vertical":   # parties hold columns, not clients rows
            registry.components.get("vertical_course")(self)
            return self
        self.data = data if data is not None else registry.components.get("federated_data")(cfg)
        self.data_from_config = data is None     # what a remote executor can rebuild on its own
        self.say_empty_clients()
        model = self.make_model()
        try:
            self.store = make_state_store(cfg["state.store"], cfg["state.path"])
        except OSError as exc:
            raise ConfigError(f"state.path: cannot use '{cfg['state.path']}' for the disk state store "
                              f"({exc.strerror or exc}); choose a writable folder") from None
        self.timing = TimeModel.from_config(cfg, self.client_ids)
        self.comm = InProcessComm(self.scheduler, self.timing, self.monitor.count_bytes)
        if self.timing.has_dropouts:
            self.comm.filters.append(self.timing.keep)  # dropped-out clients never reply
        self.make_server(model, self.client_ids)
        # the server's module views the aggregator's copy of the model from now on, as after any
        # evaluation (handlers/evaluation.py `load_global`), and the trainer copies it: two
        # models while the course is built, not three
        model.load_state_dict(self.server.aggregator.global_state, strict=False, assign=True)
        self.trainer = make_trainer(self.algorithm, model, cfg, self.trainer_store())
        self.comm.attach(self.server)
        self.clients: dict[int, Client] = {}
        for cid in self.client_ids:
            client = Client(cid, self.client_table, self, self.data.clients[cid])
            client.finished = False
            self.clients[cid] = client
            self.comm.attach(client)
        self.install_handlers()
        install_executor(self)
        self.resumed_at = resume(self, cfg["resume_from"]) if cfg["resume_from"] else None
        self.built = True
        return self

    def say_empty_clients(self) -> None:
        """Warn once when clients hold no training samples (more clients than the data can give
        each one): they only send the received model back. Data made on access are not counted."""
        clients = getattr(self.data, "clients", None)
        if type(clients) is not dict:
            return
        empty = [cid for cid, c in clients.items()
                 if not isinstance(getattr(type(c), "train", None), property) and len(c.train.y) == 0]
        if empty:
            shown = ", ".join(map(str, empty[:5])) + (", ..." if len(empty) > 5 else "")
            self.log.warning("data: %d of %d clients have no training samples (%s): they send the "
                             "received model back each round; fewer clients (federate.client_num) or "
                             "more data give each some", len(empty), len(clients), shown)

    # The pieces below are shared with the deployment's server and client courses.
    @property
    def algorithm(self):
        return registry.algorithms.get(self.cfg["algorithm.name"])

    def make_model(self) -> torch.nn.Module:
        """The initial global model: built for the data's shapes, or loaded from model.init_from,
        on the course's device (where the data go too, when they fit)."""
        build_model = registry.components.get("model")
        model = build_model(self.cfg, self.data.input_shape, self.data.num_classes)
        if self.cfg["model.init_from"]:
            load_initial_model(model, self.cfg["model.init_from"])
        check_share_params(model, self.cfg)
        self.device = resolve_device(self.cfg["device"])
        apply_determinism(self.cfg)
        if self.device.type != "cpu":
            self.data = place_data(self.data, self.device, self.cfg["device_data_bytes"])
            draw_on_client_stream(model.to(self.device))   # dropout masks: the CPU's numbers
        check_model_reads_data(model, self.data, self.cfg)
        return model

    def trainer_store(self):
        """The state store as the trainer sees it: states on the device, kept on the CPU."""
        if self.device.type == "cpu":
            return self.store
        return DeviceStateStore(self.store, self.device)

    def make_server(self, model: torch.nn.Module, sampled_from: list[int]) -> Server:
        """The server worker with its aggregator, sampler and round state."""
        cfg = self.cfg
        server = self.server = Server(self.server_table, self)
        server.model = model
        server.aggregator = self.algorithm.aggregator(model, cfg, self.num_clients)
        server.sampler = registry.samplers.get(cfg["federate.sampler"])(sampled_from, cfg["seed"], self.timing)
        if hasattr(server.sampler, "configure"):
            server.sampler.configure(self)  # samplers that read the config or the devices
        server.joined, server.started, server.finished = set(), False, False
        server.round, server.selected, server.buffer = 1, set(), []
        server.starting_round = server.next_round_asked = False   # sync.start_round's turns
        server.best_acc, server.evals_since_best = None, 0
        self.checkpointer = Checkpointer(self)
        install_server_optimizer(server, self.checkpointer)
        return server

    def install_handlers(self) -> None:
        """The course's handler set, then the behaviours the config selects."""
        registry.courses.get(self.cfg["course"])(self)
        self.behaviours = registry.selected_behaviours(self.cfg)
        for name in self.behaviours:
            registry.behaviours.get(name)(self)
        server = getattr(self, "server", None)
        if server is not None:   # every course's summary: what the global model holds, what trains
            params = list(server.model.parameters())   # a shared tensor once
            self.monitor.add_summary("model", {"trainable_params": sum(p.numel() for p in params if p.requires_grad),
                                               "total_params": sum(p.numel() for p in params)})

    @property
    def tables(self) -> list[HandlerTable]:
        return [self.server_table, self.client_table, *self.extra_tables]

    # ------------------------------------------------------------ outputs
    def write_header(self) -> None:
        """config.yaml and handlers.txt, written before anything runs."""
        if self.outdir is None:
            return
        self._refuse_another_runs_records()
        self._make_outdir()
        self.cfg.dump(self.outdir / "config.yaml")
        self.cfg.dump_sources(self.outdir / "config_sources.yaml")
        sections = [t.describe() for t in self.tables]
        if getattr(self, "behaviours", None):
            sections.append("[behaviours]\n" + "\n".join(f"  {b}" for b in self.behaviours))
        write_atomic(self.outdir / "handlers.txt", "\n\n".join(sections) + "\n")

    def _refuse_another_runs_records(self) -> None:
        """A course run again into the same outdir, simulated or deployed, must not silently
        replace the records of the run before it; resuming continues them."""
        metrics = self.outdir / "metrics.jsonl"
        try:   # a link planted there is no run's records: the writer replaces it, never follows it
            held = stat.S_ISREG((found := os.lstat(metrics)).st_mode) and found.st_size > 0
        except OSError:
            held = False
        if not self.cfg["outdir_overwrite"] and not self.cfg["resume_from"] and held:
            raise ConfigError(f"outdir: '{self.outdir}' holds another run's records (metrics.jsonl); "
                              "choose a new outdir, or set outdir_overwrite=true to replace them")

    def _make_outdir(self) -> None:
        try:
            make_folder(self.outdir)
        except OSError as exc:
            raise ConfigError(f"outdir: cannot create '{self.outdir}' ({exc.strerror or exc}); "
                              "choose a writable folder") from None

    def check(self) -> CheckResult:
        """The completeness check; raises IncompleteCourseError (exit 3) when it fails."""
        graphml = self.outdir / "message_flow.graphml" if self.outdir is not None else None
        if graphml is not None:
            self._make_outdir()
        return require_complete(self.tables, graphml, self.tier_graph)

    # ------------------------------------------------------------ running
    def run(self) -> dict[str, Any]:
        """Run the course to its finish; returns the summary."""
        if not self.built:
            self.build()
        self.write_header()
        self.check()
        if self.resumed_at is not None:
            pending = self.monitor.open_records().get(self.server.round)
            info = {"round": self.server.round, "pending_eval": bool(pending and pending["expected"])}
            self.scheduler.schedule(self.resumed_at, PRIORITY_TIMER, StartEvent(self.server, "resume", info))
        else:
            for w in [self.server] + [self.clients[c] for c in self.client_ids]:
                self.scheduler.schedule(0.0, PRIORITY_TIMER, StartEvent(w, "start"))
        self.monitor.start()
        try:
            with collector_for_run(), stop_at_round_end(self):
                self.scheduler.run()
        except (KeyboardInterrupt, StopRun) as stop:
            # Ctrl-C or a callback: keep what the run has so far, as a deployed server does; the
            # global model is the last aggregated one (aggregators replace it whole, never in part).
            self.monitor.add_summary("stop", {"stopped_by": getattr(stop, "reason", "interrupted")})
            summary = self.monitor.finalize(self.server.now, self.server.aggregator.global_state)
            if isinstance(stop, KeyboardInterrupt):
                raise
            return summary
        finally:
            close_executor(self)
            self.store.close()
        if not self.server.finished:
            why = (f"course stalled in round {self.server.round}: no event left before finish "
                   f"(waiting for {len(self.server.selected)} update(s)); a sync course needs every "
                   "sampled client to reply: use over-selection, time_up or an async strategy")
            # what the course has so far is kept, as when it is stopped
            self.monitor.add_summary("stop", {"stopped_by": "stalled", "stalled": why})
            self.monitor.finalize(self.server.now, self.server.aggregator.global_state)
            raise CourseStalled(why)
        summary = self.monitor.finalize(self.finish_time, self.server.aggregator.global_state)
        raise_if_diverged(self.server)
        return summary

    def check_or_run(self, check_only: bool) -> int:
        """What `python -m fedcore.run` does with a built course: `--check`, or run it; one line out."""
        if check_only:
            self.write_header()
            result = self.check()
            where = (f"; graph in {self.outdir / 'message_flow.graphml'}" if self.outdir
                     else "; set outdir=DIR to also write the graph and handler tables")
            print(f"complete: a path leads from start to finish ({result.graph.number_of_nodes()} "
                  f"nodes, {result.graph.number_of_edges()} edges){where}")
            return 0
        summary = self.run()
        acc_s = self._final_accuracy(summary)
        virtual = "" if self.wall_clock else f"{summary['virtual_time']:.1f}s virtual, "
        print(f"finished {summary['rounds']} round{'' if summary['rounds'] == 1 else 's'} in {virtual}{summary['wall_time']:.1f}s wall{acc_s}; "
              f"outputs in {self.outdir}")
        return 0

    def _final_accuracy(self, summary: dict) -> str:
        """The last line's accuracy: the global model's, or for a personalized course (FedRep,
        pFedMe, Ditto, fine-tuning, FedBN) the mean over the clients' own models first."""
        acc = summary.get("final_test_acc")
        personalized = self.algorithm.personalized or "personalization" in summary
        if not personalized:
            return f", final test_acc {acc:.4f}" if acc is not None else ""
        mean = (summary.get("final") or {}).get("client_test_acc_mean")
        own = (f", final personalized test_acc {mean:.4f} (mean of the clients' own models)" if mean is not None
               else ", no personalized test_acc (set eval.clients=true)")
        return own + (f", global model's test_acc {acc:.4f}" if acc is not None else "")

    @property
    def wall_clock(self) -> bool:
        """True where time is real seconds (deployment), False in virtual-time simulation."""
        return isinstance(self.scheduler, WallClockScheduler)

    @property
    def finish_time(self) -> float:
        return self.server.now


@contextlib.contextmanager
def collector_for_run():
    """The garbage collector's settings while a course runs, undone afterwards (the course may
    run inside a user's own process).

    The objects that exist when it starts (its data, clients, model, and everything imported)
    are frozen: they live to the end, and a course allocates enough per round that a full
    collection would otherwise walk them all every few hundred rounds (about 0.15 s each for
    W1's 1,000 clients); they are still freed by reference counting. And young objects are
    collected in larger batches: a round makes and drops thousands of short-lived objects, and
    at the default threshold a young collection ran about once a round, in the middle of it,
    walking objects that were about to be freed anyway. Where the process has already frozen
    objects of its own, its freeze is left alone."""
    frozen = not gc.get_freeze_count()
    if frozen:
        gc.freeze()
    thresholds = gc.get_threshold()
    gc.set_threshold(_YOUNG_OBJECTS, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        if frozen:
            gc.unfreeze()


_YOUNG_OBJECTS = 100_000   # net new container objects between young collections (Python: 700)


def raise_if_diverged(server) -> None:
    """After the outputs are written: a course stopped by divergence, or a secure course that
    aggregated no round, exits with its own code."""
    from fedcore.kernel.server_state import Outcome
    outcome = server.state(Outcome)
    if outcome.diverged:
        raise CourseDiverged(outcome.diverged)
    if outcome.unaggregated:
        raise NothingAggregated(outcome.unaggregated)


class StartEvent:
    """A scheduled `start`/`resume` event; skipped where the worker has no handler for it."""

    __slots__ = ("worker", "event", "payload")

    def __init__(self, worker, event: str, payload: Any = None):
        self.worker, self.event, self.payload = worker, event, payload

    def __call__(self) -> None:
        if self.worker.handlers.get(self.event) is not None:
            self.worker.trigger(self.event, self.payload)
