"""Adversaries against secure aggregation, each the project's own server or client with one
stage changed. Loaded by tests through `plugins: [tests.secagg_adversary_plugin]`, in
simulation and in deployed processes alike.

`secagg_test.adversary` picks the change; `secagg_test.bad_client` is the client that
misbehaves (client adversaries). Server adversaries replace the consistency and unmask
stages so that different clients are shown different survivor sets:
- `pairs_server`: pairs of survivors (each of clients 2..n told "only you and client 1
  survived", client 1 told "1 and 2");
- `split_server`: two survivor sets of three that overlap in the victim, each consistent;
- `padded_server`: every client told the victim and itself survived, padded with ids that
  are no neighbours (clients not in the round);
- `overlap_server`: one consistent, signed survivor set, but the unmask request also lists a
  survivor as dropped (asking for its seed share and its mask-key share at once);
- `withholding_server`: routes every share honestly except those meant for the victim (the
  lowest id), which gets none: masked by its self mask alone, its input would be open to the
  seed shares the others reveal.
Client adversaries: `garbage_shares` (random ciphertexts, signed), `omit_share` (its
last neighbour gets no share; the rest honest), `false_report` (reports its lowest neighbour's
good share as bad, every round), `one_bad_share` (one
holder's share off by one, properly encrypted and signed), `false_weight` (declares 10^6),
`replay` (resends its round-1 masked input), `replay_keys` (advertises its round-1 public
keys again, signed for the new round), `withhold` (never answers the unmask request),
`withhold_input` (never sends its masked input, after sharing),
`out_of_range` (+1000 on the first coordinate of its delta, past the clip, in round 1),
`out_of_range_weight` (a weight 10^6 above the one it declared, inside its masked input, round 1),
`garbage_input` (a masked input of random field elements, every round), `false_reveal` (every
seed share it reveals off by one), `other_key_then_drop` (shares a mask key other than the one
it advertised, then vanishes before sending its masked input). A client adversary misbehaves in
every round, or only in those `secagg_test.bad_rounds` lists (honest in the others).
Inside the sum's bound: `sum_top` / `sum_bottom` (in round 1 it encodes, in place of its own
input, whatever puts every coordinate of the round's unmasked sum at the top W * (2^bits - 1)
/ at 0 of what the server accepts, i.e. every coordinate of the mean at +c / -c, its weight
entry kept), `sum_above_top` / `sum_below_bottom` (the same, with coordinate 0 one step past:
W * (2^bits - 1) + 1, and -1 mod p), `sum_ball` (under central DP: the mean at
privacy.dp.clip_norm C on coordinate 0 and 0 elsewhere, to a level). To hit the sum exactly it reads the other clients' inputs
(an observer records each client's encoded input, changing nothing): the worst case of an
attacker that knows or guesses them, e.g. from earlier rounds' means.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from fedcore.kernel.config import declare
from fedcore.handlers import secagg_client, secure_aggregation as secagg
from fedcore.handlers.secagg_blame import SecaggServer
from fedcore.kernel.registry import behaviours
from fedcore.kernel.shamir import random_secret

SERVERS = ("pairs_server", "split_server", "padded_server", "overlap_server", "withholding_server")
CLIENTS = ("garbage_shares", "omit_share", "false_report", "one_bad_share", "false_weight", "replay", "replay_keys", "withhold",
           "withhold_input", "out_of_range", "out_of_range_weight", "garbage_input", "false_reveal",
           "other_key_then_drop", "sum_top", "sum_above_top", "sum_bottom", "sum_below_bottom", "sum_ball")
declare("secagg_test.adversary", str, "none", "tests: the secure-aggregation adversary",
        choices=("none",) + SERVERS + CLIENTS)
declare("secagg_test.bad_client", int, 0, "tests: the misbehaving client")
declare("secagg_test.bad_rounds", list, None, "tests: the rounds it misbehaves in (default: every round)")


def _sign(client, statement):
    from fedcore.algorithms.secagg_identity import course_identity, sign
    return sign(course_identity(client.course).signing_key(client.id), statement)


class _Intercept:
    """client.send with the content of one message type rewritten."""

    def __init__(self, client, msg_type, rewrite):
        self.client, self.msg_type, self.rewrite, self.send = client, msg_type, rewrite, client.send

    def __enter__(self):
        def send(msg_type, receiver, content, round_=None, **kw):
            if msg_type == self.msg_type:
                content = self.rewrite(content, round_)
            return self.send(msg_type, receiver, content, round_=round_, **kw)
        self.client.send = send

    def __exit__(self, *exc):
        self.client.send = self.send


def _garbage(client, content, round_):
    from fedcore.algorithms.secagg_identity import shares_statement
    cts = [os.urandom(len(ct)) for ct in content["ciphertexts"]]
    sigs = [_sign(client, shares_statement(round_, client.id, v, ct, content["commitments"]))
            for v, ct in zip(content["to"], cts)]
    return {**content, "ciphertexts": cts, "signatures": sigs}


def _false_weight(client, content, round_):
    from fedcore.algorithms.secagg_identity import keys_statement
    weight = 10 ** 6
    sig = _sign(client, keys_statement(round_, client.id, content["cipher_key"], content["mask_key"], weight))
    return {**content, "weight": weight, "signature": sig}


def _rewriting(msg_type, rewrite):
    """The stage as the project runs it, with what it sends as `msg_type` rewritten."""
    def bad(orig, client, msg):
        with _Intercept(client, msg_type, lambda content, round_: rewrite(client, content, round_)):
            orig(client, msg)
    return bad


def _replayed_keys(client, content, round_):
    from fedcore.algorithms.secagg_identity import keys_statement
    first = getattr(client, "first_keys", None)
    if first is None:
        client.first_keys = content
        return content
    ck, mk = first["cipher_key"], first["mask_key"]
    return {**content, "cipher_key": ck, "mask_key": mk,
            "signature": _sign(client, keys_statement(round_, client.id, ck, mk, content["weight"]))}


def _client_stage(kind):
    """(event, the bad client's version of its handler given the original)."""
    if kind == "garbage_shares":
        return "receiving_secagg_neighbour_keys", _rewriting("secagg_encrypted_shares", _garbage)
    if kind == "omit_share":
        def omit(client, content, round_):
            return {**content, **{k: content[k][:-1] for k in ("to", "ciphertexts", "signatures")}}
        return "receiving_secagg_neighbour_keys", _rewriting("secagg_encrypted_shares", omit)
    if kind == "false_report":
        def report(client, content, round_):
            return {**content, "bad_shares": [min(client.secagg.neighbours)]}
        return "receiving_secagg_routed_shares", _rewriting("secagg_masked_input", report)
    if kind == "one_bad_share":
        def bad(orig, client, msg):
            split = secagg_client.split

            def off_by_one(secret, holders, threshold):
                shares, commitments = split(secret, holders, threshold)
                shares[min(holders)] += 1
                return shares, commitments
            secagg_client.split = off_by_one
            try:
                orig(client, msg)
            finally:
                secagg_client.split = split
        return "receiving_secagg_neighbour_keys", bad
    if kind == "false_weight":
        return "receiving_models", _rewriting("secagg_public_keys", _false_weight)
    if kind == "replay_keys":
        return "receiving_models", _rewriting("secagg_public_keys", _replayed_keys)
    if kind == "replay":
        def bad(orig, client, msg):
            kept = getattr(client, "replayed", None)

            def rewrite(content, round_):
                if kept is None:
                    client.replayed = content["masked"].clone()
                    return content
                return {**content, "masked": kept.clone()}
            with _Intercept(client, "secagg_masked_input", rewrite):
                orig(client, msg)
        return "receiving_secagg_routed_shares", bad
    if kind == "garbage_input":
        def garbage(client, content, round_):
            p = secagg_client._settings(client).modulus
            draw = np.random.default_rng(round_).integers(0, p, content["masked"].numel(), dtype=np.int64)
            return {**content, "masked": torch.from_numpy(draw)}
        return "receiving_secagg_routed_shares", _rewriting("secagg_masked_input", garbage)
    if kind == "other_key_then_drop":
        def bad(orig, client, msg):
            from fedcore.algorithms import secagg_crypto
            real = secagg_crypto.private_bytes
            secagg_crypto.private_bytes = lambda key: random_secret()
            try:
                orig(client, msg)
            finally:
                secagg_crypto.private_bytes = real
            client.secagg.seed = b""          # and it never masks: a dropout after sharing
        return "receiving_secagg_neighbour_keys", bad
    if kind == "false_reveal":
        def off_by_one(client, content, round_):
            from fedcore.kernel.shamir import PRIME, share_from_bytes, share_to_bytes
            bad = [share_to_bytes((share_from_bytes(b) + 1) % PRIME) for b in content["seed_shares"]]
            return {**content, "seed_shares": bad}
        return "receiving_secagg_unmask_request", _rewriting("secagg_unmask_shares", off_by_one)
    if kind == "withhold":
        return "receiving_secagg_unmask_request", lambda orig, client, msg: None
    if kind == "withhold_input":
        return "receiving_secagg_routed_shares", lambda orig, client, msg: None
    if kind in ("out_of_range", "out_of_range_weight"):
        def bad(orig, client, msg):
            st, s = client.secagg, secagg_client._settings(client)
            if msg.round == 1 and st is not None and st.vector is not None:
                step = 1000 / (2 * s.clip) * ((1 << s.bits) - 1) * st.weight   # +1000 in the delta
                at, step = (0, step) if kind == "out_of_range" else (-1, 10 ** 6)
                st.vector[at] = np.uint64((int(st.vector[at]) + int(step)) % s.modulus)
            orig(client, msg)
        return "receiving_secagg_routed_shares", bad
    if kind in SUM_TARGETS:
        return "receiving_secagg_routed_shares", _sum_target(kind)
    raise ValueError(kind)


SUM_TARGETS = ("sum_top", "sum_above_top", "sum_bottom", "sum_below_bottom", "sum_ball")


def _record_input(orig, client, msg):
    """Every client's stage 0 as the project runs it; its encoded input is kept for the test."""
    orig(client, msg)
    st = getattr(client, "secagg", None)
    if st is not None and st.round == msg.round and st.vector is not None:
        client.course.secagg_test_inputs.setdefault(msg.round, {})[client.id] = st.vector.copy()


def _sum_target(kind):
    """Encode, in round 1, the input that puts the unmasked sum where `kind` says (the docstring)."""
    def bad(orig, client, msg):
        st, s = client.secagg, secagg_client._settings(client)
        if msg.round == 1 and st is not None and st.vector is not None:
            p, levels = s.modulus, (1 << s.bits) - 1
            inputs = client.course.secagg_test_inputs[msg.round]
            total = np.zeros(st.vector.size, dtype=object)
            for vec in inputs.values():
                total += vec.astype(object)
            client.secagg_test_honest = total.copy()     # the round's sum had it been honest
            weight = int(total[-1])
            target = np.full(st.vector.size - 1, weight * levels if kind in ("sum_top", "sum_above_top") else 0,
                             dtype=object)
            if kind == "sum_ball":    # mean_j = T_j 2c / (levels W) - c, so T_j = (mean_j + c) levels W / 2c
                mean = np.zeros(st.vector.size - 1)
                mean[0] = client.course.cfg["privacy.dp.clip_norm"]
                target = np.array([round((m + s.clip) * levels * weight / (2 * s.clip)) for m in mean], dtype=object)
            if kind == "sum_above_top":
                target[0] += 1
            elif kind == "sum_below_bottom":
                target[0] = p - 1          # -1 in the field
            others = total[:-1] - st.vector[:-1].astype(object)
            st.vector[:-1] = np.array([(int(t) - int(o)) % p for t, o in zip(target, others)], dtype=np.uint64)
        orig(client, msg)
    return bad


# ---------------------------------------------------------------- the lying server
def _views(server, sr, kind):
    from fedcore.algorithms.secagg_identity import course_identity
    s0 = sorted(sr.masked)
    victim, others = s0[0], s0[1:]
    if kind == "pairs_server":
        views = {u: [victim, u] for u in others}
        views[victim] = [victim, others[0]]
    elif kind == "split_server":
        first, second = others[:len(others) // 2], others[len(others) // 2:]
        a, b = sorted([victim, *first, second[0]]), [victim, *second]   # with 4: {1,2,3} and {1,3,4}
        views = {u: (b if u in second else a) for u in s0}
    else:
        outside = [c for c in course_identity(server.course).roster if c not in s0]
        views = {u: sorted({victim, u, *outside}) for u in s0}
    return s0, views


def _lying_consistency(kind):
    def request(server, _event=None):
        sr = server.state(SecaggServer).current
        s0, sr.views = _views(server, sr, kind)
        sr.survivors = s0
        sr.dropped = {}
        for u, view in sr.views.items():
            keys = [sr.keys[s][0] + sr.keys[s][1] if s in sr.keys else os.urandom(64) for s in view]
            sr.view_keys = getattr(sr, "view_keys", {})
            sr.view_keys[u] = keys
            secagg._send(server, sr, "secagg_consistency_check", u, {"survivors": view, "keys": keys})
        secagg._next_stage(server, sr, "signatures", s0)
    return request


def _take_any_signature(server, msg):
    sr = secagg._accept(server, msg, "signatures")
    if sr is not None:
        sr.signatures[msg.sender] = msg.content["signature"]
        secagg._received(server, msg, "signatures")


def _lying_unmask(server, _event=None):
    sr = server.state(SecaggServer).current
    signers = sorted(sr.signatures)
    if not signers:
        return secagg.request_unmasking(server)
    for u in signers:
        view = sr.views[u]
        dropped = [v for v in sr.survivors if v not in view and v in sr.graph[u]]
        secagg._send(server, sr, "secagg_unmask_request", u, {
            "survivors": view, "keys": sr.view_keys[u], "dropped": dropped, "signers": signers,
            "signatures": [sr.signatures[s] for s in signers]})
    secagg._next_stage(server, sr, "unmask", signers)


def _overlapping_unmask(server, _event=None):
    """The honest request, but each signer's dropped list also names a survivor neighbour."""
    sr = server.state(SecaggServer).current
    signers = sorted(sr.signatures)
    for u in signers:
        secagg._send(server, sr, "secagg_unmask_request", u, {
            "survivors": sr.survivors, "keys": secagg.survivor_keys(sr),
            "dropped": [v for v in sr.survivors if v in sr.graph[u]][:1], "signers": signers,
            "signatures": [sr.signatures[s] for s in signers]})
    secagg._next_stage(server, sr, "unmask", signers)


def _withholding_route(server, _event=None):
    """The project's routing, with no share for the victim."""
    sr = server.state(SecaggServer).current
    u2 = sorted(sr.shares)
    victim = u2[0]
    for v in u2:
        senders = [] if v == victim else [u for u in u2 if v in sr.shares[u]]
        secagg._send(server, sr, "secagg_routed_shares", v, {
            "from": senders, "ciphertexts": [sr.shares[u][v][0] for u in senders],
            "signatures": [sr.shares[u][v][1] for u in senders],
            "commitments": [sr.commitments[u] for u in senders]})
    secagg._next_stage(server, sr, "inputs", u2)


def install(course) -> None:
    kind = course.cfg["secagg_test.adversary"]
    one_stage = {"withholding_server": ("secagg_shares_collected", _withholding_route),
                 "overlap_server": ("secagg_signatures_collected", _overlapping_unmask)}
    if kind in one_stage:
        if course.server is not None:
            event, fn = one_stage[kind]
            course.server_table.register(event, fn, sends=course.server_table.get(event).sends)
        return
    if kind in SERVERS:
        if course.server is None:
            return
        t = course.server_table
        for event, fn in (("secagg_inputs_collected", _lying_consistency(kind)),
                          ("receiving_secagg_survivor_signature", _take_any_signature),
                          ("secagg_signatures_collected", _lying_unmask)):
            t.register(event, fn, sends=t.get(event).sends)
        return
    bad_id, rounds = course.cfg["secagg_test.bad_client"], course.cfg["secagg_test.bad_rounds"]
    if kind in SUM_TARGETS:
        course.secagg_test_inputs = {}
        first = course.client_table.get("receiving_models")
        course.client_table.register("receiving_models", lambda client, msg: _record_input(first.fn, client, msg),
                                     sends=first.sends)
    event, bad = _client_stage(kind)
    reg = course.client_table.get(event)

    def stage(client, msg):
        if client.id == bad_id and (rounds is None or msg.round in rounds):
            return bad(reg.fn, client, msg)
        return reg.fn(client, msg)
    course.client_table.register(event, stage, sends=reg.sends)


install.enabled = lambda cfg: cfg["secagg_test.adversary"] != "none"
behaviours.register("secagg_adversary", install)
