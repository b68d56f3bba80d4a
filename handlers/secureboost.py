"""Vertical SecureBoost (Cheng et al., IEEE Intelligent Systems 2021): `task: trees` with
`data.partition: vertical`. After alignment (handlers/vertical.py) the active party (labels,
Paillier key) grows XGBoost `hist` trees over every party's columns:

  active `sb_key` (n) -> passive `sb_bins` (its features' bin counts)
  per tree: active `sb_gradients` ([[g]], [[h]] of every training row, fixed point)
  per level: active `sb_level` (open nodes, each row's node) -> passive `sb_histograms`
             ([[sum g]], [[sum h]] per open node, own feature, own bin) -> active decrypts,
             picks the best split over all parties -> `sb_splits` (to each passive party only
             its own chosen (node, feature, bin)) -> passive `sb_left` (the node's rows going
             left) -> the next level
  at the end: passive `sb_reveal` (its chosen thresholds, its test rows' directions)

Deployed (`federate.mode: distributed`, fedcore/deployment/vertical_parties.py), the active party
serves and each passive party is a client process running the same handlers; what a passive
party sends is checked on the wire (handlers/secureboost_checks.py) before a handler reads it.

A passive party holds the modulus n, ciphertexts, the rows' node assignment, and which of its
own splits were chosen; it never sees a gradient, a label, another party's split or a leaf.
The active party learns the passive parties' histograms' sums (it chooses splits from them),
the rows each chosen split sends left, and, at the end, the chosen thresholds (so that it can
write the joint booster as `final_model.json`).
"""
from __future__ import annotations

import json
import logging

import numpy as np

from fedcore.algorithms import trees_core as tc
from fedcore.handlers import secureboost_checks  # noqa: F401  (the wire checks of a deployed course)
from fedcore.handlers import vertical as v
from fedcore.kernel.errors import ConfigError, FedcoreError
from fedcore.kernel.files import write_atomic
from fedcore.kernel.registry import components, courses
from fedcore.kernel.scheduler import HandlerError

log = logging.getLogger("fedcore.secureboost")

__all__ = ["install", "PartyMisbehaved"]

ACTIVE = v.ACTIVE


class PartyMisbehaved(FedcoreError, HandlerError):
    """A passive party sent well-formed content the protocol did not ask for (a histogram of the
    wrong size, rows for a node it was not asked to split): the course stops (exit 1) naming it."""


def _pl():
    return components.get("paillier")()


def _width(n: int) -> int:
    return ((n * n).bit_length() + 7) // 8


def _params(cfg) -> tc.Params:
    from fedcore.algorithms.trees import params_of
    return params_of(cfg)


def _own_cuts(x: np.ndarray, max_bin: int) -> list[np.ndarray]:
    """A party's cuts of its own columns over the aligned training rows (XGBoost's for a column
    of at most max_bin distinct values)."""
    values, counts = tc.local_sketch(x, 2 * max_bin)
    return tc.merge_cuts(values[None], counts[None], max_bin)


