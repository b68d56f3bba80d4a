"""Secure aggregation (SecAgg+): the unmasked sum is the plain weighted sum within the
quantization bound, dropouts after sharing are recovered, too few survivors skip the round,
a masked input is uniform over the field, and no plain update reaches the server."""
import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.conftest import need_extra

need_extra("secagg")

from fedcore.algorithms.secagg_crypto import (field_add, new_private_key, prg_field, public_bytes,
                                              quantize)
from fedcore.algorithms.secagg_settings import MERSENNE_61, neighbour_graph
from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError, NothingAggregated
from fedcore.handlers import secagg_client
from fedcore.kernel.message import SERVER_ID, Message
from fedcore.kernel.shamir import combine, split
from tests.conftest import small_cfg

SECURE = {"secure_aggregation__enabled": True, "model__dtype": "float64", "eval__clients": False}


def _bound(cfg) -> float:
    return cfg["secure_aggregation.clip"] / ((1 << cfg["secure_aggregation.bits"]) - 1)


class Spy:
    """Records each client's trained update and the global model around each aggregation."""

    def __init__(self, course):
        self.fits, self.rounds = {}, {}
        fit, agg = course.trainer.fit, course.server.aggregator
        aggregate = agg.aggregate

        def spy_fit(cid, data, received, round_):
            result = fit(cid, data, received, round_)
            self.fits[(round_, cid)] = (received["model"], result.content)
            return result

        def spy_aggregate(updates, round_):
            before = dict(agg.global_state)
            out = aggregate(updates, round_)
            self.rounds[round_] = (before, dict(agg.global_state))
            return out
        course.trainer.fit, agg.aggregate = spy_fit, spy_aggregate

    def expected_delta(self, round_, clients, weigh=True):
        """sum_k n_k (w_k - w) / sum_k n_k over `clients`, float64, per entry."""
        total, weight = None, 0.0
        for c in clients:
            received, content = self.fits[(round_, c)]
            n = float(content["num_samples"]) if weigh else 1.0
            d = {k: (content["model"][k] - received[k]).double() * n for k in received}
            total = d if total is None else {k: total[k] + d[k] for k in d}
            weight += n
        return {k: v / weight for k, v in total.items()}

    def actual_delta(self, round_):
        before, after = self.rounds[round_]
        return {k: (after[k] - before[k]).double() for k in before}


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ---------------------------------------------------------------- building blocks
def test_shamir_any_threshold_shares_rebuild_the_secret_fewer_do_not():
    secret = bytes(range(32))
    shares, _ = split(secret, [2, 3, 5, 7, 11], threshold=3)
    for pick in ([2, 3, 5], [3, 7, 11], [2, 5, 11, 7]):
        assert combine({x: shares[x] for x in pick}, 3, 32) == secret
    with pytest.raises(ValueError, match="2 share"):
        combine({x: shares[x] for x in (2, 3)}, 3, 32)
    # two shares of a degree-2 polynomial fit a line through any secret: interpolating them as if
    # the threshold were 2 gives something else (or nothing of the right length)
    try:
        assert combine({x: shares[x] for x in (2, 3)}, 2, 32) != secret
    except ValueError:
        pass


def test_neighbour_graph_is_symmetric_and_k_regular():
    ids = list(range(1, 12))
    g = neighbour_graph(ids, 4, seed=3, round_=2)
    assert all(len(g[u]) == 4 and u not in g[u] for u in ids)
    assert all(u in g[v] for u in ids for v in g[u])
    full = neighbour_graph(ids, 0, seed=3, round_=2)
    assert all(len(full[u]) == 10 for u in ids)


def test_quantization_error_is_within_half_a_step():
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, 1000)
    q = quantize(x, 1.0, 8)
    back = q.astype(np.float64) * (2 / 255) - 1
    assert np.abs(back - x).max() <= 1 / 255 + 1e-15


