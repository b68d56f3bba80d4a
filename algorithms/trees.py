"""Federated gradient-boosted trees (`task: trees`): the plug-ins of a course whose model is an
XGBoost booster and whose updates are sketches, histograms or trees.

Round 1 agrees on what every party needs: the bin cuts (merged from the clients' sketches,
algorithms/trees_core.py) and the base score (the union's label mean). Then, by `trees.mode`:

- `histogram` (exact): one round per tree level; each client sends the gradient/hessian
  histograms of its rows in the level's open nodes, the server sums them and picks the splits.
  With the same cuts the booster equals XGBoost's `hist` trained on the union.
- `bagging` (Flower's FedXgbBagging): each client boosts `trees.local_rounds` trees on its
  rows from the global booster; the server appends every client's new trees.
- `cyclic` (Flower's FedXgbCyclic): one client a round, in turn, boosts the global booster;
  its new trees are appended.

The "model" the server broadcasts is a dict of tensors: the booster's JSON bytes, the cuts,
the partial tree and its open nodes. Nothing is unpickled: JSON and raw numbers only.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from torch import nn

from fedcore.algorithms import trees_core as tc
from fedcore.algorithms import trees_secure  # noqa: F401  (declares trees.secure_frac_bits)
from fedcore.kernel.config import declare, positive, non_negative, resolver, validator
from fedcore.kernel.contract import Aggregator, Algorithm, FitResult, ReceivedUpdate
from fedcore.kernel.errors import ConfigError, NothingAggregated
from fedcore.kernel.hooks import Wrappable
from fedcore.kernel.registry import algorithms, models
from fedcore.scenarios import vertical_data  # noqa: F401  (its resolver names the vertical course first)

__all__ = ["TreesTrainer", "TreesAggregator", "TREES", "params_of", "table_of", "booster_of"]

MODES = ("histogram", "bagging", "cyclic")
SKETCH, HISTOGRAM, BOOST = 0, 1, 2

declare("trees.mode", str, "histogram", "task: trees: histogram (exact federated hist GBDT), "
        "bagging (every client boosts, the server appends all new trees) or cyclic (one client a "
        "round, in turn, boosts the global booster)", choices=MODES)
declare("trees.objective", str, "binary:logistic", "task: trees: XGBoost objective (labels 0/1 for "
        "binary:logistic, numbers for reg:squarederror)", choices=tc.OBJECTIVES)
declare("trees.num_trees", int, 10, "task: trees: boosting iterations (histogram: trees; bagging "
        "and cyclic: server rounds, each adding trees.local_rounds trees per client asked)", check=positive)
declare("trees.local_rounds", int, 1, "task: trees, bagging and cyclic: trees a client boosts per round",
        check=positive)
declare("trees.max_depth", int, 3, "task: trees: XGBoost max_depth (histogram: rounds per tree)", check=positive)
declare("trees.eta", float, 0.3, "task: trees: XGBoost eta (learning rate)", check=positive)
declare("trees.reg_lambda", float, 1.0, "task: trees: XGBoost lambda (L2 on leaf weights)", check=non_negative)
declare("trees.min_child_weight", float, 1.0, "task: trees: XGBoost min_child_weight", check=non_negative)
declare("trees.min_split_loss", float, 0.0, "task: trees: XGBoost gamma", check=non_negative)
declare("trees.max_bin", int, 256, "task: trees: XGBoost max_bin; a feature with at most this many "
        "distinct values (over the union) is cut at each, exactly as XGBoost cuts it",
        check=lambda v: None if v >= 2 else f"must be >= 2, got {v}")
declare("trees.base_score", float, None, "task: trees: the initial prediction (a probability for "
        "binary:logistic); null: the union's label mean, agreed in round 1")


@resolver
def _trees_course(values: dict) -> None:
    """`task: trees` runs the trees course and plug-ins for a fixed upper bound of rounds; with
    `data.partition: vertical`, SecureBoost (handlers/secureboost.py), a round per tree."""
    if values["task"] != "trees":
        return
    if values["data.partition"] == "vertical":
        values.update({"course": "trees_secureboost", "federate.total_round_num": values["trees.num_trees"],
                       "model.dtype": "float64"})
        return
    hist = values["trees.mode"] == "histogram"
    rounds = values["trees.num_trees"] * (values["trees.max_depth"] if hist else 1)
    values.update({"course": "trees", "algorithm.name": "trees", "model.type": "trees_booster",
                   "model.dtype": "float64", "federate.total_round_num": 1 + rounds,
                   "train.loss": "mse" if values["trees.objective"] == "reg:squarederror" else "cross_entropy",
                   "federate.sample_client_num": None, "federate.sample_client_rate": None})


@validator
def _check_trees(cfg) -> None:
    if cfg["task"] != "trees":
        for key, own in (("algorithm.name", "trees"), ("course", "trees"), ("course", "trees_secureboost"),
                         ("model.type", "trees_booster")):
            if cfg[key] == own:   # set alone, the course would fail at its first message
                raise ConfigError(f"{key}: {own} belongs to task: trees, which sets it with the "
                                  "rest of the course; set task=trees instead")
        return
    try:
        import xgboost  # noqa: F401
    except ImportError:
        raise ConfigError("task: trees needs xgboost (pip install 'fedcore[trees]')") from None
    for key, default, as_text in (("topology.edges", 0, "0"), ("asyn.use", False, "false"),
                                  ("executor", "sequential", "sequential"),
                                  ("privacy.dp.mode", "none", "none")):
        if cfg[key] != default:
            raise ConfigError(f"{key}: task: trees runs every round in a star, one client after "
                              f"another, without DP of updates; set {key}={as_text}")
    if cfg["secure_aggregation.enabled"] and (cfg["trees.mode"] != "histogram" or cfg["data.partition"] == "vertical"):
        raise ConfigError("secure_aggregation.enabled: task: trees sums histograms securely in trees.mode "
                          "histogram only (bagging and cyclic send trees, SecureBoost encrypts its own); "
                          "set trees.mode=histogram or secure_aggregation.enabled=false")
    b = cfg["trees.base_score"]
    if b is not None and cfg["trees.objective"] == "binary:logistic" and not 0 < b < 1:
        raise ConfigError(f"trees.base_score: {b} is not a probability in (0, 1) (binary:logistic)")


def params_of(cfg) -> tc.Params:
    return tc.Params(cfg["trees.objective"], cfg["trees.max_depth"], cfg["trees.eta"], cfg["trees.reg_lambda"],
                     cfg["trees.min_child_weight"], cfg["trees.min_split_loss"], cfg["trees.max_bin"])


def table_of(data) -> tuple[np.ndarray, np.ndarray]:
    """A client's whole table (train, val and test rows) as float64 features and labels."""
    splits = [getattr(data, f) for f in ("train", "val", "test") if hasattr(data, f)]
    x = torch.cat([s.x.flatten(1) for s in splits]) if splits else torch.zeros(0, 0)
    y = torch.cat([s.y for s in splits]) if splits else torch.zeros(0)
    return x.to(torch.float64).cpu().numpy(), y.to(torch.float64).cpu().numpy()