# ------------------------------------------------------------------ active party
def active_setup(active, _event=None) -> None:
    """`aligned` (active): key pair, own cuts, base score; send the public modulus."""
    cfg = active.course.cfg
    if active.train_rows.y is None:
        raise v.AlignmentRefused("data.label_column: the active party holds no labels")
    x, y = active.train_rows.x.double().numpy(), active.train_rows.y.double().numpy()
    if cfg["trees.objective"] == "binary:logistic" and active.table.num_classes != 2:
        raise v.AlignmentRefused(f"trees.objective: binary:logistic needs 2 classes, the labels have "
                          f"{active.table.num_classes}; use trees.objective=reg:squarederror")
    if cfg["trees.max_bin"] > len(y):
        raise v.AlignmentRefused(f"trees.max_bin: {cfg['trees.max_bin']} bins for {len(y)} aligned training "
                          "rows; set trees.max_bin to at most the number of rows")
    p = _params(cfg)
    base = cfg["trees.base_score"]
    if base is None:
        base = float(y.mean()) if len(y) else 0.5
        if p.objective == "binary:logistic":
            base = min(max(base, 1e-6), 1 - 1e-6)
    active.sb = sb = type("SbActive", (), {})()
    sb.params, sb.base, sb.x, sb.y = p, base, x, y
    sb.cuts = _own_cuts(x, p.max_bin)
    sb.bins = tc.bin_rows(x, sb.cuts)
    sb.public, sb.private = _pl().keypair(cfg["vertical.he.key_bits"])
    sb.n, sb.frac = sb.public.n, cfg["vertical.he.frac_bits"]
    sb.party_bins, sb.pending, sb.trees, sb.hist, sb.tree_nodes = {}, set(), [], {}, []
    sb.asked: dict[int, list[int]] = {}          # the nodes each party was last asked to split
    sb.chosen: dict[int, list[tuple]] = {}       # (tree, node, own feature) of each party's splits
    sb.party_time: dict[int, float] = {}   # when each passive party's last histograms of a tree came in
    sb.margin = np.full(len(y), _margin0(p.objective, base), dtype=np.float32)
    active.aggregator.states = lambda: {}   # final_model.pt: the joint booster's JSON bytes, at the end
    n = sb.n
    active.send("sb_key", active.course.client_ids, {"n": n.to_bytes((n.bit_length() + 7) // 8, "big")})
    sb.pending = set(active.course.client_ids)


def _margin0(objective: str, base: float) -> float:
    return float(np.log(base / (1 - base))) if objective == "binary:logistic" else base


def active_bins(active, msg) -> None:
    """`receiving_sb_bins`: a passive party's bin counts; the first tree once all are in."""
    sb = active.sb
    if msg.sender not in sb.pending or msg.sender in sb.party_bins:
        raise PartyMisbehaved(f"secureboost: party {msg.sender} sent its bin counts unasked; the course stops")
    sb.party_bins[msg.sender] = [int(b) for b in msg.content["bins"].tolist()]
    sb.pending.discard(msg.sender)
    if not sb.pending:
        # the joint feature order: the active party's columns, then each passive party's
        sb.owner = [(ACTIVE, j) for j in range(len(sb.cuts))] + [
            (q, j) for q in sorted(sb.party_bins) for j in range(len(sb.party_bins[q]))]
        placeholders = [np.arange(b, dtype=np.float32) for q in sorted(sb.party_bins) for b in sb.party_bins[q]]
        sb.joint_cuts = list(sb.cuts) + placeholders
        new_tree(active)


def new_tree(active) -> None:
    """Gradients at the current margin, encrypted once for the tree; then the root level."""
    sb, pl = active.sb, _pl()
    g, h = tc.grad_hess(sb.params.objective, sb.margin, sb.y)
    sb.g, sb.h = g, h
    sb.builder = tc.TreeBuilder(sb.params, sb.joint_cuts)
    sb.at = np.zeros(len(sb.y), dtype=np.int64)
    enc = pl.encrypt(sb.public, pl.encode(_t(g), sb.frac, sb.n) + pl.encode(_t(h), sb.frac, sb.n))
    active.send("sb_gradients", active.course.client_ids, {"c": pl.to_bytes(enc, _width(sb.n))},
                round_=len(sb.trees) + 1)
    ask_level(active)


def _i64(a):
    import torch
    return torch.as_tensor(np.asarray(a, dtype=np.int64).reshape(-1))


def _t(a: np.ndarray):
    import torch
    return torch.from_numpy(a.astype(np.float64))


def ask_level(active) -> None:
    sb = active.sb
    sb.pending, sb.hist = set(active.course.client_ids), {}
    active.send("sb_level", active.course.client_ids,
                {"frontier": _i64(sb.builder.frontier), "at": _i64(sb.at)}, round_=len(sb.trees) + 1)


def active_histograms(active, msg) -> None:
    """`receiving_sb_histograms`: decrypt one party's; choose the level's splits once all are in."""
    sb, pl = active.sb, _pl()
    bins, builder = sb.party_bins.get(msg.sender), getattr(sb, "builder", None)
    if bins is None or builder is None or msg.sender not in sb.pending or msg.sender in sb.hist:
        raise PartyMisbehaved(f"secureboost: party {msg.sender} sent histograms unasked; the course stops")
    k, width = len(builder.frontier), max(bins) if bins else 0
    want = k * len(bins) * width * 2
    if len(msg.content["c"]) != want:
        raise PartyMisbehaved(f"secureboost: party {msg.sender} sent {len(msg.content['c'])} histogram "
                              f"entries, not {want}; the course stops")
    try:
        cts = pl.from_bytes(list(msg.content["c"]), sb.n * sb.n)
    except ValueError:
        raise PartyMisbehaved(f"secureboost: party {msg.sender} sent a histogram entry not below n^2; "
                              "the course stops") from None
    plain = pl.decode(pl.decrypt_raw(sb.private, cts), sb.frac, sb.n).numpy()
    sb.hist[msg.sender] = plain.reshape(k, len(bins), width, 2)
    sb.party_time[msg.sender] = active.now
    sb.pending.discard(msg.sender)
    if not sb.pending:
        choose_splits(active)


def choose_splits(active) -> None:
    sb = active.sb
    frontier = list(sb.builder.frontier)
    width = max(len(c) for c in sb.joint_cuts)
    own = tc.histograms(sb.bins, sb.g, sb.h, sb.at, frontier, width)
    parts = [own[:, :len(sb.cuts)]]
    for q in sorted(sb.party_bins):
        hq = sb.hist[q]
        parts.append(np.pad(hq, ((0, 0), (0, 0), (0, width - hq.shape[2]), (0, 0))))
    before = len(sb.builder.nodes)
    sb.builder.grow(np.concatenate(parts, axis=1))
    ask: dict[int, list[list[int]]] = {q: [] for q in sb.party_bins}
    for node_id in frontier:
        node = sb.builder.nodes[node_id]
        if node.feature < 0:
            continue
        q, j = sb.owner[node.feature]
        if q == ACTIVE:
            rows = np.nonzero(sb.at == node_id)[0]
            left = sb.bins[rows, j] <= node.bin
            sb.at[rows] = np.where(left, node.left, node.right)
        else:
            ask[q].append([node_id, j, node.bin])
    sb.splits_pending = {q for q, s in ask.items() if s}
    sb.asked = {q: [node for node, _j, _b in s] for q, s in ask.items() if s}
    for q, s in ask.items():
        sb.chosen.setdefault(q, []).extend((len(sb.trees), node, j) for node, j, _b in s)
    log.debug("secureboost: %d nodes after a level (were %d)", len(sb.builder.nodes), before)
    for q in sorted(sb.splits_pending):
        s = ask[q]
        active.send("sb_splits", q, {"splits": _i64(s).reshape(-1, 3), "tree": _i64([len(sb.trees)])},
                    round_=len(sb.trees) + 1)
    if not sb.splits_pending:
        after_level(active)


def active_left(active, msg) -> None:
    """`receiving_sb_left`: the rows each of a party's chosen splits sends left."""
    sb = active.sb
    if msg.sender not in getattr(sb, "splits_pending", ()) or msg.content["nodes"].tolist() != sb.asked.get(msg.sender):
        raise PartyMisbehaved(f"secureboost: party {msg.sender} answered for nodes {msg.content['nodes'].tolist()}, "
                              f"it was asked for {sb.asked.get(msg.sender, [])}; the course stops")
    for node_id, left in zip(msg.content["nodes"].tolist(), msg.content["left"].numpy()):
        node = sb.builder.nodes[int(node_id)]
        in_node = np.nonzero(sb.at == node_id)[0]
        sb.at[in_node] = np.where(left[in_node], node.left, node.right)
    sb.splits_pending.discard(msg.sender)
    if not sb.splits_pending:
        after_level(active)


def after_level(active) -> None:
    sb = active.sb
    if not sb.builder.done:
        ask_level(active)
        return
    tree = sb.builder.xgboost_tree(len(sb.trees), len(sb.joint_cuts))
    leaf = np.array(tree["split_conditions"], dtype=np.float32)
    sb.margin = (sb.margin + leaf[sb.at]).astype(np.float32)
    sb.trees.append(tree)
    sb.tree_nodes.append([(n.feature, n.bin) for n in sb.builder.nodes])
    g_loss = _train_loss(sb)
    active.course.monitor.record_round(len(sb.trees), active.now, {
        "num_updates": active.course.num_clients, "train_loss": g_loss, "trees_count": float(len(sb.trees)),
        **active.course.party_bytes.take(), **{f"virtual_time_party_{p}": t for p, t in sorted(sb.party_time.items())}})
    if len(sb.trees) < active.course.cfg["trees.num_trees"]:
        new_tree(active)
        return
    sb.pending, sb.reveal = set(active.course.client_ids), {}
    active.send("sb_done", active.course.client_ids, {}, round_=len(sb.trees))


def _train_loss(sb) -> float:
    m = sb.margin.astype(np.float64)
    if sb.params.objective == "reg:squarederror":
        return float(np.mean((m - sb.y) ** 2))
    p = np.clip(1 / (1 + np.exp(-m)), 1e-15, 1 - 1e-15)
    return float(-np.mean(sb.y * np.log(p) + (1 - sb.y) * np.log(1 - p)))


def active_reveal(active, msg) -> None:
    """`receiving_sb_reveal`: a party's chosen thresholds and test directions; at the last, the
    joint booster is written and scored on the aligned test rows."""
    sb = active.sb
    told = [tuple(int(v) for v in row[:3]) for row in msg.content["thresholds"].tolist()]
    if msg.sender not in sb.pending or told != sb.chosen.get(msg.sender, []):
        raise PartyMisbehaved(f"secureboost: party {msg.sender} revealed thresholds for splits {told}, "
                              f"not for its {len(sb.chosen.get(msg.sender, []))} chosen ones; the course stops")
    sb.reveal[msg.sender] = msg.content
    sb.pending.discard(msg.sender)
    if sb.pending:
        return
    offset, joint = {}, len(sb.cuts)
    for q in sorted(sb.party_bins):
        offset[q], joint = joint, joint + len(sb.party_bins[q])
    tx = active.test_rows.x.double().numpy()
    tbins = tc.bin_rows(tx, sb.cuts)
    directions = {}
    for q, content in sb.reveal.items():
        for (t, node, j, thr), rows in zip(content["thresholds"].tolist(), content["test_left"].numpy()):
            tree = sb.trees[int(t)]
            tree["split_conditions"][int(node)] = float(np.float32(thr))
            tree["split_indices"][int(node)] = offset[q] + int(j)
            directions[(int(t), int(node))] = rows
    model = tc.with_trees(tc.template(sb.params.xgboost(sb.base), joint), sb.trees)
    body = json.dumps(model).encode()
    import torch
    active.aggregator.states = lambda: {"booster": torch.from_numpy(np.frombuffer(body, dtype=np.uint8).copy())}
    course = active.course
    if course.outdir is not None:
        write_atomic(course.outdir / "final_model.json", body)
    fields = _test_metrics(sb, tbins, directions, len(tx), active.test_rows.y)
    course.monitor.add_summary("trees", {"trees_mode": "secureboost", "trees_count": len(sb.trees),
                                         "trees_base_score": sb.base, **fields})
    v.finish(active)


def _test_metrics(sb, tbins, directions, n, y) -> dict:
    """SecureBoost's prediction: the active party routes its own nodes, the passive parties'
    directions route theirs."""
    if not n or y is None:
        return {}
    margin = np.full(n, _margin0(sb.params.objective, sb.base), dtype=np.float32)
    for t, tree in enumerate(sb.trees):
        for r in range(n):
            node = 0
            while tree["left_children"][node] >= 0:
                feature, b = sb.tree_nodes[t][node]
                q, j = sb.owner[feature]
                go_left = bool(directions[(t, node)][r]) if q != ACTIVE else tbins[r, j] <= b
                node = tree["left_children"][node] if go_left else tree["right_children"][node]
            margin[r] += np.float32(tree["split_conditions"][node])
    yy = y.double().numpy()
    if sb.params.objective == "reg:squarederror":
        mse = float(np.mean((margin - yy) ** 2))
        return {"test_loss": mse, "test_rmse": mse ** 0.5}
    p = 1 / (1 + np.exp(-margin.astype(np.float64)))
    return {"test_acc": float(np.mean((p > 0.5) == (yy > 0.5)))}


# ------------------------------------------------------------------ passive party
def passive_setup(party, _event=None) -> None:
    """`aligned` (passive): own cuts and bins (kept), wait for the key."""
    cfg = party.course.cfg
    party.sb = sb = type("SbPassive", (), {})()
    sb.x = party.train_rows.x.double().numpy()
    sb.cuts = _own_cuts(sb.x, cfg["trees.max_bin"])
    sb.bins = tc.bin_rows(sb.x, sb.cuts)
    sb.chosen: list[list] = []    # (tree, node, feature, bin): this party's chosen splits


def passive_key(party, msg) -> None:
    """`receiving_sb_key`: the modulus; answer with the bin count of each own feature."""
    n = int.from_bytes(bytes(msg.content["n"]), "big")
    party.sb.key = _pl().PublicKey(n)
    party.send("sb_bins", ACTIVE, {"bins": _i64([len(c) for c in party.sb.cuts])})


def passive_gradients(party, msg) -> None:
    """`receiving_sb_gradients`: the tree's encrypted g and h of every training row."""
    sb = party.sb
    cts = _pl().from_bytes(list(msg.content["c"]), sb.key.nsquare)
    m = len(sb.x)
    if len(cts) != 2 * m:
        raise ConfigError(f"secureboost: {len(cts)} ciphertexts for {m} rows")
    sb.eg, sb.eh = cts[:m], cts[m:]


def passive_level(party, msg) -> None:
    """`receiving_sb_level`: [[sum g]], [[sum h]] per open node, own feature and bin."""
    sb, pl = party.sb, _pl()
    at = msg.content["at"].numpy()
    frontier = [int(f) for f in msg.content["frontier"].tolist()]
    width = max(len(c) for c in sb.cuts)
    import secrets
    one = pow(secrets.randbelow(sb.key.n - 1) + 1, sb.key.n, sb.key.nsquare)   # Enc(0) = r^n: an empty bin
    out = []
    for node in frontier:
        rows = np.nonzero(at == node)[0]
        for j in range(len(sb.cuts)):
            for b in range(width):
                sel = rows[sb.bins[rows, j] == b]
                for enc in (sb.eg, sb.eh):
                    out.append(pl.linear_combination(sb.key, [enc[r] for r in sel], [1] * len(sel))
                               if len(sel) else one)
    party.spend(float(len(out)))
    party.send("sb_histograms", ACTIVE, {"c": pl.to_bytes(out, _width(sb.key.n))}, round_=msg.round)


def passive_splits(party, msg) -> None:
    """`receiving_sb_splits`: this party's chosen splits: the rows of each node going left."""
    import torch
    sb = party.sb
    nodes, lefts = [], []
    for node, j, b in msg.content["splits"].tolist():
        sb.chosen.append([int(msg.content["tree"][0]), node, j, b])
        nodes.append(node)
        lefts.append(sb.bins[:, j] <= b)
    left = np.stack(lefts) if lefts else np.zeros((0, len(sb.x)), dtype=bool)
    party.send("sb_left", ACTIVE, {"nodes": _i64(nodes), "left": torch.from_numpy(left)}, round_=msg.round)


def passive_done(party, _msg) -> None:
    """`receiving_sb_done`: reveal the chosen thresholds and the test rows' directions."""
    sb = party.sb
    tx = party.test_rows.x.double().numpy()
    tbins = tc.bin_rows(tx, sb.cuts)
    import torch
    thresholds = np.array([[t, node, j, float(sb.cuts[j][b])] for t, node, j, b in sb.chosen],
                          dtype=np.float64).reshape(-1, 4)
    test_left = np.array([tbins[:, j] <= b for _t, _node, j, b in sb.chosen], dtype=bool).reshape(-1, len(tx))
    party.send("sb_reveal", ACTIVE, {"thresholds": torch.from_numpy(thresholds),
                                     "test_left": torch.from_numpy(test_left)})


@courses.register("trees_secureboost")
def install(course) -> None:
    v.install_alignment(course)
    s, c = course.server_table, course.client_table
    s.register("aligned", active_setup, sends=("sb_key",))
    c.register("aligned", passive_setup)
    c.register("receiving_sb_key", passive_key, sends=("sb_bins",))
    s.register("receiving_sb_bins", active_bins, sends=("sb_gradients", "sb_level"))
    c.register("receiving_sb_gradients", passive_gradients)
    c.register("receiving_sb_level", passive_level, sends=("sb_histograms",))
    s.register("receiving_sb_histograms", active_histograms, sends=("sb_splits", "sb_level", "sb_gradients",
                                                                     "sb_done"))
    c.register("receiving_sb_splits", passive_splits, sends=("sb_left",))
    s.register("receiving_sb_left", active_left, sends=("sb_level", "sb_gradients", "sb_done"))
    c.register("receiving_sb_done", passive_done, sends=("sb_reveal",))
    s.register("receiving_sb_reveal", active_reveal, sends=("finish",))