def _masked_input(seed: int, vector: np.ndarray) -> np.ndarray:
    """What the client's `mask_input` sends for `vector`, with fixed secrets from `seed`."""
    rng = np.random.default_rng(seed)
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    keys = [X25519PrivateKey.from_private_bytes(rng.bytes(32)) for _ in range(3)]
    st = secagg_client.ClientRound(1, vector.copy(), keys[0], keys[1], threshold=1,
                                   neighbours={2: (b"", public_bytes(keys[2]))}, seed=rng.bytes(32))
    st.partners = {2}  # one neighbour that shared: one pairwise mask
    st.held = {2: (1, 1)}   # ... whose shares passed their checks (t = 1)
    sent = []
    cfg = small_cfg(None, **SECURE)
    client = SimpleNamespace(id=1, course=SimpleNamespace(cfg=cfg), secagg=st,
                             send=lambda t, r, content, round_: sent.append(content))
    secagg_client.mask_input(client, Message("secagg_routed_shares", 0, 1, 1, 0.0,
                                              {"from": [], "ciphertexts": [], "signatures": [],
                                               "commitments": []}))
    return sent[0]["masked"].numpy().astype(np.uint64)


def test_a_masked_input_is_uniform_over_the_field_and_unlike_the_plain_one():
    p = MERSENNE_61
    plain = quantize(np.linspace(-0.5, 0.5, 16), 1.0, 16)    # a structured plain input
    plain = np.append(plain * np.uint64(30) % np.uint64(p), np.uint64(30))
    draws = np.concatenate([_masked_input(seed, plain) for seed in range(1500)])
    assert draws.max() < p
    assert np.mean(draws == np.tile(plain, 1500)) < 1e-3
    # chi-square of the top bits and of the low bits against 16 equal cells (df 15: 37.70 at 0.001)
    for cells in ((draws.astype(np.float64) / p * 16).astype(int), (draws % np.uint64(16)).astype(int)):
        counts = np.bincount(cells, minlength=16)
        expected = draws.size / 16
        chi2 = ((counts - expected) ** 2 / expected).sum()
        assert chi2 < 37.70, chi2
    # and each coordinate alone: its 1500 draws are spread over the field like any other's
    per_coord = (draws.reshape(1500, -1).astype(np.float64) / p).mean(axis=0)
    assert np.all(np.abs(per_coord - 0.5) < 4 * np.sqrt(1 / 12 / 1500))


def test_prg_is_deterministic_and_within_the_field():
    a = prg_field(b"k" * 32, 1000, 97)
    assert np.array_equal(a, prg_field(b"k" * 32, 1000, 97)) and a.max() < 97 and a.min() >= 0
    assert not np.array_equal(a, prg_field(b"j" * 32, 1000, 97))
    assert np.array_equal(field_add(a, (97 - a) % 97, 97), np.zeros(1000, dtype=np.uint64))


# ---------------------------------------------------------------- whole courses
@pytest.mark.parametrize("bits, modulus", [(8, MERSENNE_61), (20, MERSENNE_61), (12, 1_000_000_007)])
def test_unmasked_sum_equals_the_plain_weighted_sum_within_the_quantization_bound(bits, modulus):
    cfg = small_cfg(None, secure_aggregation__bits=bits, secure_aggregation__modulus=modulus,
                    secure_aggregation__num_neighbours=2, federate__total_round_num=2, **SECURE)
    course = Course(cfg).build()
    spy = Spy(course)
    course.run()
    for r in (1, 2):
        diff = _max_diff(spy.actual_delta(r), spy.expected_delta(r, range(1, 7)))
        assert diff <= _bound(cfg) + 1e-12
    if bits == 20:  # the bound is what it says: the error shrinks with the levels
        assert diff < 1e-5