def _bytes(t: torch.Tensor) -> bytes:
    return t.cpu().numpy().astype(np.uint8).tobytes()


def _tensor(b: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(b, dtype=np.uint8).copy())


def booster_of(model_json: bytes):
    """An `xgboost.Booster` from JSON bytes (XGBoost parses them; nothing is unpickled)."""
    import xgboost as xgb
    return xgb.Booster(model_file=bytearray(model_json))


class TreesBooster(nn.Module):
    """What the server broadcasts; empty until round 1 has agreed the cuts and base score."""

    def __init__(self, num_features: int = 0):
        super().__init__()
        self.num_features = num_features   # the data's columns (not broadcast: a bound's input)
        for name, t in _empty_state().items():
            self.register_buffer(name, t)


def _empty_state() -> dict[str, torch.Tensor]:
    return {"stage": torch.tensor([SKETCH]), "booster": torch.zeros(0, dtype=torch.uint8),
            "cuts": torch.zeros(0, 0, dtype=torch.float64), "nodes": torch.zeros(0, 4, dtype=torch.float64),
            "frontier": torch.zeros(0, dtype=torch.int64)}


@models.register("trees_booster")
def trees_booster(cfg, input_shape, num_classes: int) -> nn.Module:
    return TreesBooster(int(np.prod(input_shape)) if input_shape else 0)


def _cuts(t: torch.Tensor) -> list[np.ndarray]:
    """Each feature's cuts from the broadcast rows, padded by repeating the last (increasing) one."""
    return [np.unique(row).astype(np.float32) for row in t.numpy()]