def test_a_secure_course_costs_messages_bytes_and_virtual_time():
    plain = Course(small_cfg(None, model__dtype="float64", eval__clients=False))
    plain_summary = plain.run()
    secure = Course(small_cfg(None, **SECURE))
    secure_summary = secure.run()
    rec = secure.monitor.records[0]
    # nine protocol messages per client (keys, neighbour keys, shares both ways, masked input,
    # survivor set and its signature, unmask request and reply) besides the model broadcast
    assert rec["secagg_messages"] == 6 * 9 and rec["secagg_survivors"] == 6
    assert rec["bytes_up"] > plain.monitor.records[0]["bytes_up"]
    assert secure_summary["virtual_time"] > plain_summary["virtual_time"]
    assert abs(secure_summary["final_test_acc"] - plain_summary["final_test_acc"]) < 0.2


def _dropout_trace(tmp_path, dropped, n=8):
    trace = tmp_path / "devices.json"
    trace.write_text(json.dumps([{"client_id": c, "dropout": 1.0 if c in dropped else 0.0}
                                 for c in range(1, n + 1)]))
    return {"type": "trace", "path": str(trace), "assign": "cycle"}


@pytest.mark.parametrize("graph", [{}, {"secure_aggregation__num_neighbours": 4,
                                        "secure_aggregation__threshold": 2}], ids=["full", "k4"])
def test_clients_dropped_after_sharing_are_recovered_from_the_survivors_shares(tmp_path, graph):
    cfg = small_cfg(None, federate__client_num=8, time__profiles=_dropout_trace(tmp_path, {3, 6}),
                    **graph, **SECURE)
    course = Course(cfg).build()
    spy = Spy(course)
    summary = course.run()
    assert summary["rounds"] == 2
    for r, rec in ((1, course.monitor.records[0]), (2, course.monitor.records[1])):
        assert rec["secagg_dropped"] == 2 and rec["num_updates"] == 6
        survivors = [c for c in range(1, 9) if c not in (3, 6)]
        diff = _max_diff(spy.actual_delta(r), spy.expected_delta(r, survivors))
        assert diff <= _bound(cfg) + 1e-12


def test_fewer_survivors_than_the_threshold_skip_the_round(tmp_path, caplog):
    cfg = small_cfg(tmp_path / "out", federate__client_num=6, time__profiles=_dropout_trace(tmp_path, {1, 2, 3, 4}, 6),
                    secure_aggregation__threshold=3, **SECURE)
    course = Course(cfg).build()
    before = {k: v.clone() for k, v in course.server.aggregator.global_state.items()}
    with caplog.at_level(logging.WARNING, logger="fedcore.secagg"), \
            pytest.raises(NothingAggregated, match="no round of the course could be aggregated") as stop:
        course.run()
    assert stop.value.exit_code == 6    # a course that learnt nothing does not exit 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["secagg_skipped_rounds"] == [1, 2]
    assert all(r["secagg_skipped"] == 1 and r["num_updates"] == 0 for r in course.monitor.records)
    assert _max_diff(course.server.aggregator.global_state, before) == 0
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 2 and "2 client(s) sent masked inputs, 3 needed" in lines[0]