# ------------------------------------------------------------------ the plug-ins
class TreesTrainer(Wrappable):
    """Client side: a sketch, a level's histograms, or locally boosted trees."""

    tensor_form = "torch"

    def __init__(self, model: nn.Module, cfg, store):
        self.model, self.cfg, self.store = model, cfg, store
        self.params = params_of(cfg)
        self.device = torch.device("cpu")

    def fit(self, client_id: int, data, received: dict, round_: int) -> FitResult:
        x, y = table_of(data)
        state = received["model"]
        stage = int(state["stage"][0])
        out = {"sketch": torch.zeros(0, dtype=torch.float64), "hist": torch.zeros(0, dtype=torch.float64),
               "trees": torch.zeros(0, dtype=torch.uint8), "num_samples": len(y)}
        if stage == SKETCH:
            values, counts = tc.local_sketch(x, 2 * self.params.max_bin)
            out["sketch"] = torch.from_numpy(np.concatenate([values.ravel(), counts.ravel(), [y.sum()]]))
        elif stage == HISTOGRAM:
            frontier = state["frontier"].tolist()
            if frontier:
                cuts = _cuts(state["cuts"])
                margin = booster_of(_bytes(state["booster"])).predict(_dmatrix(x), output_margin=True)
                g, h = tc.grad_hess(self.params.objective, margin, y)
                bins = tc.bin_rows(x, cuts)
                at = tc.route(bins, state["nodes"].numpy())
                hist = tc.histograms(bins, g, h, at, frontier, state["cuts"].shape[1])
                out["hist"] = torch.from_numpy(hist.ravel())
        else:
            import xgboost as xgb
            base = booster_of(_bytes(state["booster"]))
            had = base.num_boosted_rounds()
            params = {**self.params.xgboost(0.5), "nthread": 1, "seed": self.cfg["seed"]}
            params.pop("base_score")   # continued from the global booster, which holds it
            bst = xgb.train(params, xgb.DMatrix(x, label=y), self.cfg["trees.local_rounds"], xgb_model=base)
            new = json.loads(bytes(bst.save_raw("json")))["learner"]["gradient_booster"]["model"]["trees"][had:]
            out["trees"] = _tensor(json.dumps(new).encode())
        return FitResult(out, float(len(y)))

    def evaluate(self, client_id: int, data, received: dict) -> dict[str, float]:
        return {}


def _dmatrix(x: np.ndarray):
    import xgboost as xgb
    return xgb.DMatrix(x)


class TreesAggregator(Aggregator):
    """Server side: agree on cuts and base score, then grow, append or pass on trees."""

    def __init__(self, model: nn.Module, cfg, num_clients: int):
        super().__init__(model, cfg, num_clients)
        self.params = params_of(cfg)
        self.mode = cfg["trees.mode"]
        self.model: dict | None = None     # the booster in XGBoost's JSON format
        self.cuts: list[np.ndarray] = []
        self.builder: tc.TreeBuilder | None = None
        self.num_feature = 0
        self.columns = getattr(model, "num_features", 0)
        self.finished = False

    # a secure level that was skipped (too few survivors) reaches `aggregate` with no histograms:
    # the tree cannot do without them, so the course stops there
    releases_empty_rounds = True

    def aggregate(self, updates: list[ReceivedUpdate], round_: int) -> dict[str, float]:
        if not updates:
            raise NothingAggregated(f"trees: round {round_} has no updates (a secure round was skipped); "
                                    "a tree cannot skip a level")
        ordered = sorted(updates, key=lambda u: u.client_id)   # one order of float sums everywhere
        stage = int(self.global_state["stage"][0])
        fields: dict[str, float] = {"trees_stage": float(stage)}
        if stage == SKETCH:
            self._agree(ordered)
        elif stage == HISTOGRAM:
            if self.builder.frontier:
                k, f, b = len(self.builder.frontier), len(self.cuts), self.global_state["cuts"].shape[1]
                total = np.sum([u.content["hist"].numpy().reshape(k, f, b, 2) for u in ordered], axis=0)
                self.builder.grow(total)
            if self.builder.done:
                self.model = tc.with_trees(self.model, [self.builder.xgboost_tree(0, self.num_feature)])
                fields["trees_tree_done"] = 1.0
                self.builder = tc.TreeBuilder(self.params, self.cuts)
        else:
            new = [t for u in ordered for t in json.loads(_bytes(u.content["trees"]).decode())]
            self.model = tc.with_trees(self.model, new)
            fields["trees_tree_done"] = 1.0
        fields["trees_count"] = float(tc.tree_count(self.model))
        target = self.cfg["trees.num_trees"] * (1 if self.mode == "histogram" else self.cfg["trees.local_rounds"])
        self.finished = (tc.tree_count(self.model) >= target if self.mode == "histogram"
                         else round_ >= self.cfg["federate.total_round_num"])
        self._publish()
        return fields

    def _agree(self, ordered: list[ReceivedUpdate]) -> None:
        """Round 1: cuts from the merged sketches, base score from the label sums."""
        n = sum(int(u.content["num_samples"]) for u in ordered)
        width = 2 * self.params.max_bin
        vecs = [u.content["sketch"].numpy() for u in ordered]
        self.num_feature = (len(vecs[0]) - 1) // (2 * width)
        f = self.num_feature
        values = np.stack([v[:f * width].reshape(f, width) for v in vecs])
        counts = np.stack([v[f * width:2 * f * width].reshape(f, width) for v in vecs])
        self.cuts = tc.merge_cuts(values, counts, self.params.max_bin)
        base = self.cfg["trees.base_score"]
        if base is None:
            base = float(sum(v[-1] for v in vecs) / max(n, 1))
            if self.params.objective == "binary:logistic":
                base = min(max(base, 1e-6), 1 - 1e-6)
        self.base_score = base
        self.model = tc.template(self.params.xgboost(base), f)
        self.builder = tc.TreeBuilder(self.params, self.cuts)

    def _publish(self) -> None:
        width = max(len(c) for c in self.cuts)
        cuts = np.stack([np.pad(c, (0, width - len(c)), mode="edge") for c in self.cuts]).astype(np.float64)
        hist = self.mode == "histogram"
        self.global_state = {
            "stage": torch.tensor([HISTOGRAM if hist else BOOST]),
            "booster": _tensor(self.model_json()), "cuts": torch.from_numpy(cuts),
            "nodes": torch.from_numpy(self.builder.wire()) if hist else torch.zeros(0, 4, dtype=torch.float64),
            "frontier": torch.tensor(self.builder.frontier if hist else [], dtype=torch.int64)}

    def masked_length(self, round_: int) -> int:
        """Secure aggregation: the length of a client's masked input, this level's histograms
        and the weight."""
        return len(self.global_state["frontier"]) * self.global_state["cuts"].numel() * 2 + 1

    def longest_masked(self) -> int:
        """Secure aggregation, deployed: the longest masked input a round can bring (a deepest
        level's histograms and the weight), for the stages' slow-link allowance."""
        return 2 ** (self.params.max_depth - 1) * self.columns * (self.params.max_bin + 1) * 2 + 1

    def model_json(self) -> bytes:
        return json.dumps(self.model).encode()


def update_layout(server) -> dict[str, Any]:
    """What a deployed server accepts from a client: this round's sizes, finite numbers, JSON."""
    agg = server.aggregator
    stage = int(agg.global_state["stage"][0])
    width = 2 * agg.params.max_bin

    def vector(name: str, dtype: torch.dtype, ok) -> Any:
        def check(value, _server) -> str | None:
            if not isinstance(value, torch.Tensor) or value.dtype != dtype or value.dim() != 1:
                return f"trees {name} must be a 1-d {dtype} tensor"
            return ok(value)
        return check

    def sketch(v):
        if stage != SKETCH:
            return None if v.numel() == 0 else "trees sketch is sent in round 1 only"
        if v.numel() % (2 * width) != 1:
            return f"trees sketch must hold 2 x features x {width} + 1 values"
        return None

    def hist(v):
        want = 0 if stage != HISTOGRAM else (len(agg.global_state["frontier"]) * agg.global_state["cuts"].numel() * 2)
        if v.numel() != want:
            return f"trees histograms must be {want} values"
        return None if bool(torch.isfinite(v).all()) else "trees histograms must be finite"

    def trees(v):
        if stage != BOOST:
            return None if v.numel() == 0 else "trees are sent in bagging and cyclic rounds only"
        try:
            got = json.loads(_bytes(v).decode())
        except (UnicodeDecodeError, ValueError):
            return "trees must be a JSON list of XGBoost trees"
        if not isinstance(got, list) or len(got) != agg.cfg["trees.local_rounds"] \
                or not all(isinstance(t, dict) for t in got):
            return f"trees must be a JSON list of {agg.cfg['trees.local_rounds']} XGBoost trees"
        return None

    def finite(v):
        return None if bool(torch.isfinite(v).all()) else "trees sketch must be finite"
    return {"sketch": vector("sketch", torch.float64, lambda v: sketch(v) or finite(v)),
            "hist": vector("hist", torch.float64, hist),
            "trees": vector("trees", torch.uint8, trees)}


TREES = algorithms.register("trees", Algorithm(TreesTrainer, TreesAggregator, update_layout))