def test_no_plain_update_ever_reaches_the_server():
    cfg = small_cfg(None, **SECURE)
    course = Course(cfg).build()
    spy = Spy(course)
    to_server = []
    course.comm.filters.append(lambda msg, receiver: to_server.append(msg) or True
                               if receiver == SERVER_ID else True)
    course.run()
    types = {m.msg_type for m in to_server}
    assert "updates" not in types and "secagg_masked_input" in types

    def tensors(obj):
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from tensors(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                yield from tensors(v)
    sent = [t for m in to_server for t in tensors(m.content)]
    assert sent and all(t.dtype == torch.int64 for t in sent)    # no model entry, no float
    for m in to_server:
        if m.msg_type != "secagg_masked_input":
            continue
        received, content = spy.fits[(m.round, m.sender)]
        delta = np.concatenate([(content["model"][k] - received[k]).double().reshape(-1).numpy()
                                for k in sorted(received)])
        plain = np.append(quantize(delta, 1.0, 16) * np.uint64(content["num_samples"]),
                          np.uint64(content["num_samples"]))
        assert np.mean(m.content["masked"].numpy().astype(np.uint64) == plain) < 0.05


# ---------------------------------------------------------------- composition
@pytest.mark.parametrize("extra", [
    {"algorithm__name": "fedprox"},
    {"privacy__dp__mode": "central", "privacy__dp__noise_multiplier": 0.5, "privacy__dp__clip_norm": 0.5},
    {"privacy__dp__mode": "local", "privacy__dp__noise_multiplier": 0.5, "privacy__dp__clip_norm": 0.5},
    # a server optimizer steps on the unmasked sum (a linear step: lr 0.5 scales the error too)
    {"server_optimizer__type": "sgdm", "server_optimizer__lr": 0.5, "server_optimizer__momentum": 0.9},
    # each client weighs 1 in the masked sum, on clients of unequal sizes (54 to 197 samples)
    {"server_optimizer__type": "sgdm", "server_optimizer__lr": 0.5, "server_optimizer__momentum": 0.9,
     "aggregator__weighting": "uniform", "data__synthetic__samples_per_client": None,
     "data__synthetic__max_samples": 1000},
], ids=["fedprox", "central_dp", "local_dp", "server_optimizer", "uniform_weighting"])
def test_secure_equals_plain_for_weighted_sum_algorithms_and_dp(extra):
    common = dict(model__dtype="float64", eval__clients=False, federate__total_round_num=1)
    common.update(extra)
    plain = Course(small_cfg(None, **common))
    plain.run()
    secure_cfg = small_cfg(None, secure_aggregation__enabled=True, **common)
    secure = Course(secure_cfg)
    secure.run()
    diff = _max_diff(plain.server.aggregator.global_state, secure.server.aggregator.global_state)
    assert diff <= _bound(secure_cfg) + 1e-12
    if "server_optimizer__type" in extra:
        assert secure.monitor.records[0]["server_update_norm"] == pytest.approx(
            0.5 * secure.monitor.records[0]["server_pseudo_grad_norm"])
    if "privacy__dp__mode" in extra:
        assert secure.monitor.records[0]["dp_epsilon"] == pytest.approx(plain.monitor.records[0]["dp_epsilon"])


@pytest.mark.parametrize("extra, uniform", [
    ({"algorithm__name": "fedmos", "algorithm__fedmos__server_momentum": 0.5}, False),
    ({"algorithm__name": "diloco", "train__local_steps": 3, "train__preserve_optimizer_state": True}, True),
], ids=["fedmos", "diloco"])
def test_server_rules_after_the_mean_receive_the_unmasked_mean(extra, uniform):
    """Server momentum and DiLoCo's outer optimizer act on what they receive: one update whose
    delta is the clients' (sample- or uniformly-) weighted mean delta, within the bound."""
    cfg = small_cfg(None, federate__total_round_num=2, **SECURE, **extra)
    course = Course(cfg).build()
    spy = Spy(course)
    received = {}
    agg = course.server.aggregator
    aggregate = agg.aggregate

    def seen(updates, round_):
        (one,) = updates
        received[round_] = {k: (one.content["model"][k] - agg.global_state[k]).double()
                            for k in one.content["model"]}
        return aggregate(updates, round_)
    agg.aggregate = seen
    course.run()
    for r in (1, 2):
        assert _max_diff(received[r], spy.expected_delta(r, range(1, 7), weigh=not uniform)) \
            <= _bound(cfg) + 1e-12
    # and the rule did act after the mean: the global step differs from the mean in round 2
    assert _max_diff(spy.actual_delta(2), received[2]) > 1e-3


@pytest.mark.parametrize("override, needle", [
    ({"aggregator__robust_rule": "median"}, "aggregator.robust_rule: robust rules need each update"),
    ({"algorithm__name": "scaffold"}, "algorithm.name: scaffold cannot be aggregated securely"),
    ({"asyn__use": True}, "asyn.use: secure aggregation needs synchronous rounds"),
    ({"attack__type": "sign_flip", "attack__fraction": 0.25}, "attack.type: simulated attackers send plain updates"),
    ({"secure_aggregation__modulus": 2 ** 61}, "is not prime"),
    ({"secure_aggregation__threshold": 9}, "secure_aggregation.threshold: 9 exceeds the 5 neighbour(s)"),
])
def test_what_cannot_be_combined_is_refused_with_one_line(override, needle):
    with pytest.raises(ConfigError) as err:
        small_cfg(None, secure_aggregation__enabled=True, **override)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_the_completeness_checker_draws_the_protocol(tmp_path):
    course = Course(small_cfg(tmp_path, **SECURE)).build()
    course.write_header()
    graph = course.check().graph
    for a, b in [("server:all_joined_in", "client:receiving_models"),
                 ("client:receiving_models", "server:receiving_secagg_public_keys"),
                 ("server:receiving_secagg_public_keys", "server:secagg_keys_collected"),
                 ("server:secagg_keys_collected", "client:receiving_secagg_neighbour_keys"),
                 ("client:receiving_secagg_neighbour_keys", "server:receiving_secagg_encrypted_shares"),
                 ("server:secagg_shares_collected", "client:receiving_secagg_routed_shares"),
                 ("client:receiving_secagg_routed_shares", "server:receiving_secagg_masked_input"),
                 ("server:secagg_inputs_collected", "client:receiving_secagg_consistency_check"),
                 ("client:receiving_secagg_consistency_check", "server:receiving_secagg_survivor_signature"),
                 ("server:receiving_secagg_survivor_signature", "server:secagg_signatures_collected"),
                 ("server:secagg_signatures_collected", "client:receiving_secagg_unmask_request"),
                 ("client:receiving_secagg_unmask_request", "server:receiving_secagg_abort"),
                 ("client:receiving_secagg_unmask_request", "server:receiving_secagg_unmask_shares"),
                 ("server:secagg_shares_revealed", "server:max_rounds_reached")]:
        assert graph.has_edge(a, b), (a, b)
    handlers = (tmp_path / "handlers.txt").read_text()
    assert "receiving_secagg_masked_input -> fedcore.handlers.secure_aggregation.collect_masked_input" in handlers
    assert "secure_aggregation" in handlers.split("[behaviours]")[1]


def test_a_deployed_server_refuses_malformed_protocol_messages():
    from fedcore.comm.validation import check_content
    course = Course(small_cfg(None, **SECURE)).build()
    server = course.server
    length = sum(t.numel() for t in server.aggregator.broadcast(1)["model"].values()) + 1
    good = {"masked": torch.zeros(length, dtype=torch.int64), "bad_shares": []}
    assert check_content("secagg_masked_input", good, server) is None
    bad = [("secagg_masked_input", {**good, "masked": torch.zeros(length, dtype=torch.float32)}, "int64 tensor"),
           ("secagg_masked_input", {**good, "masked": torch.full((length,), -1, dtype=torch.int64)}, "in the field"),
           ("secagg_masked_input", {**good, "masked": torch.zeros(length - 1, dtype=torch.int64)}, "int64 tensor"),
           ("secagg_masked_input", {**good, "bad_shares": [0]}, "bad_shares: [client ids]"),
           ("secagg_public_keys", {"cipher_key": b"x" * 31, "mask_key": b"y" * 32}, "32 bytes each"),
           ("secagg_encrypted_shares", {"to": [1, 99], "ciphertexts": [b"c" * 100] * 2, "signatures": [b"s" * 64] * 2,
                                        "commitments": b"c" * 512}, "client ids"),
           ("secagg_encrypted_shares", {"to": [1], "ciphertexts": [b"c" * 100], "signatures": [b"s" * 64],
                                        "commitments": b"c" * 500}, "256 bytes each"),
           ("secagg_survivor_signature", {"signature": b"s" * 63}, "64 bytes"),
           ("secagg_unmask_shares", {"seed_ids": [2], "seed_shares": [b"s" * 31], "key_ids": [], "key_shares": [],
                                     "pair_ids": [], "pair_keys": []}, "32 bytes each")]
    for msg_type, content, needle in bad:
        problem = check_content(msg_type, content, server)
        assert problem is not None and needle in problem, (msg_type, problem)


def test_a_field_too_small_for_the_sum_stops_the_course_with_the_fix():
    from fedcore.kernel.scheduler import HandlerError
    course = Course(small_cfg(None, secure_aggregation__modulus=1_000_003, **SECURE))
    with pytest.raises(HandlerError, match="may overflow the field; lower secure_aggregation.bits"):
        course.run()


# ---------------------------------------------------------------- verifiable shares and identities
def test_feldman_commitments_live_in_a_prime_order_group_and_catch_a_bad_share():
    from fedcore.kernel.shamir import GENERATOR, GROUP_P, PRIME, commit, g_pow, random_secret, verify_share
    isprime = pytest.importorskip("sympy").isprime     # an independent primality test (torch needs sympy)
    assert PRIME.bit_length() == 256 and GROUP_P.bit_length() == 2048
    assert isprime(PRIME) and isprime(GROUP_P) and (GROUP_P - 1) % PRIME == 0
    assert GENERATOR != 1 and pow(GENERATOR, PRIME, GROUP_P) == 1      # g generates the order-q subgroup
    rng = np.random.default_rng(7)
    for e in [0, 1, 255, 256, PRIME - 1] + [int.from_bytes(rng.bytes(32), "big") % PRIME for _ in range(20)]:
        assert g_pow(e) == pow(GENERATOR, e, GROUP_P)                  # the table against plain pow
    secret = random_secret()
    shares, commitments = split(secret, [1, 2, 4, 5], threshold=3)
    assert commitments[0] == commit(secret) and len(commitments) == 3
    assert all(verify_share(x, y, commitments) for x, y in shares.items())
    assert not verify_share(2, (shares[2] + 1) % (PRIME), commitments)     # off by one
    assert not verify_share(3, shares[2], commitments)                     # another holder's share
    assert combine({x: shares[x] for x in (1, 4, 5)}, 3, 32) == secret


def test_roster_keys_sign_for_their_client_only(tmp_path):
    import os
    import stat
    from fedcore.algorithms.secagg_identity import (keys_statement, load_roster, load_signing_key, main, sign,
                                                    verify)
    assert main(["--out", str(tmp_path), "--clients", "3"]) == 0
    roster = load_roster(tmp_path / "secagg_roster.json")
    key2 = load_signing_key(tmp_path / "secagg_client_2.key")
    assert stat.S_IMODE(os.stat(tmp_path / "secagg_client_2.key").st_mode) == 0o600
    statement = keys_statement(1, 2, b"c" * 32, b"m" * 32, 30)
    assert verify(roster, 2, statement, sign(key2, statement))
    assert not verify(roster, 3, statement, sign(key2, statement))          # not client 3's key
    assert not verify(roster, 2, keys_statement(2, 2, b"c" * 32, b"m" * 32, 30), sign(key2, statement))
    assert not verify(roster, 2, keys_statement(1, 2, b"c" * 32, b"m" * 32, 31), sign(key2, statement))


def test_a_deployed_secure_course_without_a_roster_is_refused():
    common = dict(distribute__token="t", distribute__insecure=True, **SECURE)
    with pytest.raises(ConfigError) as err:
        small_cfg(None, distribute__role="server", **common)
    assert "secure_aggregation.roster: a deployed secure course needs the operator's roster" in str(err.value)
    with pytest.raises(ConfigError, match="secure_aggregation.signing_key: a deployed secure client needs"):
        small_cfg(None, distribute__role="client", secure_aggregation__roster="r.json", **common)
