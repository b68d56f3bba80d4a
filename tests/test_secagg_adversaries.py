"""Secure aggregation against the adversaries it is named for, each built from the project's
own server or client with one stage changed (tests/secagg_adversary_plugin.py): a server
that shows clients different survivor sets learns no share, and one misbehaving client
neither nullifies nor ends a course, nor poisons it through the mask."""
import json
import logging

import pytest
import torch

from tests.conftest import need_extra

need_extra("secagg")

from fedcore.runtime.course import Course
from fedcore.kernel.errors import NothingAggregated
from fedcore.kernel.message import SERVER_ID
from tests.conftest import small_cfg

SECURE = {"secure_aggregation__enabled": True, "model__dtype": "float64", "eval__clients": False,
          "plugins": ["tests.secagg_adversary_plugin"]}


def _course(tmp_path, adversary, bad=0, **extra):
    cfg = small_cfg(tmp_path, secagg_test__adversary=adversary, secagg_test__bad_client=bad, **{**SECURE, **extra})
    return Course(cfg).build()


def _capture(course):
    """Every message the clients send to the server."""
    sent = []
    course.comm.filters.append(lambda msg, receiver: sent.append(msg) or True if receiver == SERVER_ID else True)
    return sent


# ---------------------------------------------------------------- an active server
@pytest.mark.parametrize("adversary, extra, refusal", [
    # the pairs attack: 4 clients, k = 3, t = 2, each of 2, 3, 4 told "only you and client 1 survived"
    ("pairs_server", {}, "1 survivor(s) masked their input with mine, fewer than the threshold 2"),
    # two survivor sets, each locally plausible: each gathers 2 signatures, the quorum is 3
    ("split_server", {}, "2 valid signature(s) from survivors on the survivor set I signed, fewer than 3"),
    # a survivor list padded with clients that were never neighbours (not in the round)
    ("padded_server", {"federate__client_num": 6, "federate__sample_client_num": 4},
     "1 survivor(s) masked their input with mine, fewer than the threshold 2"),
    # one consistent, signed set, but a survivor also listed as dropped: both its shares asked for
    ("overlap_server", {}, "client(s) [2] listed as dropped are not my neighbours or are also survivors"),
], ids=["pairs", "split", "padded", "overlap"])
def test_a_server_showing_clients_different_survivor_sets_gets_no_share(tmp_path, caplog, adversary, extra, refusal):
    course = _course(tmp_path / "out", adversary, **{"federate__client_num": 4, "federate__total_round_num": 1,
                                                     **extra})
    sent = _capture(course)
    with caplog.at_level(logging.WARNING, logger="fedcore.secagg"), pytest.raises(NothingAggregated):
        course.run()
    reveals = [m for m in sent if m.msg_type == "secagg_unmask_shares"]
    assert reveals == []                                   # no client revealed anything
    refusals = [m for m in sent if m.msg_type == "secagg_abort"]
    assert sorted(m.sender for m in refusals) == sorted(m.sender for m in sent if m.msg_type == "secagg_masked_input")
    assert any(refusal in m.content["reason"] for m in refusals), [m.content for m in refusals]
    rec = course.monitor.records[0]
    assert rec["secagg_aborted"] == 1 and rec["num_updates"] == 0 and rec["secagg_refusals"] == 4
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["secagg_aborted_rounds"] == [1]
    assert any("secure aggregation refused" in r.getMessage() for r in caplog.records)


def test_a_server_withholding_a_clients_shares_gets_no_input_masked_by_its_self_mask_alone(tmp_path, caplog):
    """The server routes no share to client 1 and every other share honestly. Client 1 would
    mask with its self mask only, whose seed the others reveal for a survivor: it refuses the
    round instead, and the server sums the other three (each masked with its neighbours)."""
    course = _course(tmp_path / "out", "withholding_server", federate__client_num=4, federate__total_round_num=1)
    sent = _capture(course)
    with caplog.at_level(logging.WARNING, logger="fedcore.secagg"):
        course.run()
    assert not [m for m in sent if m.msg_type == "secagg_masked_input" and m.sender == 1]
    refusals = [m for m in sent if m.msg_type == "secagg_abort"]
    assert [m.sender for m in refusals] == [1]
    assert "shares from 0 neighbour(s) reached me, fewer than the threshold 2" in refusals[0].content["reason"]
    # no share of client 1's self-mask seed is revealed (it is no survivor); its pairwise mask
    # key's shares are, to take its masks out of the others' inputs
    revealed = [m for m in sent if m.msg_type == "secagg_unmask_shares"]
    assert sorted(m.sender for m in revealed) == [2, 3, 4]
    assert all(1 not in m.content["seed_ids"] and 1 in m.content["key_ids"] for m in revealed)
    assert course.monitor.records[0]["num_updates"] == 3


def test_a_server_substituting_a_clients_keys_is_refused(tmp_path):
    """The server cannot hand out keys of its own for a client: each is signed by the client's
    roster key, so its neighbours refuse the round before sharing anything."""
    course = _course(tmp_path / "out", "none", federate__client_num=4, federate__total_round_num=1)
    from fedcore.algorithms.secagg_crypto import new_private_key, public_bytes
    original = course.server.send

    def substitute(msg_type, receiver, content, round_=None, **kw):
        if msg_type == "secagg_neighbour_keys" and 1 in content["ids"]:
            i = content["ids"].index(1)
            content = {**content, "mask_keys": [*content["mask_keys"][:i], public_bytes(new_private_key()),
                                                *content["mask_keys"][i + 1:]]}
        return original(msg_type, receiver, content, round_=round_, **kw)
    course.server.send = substitute
    sent = _capture(course)
    with pytest.raises(NothingAggregated):
        course.run()
    assert not [m for m in sent if m.msg_type in ("secagg_encrypted_shares", "secagg_unmask_shares") and m.sender != 1]
    reasons = [m.content["reason"] for m in sent if m.msg_type == "secagg_abort"]
    assert len(reasons) == 3 and all("client 1's keys are not signed by client 1" in r for r in reasons)


# ---------------------------------------------------------------- one misbehaving client
FIVE = {"federate__client_num": 5, "federate__total_round_num": 3}


def _without(tmp_path, bad):
    """The honest course in which client `bad` vanishes after sharing, every round: the sum of
    the others (the protocol's dropout recovery, tested against the plain sum elsewhere)."""
    trace = tmp_path / "devices.json"
    trace.write_text(json.dumps([{"client_id": c, "dropout": 1.0 if c == bad else 0.0} for c in range(1, 6)]))
    course = _course(tmp_path / "without", "none", time__profiles={"type": "trace", "path": str(trace)}, **FIVE)
    return course, course.run()


def _max_diff(a, b):
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _bound(course, rounds=3):
    """The quantization error of `rounds` secure rounds: c / (2^bits - 1) per coordinate each."""
    return rounds * course.cfg["secure_aggregation.clip"] / ((1 << course.cfg["secure_aggregation.bits"]) - 1)


def _run(course, caplog, logger="fedcore.secagg"):
    with caplog.at_level(logging.WARNING, logger=logger):
        return course.run()


@pytest.mark.parametrize("adversary, what", [
    ("garbage_shares", "client 5 excluded: its shares failed their checks at client(s) [1, 2, 3, 4]"),
    ("false_weight", "client 5 excluded: it declared weight 1000000, outside 1..{train} (its join)"),
    # its pairwise mask with client 4 could not be removed were it to drop: named, not summed
    ("omit_share", "client 5 excluded: it sent no share to its neighbour(s) [4]"),
])
def test_a_client_excluded_before_masking_leaves_the_course_of_the_others(tmp_path, caplog, adversary, what):
    course = _course(tmp_path / "out", adversary, bad=5, **FIVE)
    summary = _run(course, caplog)
    assert [r["num_updates"] for r in course.monitor.records] == [4, 4, 4]
    assert all(r["secagg_excluded"] == [5] for r in course.monitor.records)
    assert summary["secagg_excluded"] == {"5": 3}
    what = what.format(train=len(course.clients[5].data.train))   # the sample count it joined with
    assert what in caplog.text and "learning rate" not in caplog.text
    reference, ref_summary = _without(tmp_path, 5)
    assert abs(summary["final_test_acc"] - ref_summary["final_test_acc"]) <= 0.05
    # the same four updates are summed: equal models within the quantization bound, 3 rounds
    assert _max_diff(course.server.aggregator.global_state, reference.server.aggregator.global_state) <= _bound(course)


def test_a_false_report_of_a_good_share_changes_nothing_where_t_is_below_k(tmp_path, caplog):
    """5 clients: k = 4, t = 3. Client 5 reports its lowest neighbour's good share as bad every
    round: that client keeps 3 good holders, t, so nobody is excluded and all five are summed."""
    course = _course(tmp_path / "out", "false_report", bad=5, **FIVE)
    _run(course, caplog)
    assert [(r["num_updates"], r["secagg_excluded"]) for r in course.monitor.records] == [(5, [])] * 3


@pytest.mark.parametrize("clients, neighbours, warned", [(3, 0, True), (6, 2, True), (4, 0, False)])
def test_a_course_whose_threshold_equals_its_neighbours_is_warned(tmp_path, caplog, clients, neighbours, warned):
    # t = k: one loss after masking voids a round (3 clients: k = 2, t = 2; 4 clients: k = 3, t = 2)
    with caplog.at_level(logging.WARNING, logger="fedcore.secagg"):
        _course(tmp_path / "out", "none", federate__client_num=clients,
                secure_aggregation__num_neighbours=neighbours)
    assert ("one dropout, exclusion or report of a bad share after masking voids the round"
            in caplog.text) == warned


@pytest.mark.parametrize("adversary, extra, report", [
    # one holder (the lowest id) gets a share off by one: it reports it, the other three shares rebuild
    ("one_bad_share", {}, "client 1: round 1: the share from client 5 fails its check against the dealer's "
                          "commitments; reported"),
    # no unmask answer from client 5: the others' shares of every seed are enough (t = 3 of 4)
    ("withhold", {"secure_aggregation__stage_timeout": 5.0}, "no secagg_unmask_shares from client(s) [5]"),
    # false seed shares in the unmask stage: caught against the commitments, the other holders' shares used
    ("false_reveal", {}, "client 5 excluded: it revealed a false share of client 1's seed"),
], ids=["one_bad_share", "withhold", "false_reveal"])
def test_a_client_the_protocol_tolerates_is_summed_with_the_rest(tmp_path, caplog, adversary, extra, report):
    course = _course(tmp_path / "out", adversary, bad=5, **FIVE, **extra)
    summary = _run(course, caplog, "fedcore")
    assert [r["num_updates"] for r in course.monitor.records] == [5, 5, 5]
    assert report in caplog.text
    if adversary == "one_bad_share":    # and the server's log names the dealer too
        assert "round 1: client 1 reports a bad share from client(s) [5]" in caplog.text
    honest = _course(tmp_path / "honest", "none", **FIVE)
    honest_summary = honest.run()
    assert _max_diff(course.server.aggregator.global_state, honest.server.aggregator.global_state) <= _bound(course)
    assert abs(summary["final_test_acc"] - honest_summary["final_test_acc"]) <= 0.05


@pytest.mark.parametrize("adversary, what", [
    # its masks are removed as a dropout's (its partners' shares of its key)
    ("replay", "client 5 excluded: it replayed a masked input already sent"),
    # excluded before anyone uses the keys: nobody masks with it
    ("replay_keys", "client 5 excluded: it replayed public keys of an earlier round"),
])
def test_a_replay_from_round_2_on_is_left_out_and_the_others_train(tmp_path, caplog, adversary, what):
    course = _course(tmp_path / "out", adversary, bad=5, **FIVE)
    summary = _run(course, caplog)
    assert [r["num_updates"] for r in course.monitor.records] == [5, 4, 4]
    assert [r["secagg_excluded"] for r in course.monitor.records] == [[], [5], [5]]
    assert what in caplog.text
    _, ref_summary = _without(tmp_path, 5)
    assert abs(summary["final_test_acc"] - ref_summary["final_test_acc"]) <= 0.05


@pytest.mark.parametrize("adversary, why", [
    ("out_of_range", "a coordinate is"),
    ("out_of_range_weight", "its total weight is"),   # a weight inside the input unlike the one declared
])
def test_an_out_of_range_secure_input_is_refused_and_the_model_stays_within_reach(tmp_path, caplog, adversary, why):
    course = _course(tmp_path / "out", adversary, bad=5, **FIVE)
    before = {k: v.clone() for k, v in course.server.aggregator.global_state.items()}
    rounds = {}
    aggregate = course.server.aggregator.aggregate

    def spy(updates, round_):
        start = {k: v.clone() for k, v in course.server.aggregator.global_state.items()}
        out = aggregate(updates, round_)
        rounds[round_] = _max_diff(course.server.aggregator.global_state, start)
        return out
    course.server.aggregator.aggregate = spy
    summary = _run(course, caplog)
    rec = course.monitor.records
    assert rec[0]["secagg_out_of_range"] == 1 and rec[0]["num_updates"] == 0
    assert summary["secagg_out_of_range_rounds"] == [1]
    assert f"round 1 out_of_range: the unmasked sum is refused: {why}" in caplog.text
    assert 1 not in rounds          # round 1's sum never reached the aggregator
    assert [r["num_updates"] for r in rec[1:]] == [5, 5]
    # every adopted step is a weighted mean of clipped deltas: no coordinate moves more than c
    clip = course.cfg["secure_aggregation.clip"]
    assert all(step <= clip + 1e-9 for step in rounds.values())
    assert _max_diff(course.server.aggregator.global_state, before) <= 2 * clip + 1e-9


def test_a_server_shrinking_a_clients_neighbour_list_is_refused(tmp_path):
    """With the default threshold a client derives t from its neighbour count; a server showing
    it 2 of its 5 neighbours (t would drop to 2) meets the configured floor: t = 5 // 2 + 1 = 3."""
    course = _course(tmp_path / "out", "none", federate__client_num=6, federate__total_round_num=1)
    original = course.server.send

    def shrink(msg_type, receiver, content, round_=None, **kw):
        if msg_type == "secagg_neighbour_keys" and receiver == 1:
            content = {k: v[:2] for k, v in content.items()}
        return original(msg_type, receiver, content, round_=round_, **kw)
    course.server.send = shrink
    sent = _capture(course)
    course.run()
    reasons = {m.sender: m.content["reason"] for m in sent if m.msg_type == "secagg_abort"}
    assert reasons == {1: "2 neighbour(s), fewer than the threshold 3 the configuration gives"}
    assert not [m for m in sent if m.msg_type == "secagg_encrypted_shares" and m.sender == 1]


def test_a_garbage_masked_input_every_round_stops_the_course_non_zero(tmp_path, caplog):
    """Garbage inside the mask cannot be told from the sum whose it is: every round's sum is
    refused, nothing is adopted, and the course ends with exit code 6 rather than 0."""
    course = _course(tmp_path / "out", "garbage_input", bad=5, federate__client_num=5, federate__total_round_num=2)
    before = {k: v.clone() for k, v in course.server.aggregator.global_state.items()}
    with caplog.at_level(logging.WARNING, logger="fedcore.secagg"), pytest.raises(NothingAggregated) as stop:
        course.run()
    assert stop.value.exit_code == 6 and "round 2 out_of_range" in str(stop.value)
    assert [r["secagg_out_of_range"] for r in course.monitor.records] == [1, 1]
    assert _max_diff(course.server.aggregator.global_state, before) == 0


def test_a_dropout_that_shared_another_mask_key_is_removed_by_the_pairwise_keys(tmp_path, caplog):
    """Client 5 shares a key unlike its advertised mask key and vanishes after sharing: the key
    rebuilt from its shares does not match, so the survivors' revealed pairwise keys remove
    its masks, and the round sums the other four as if it had simply dropped."""
    course = _course(tmp_path / "out", "other_key_then_drop", bad=5, secure_aggregation__stage_timeout=5.0,
                     **FIVE)
    _run(course, caplog)
    assert [(r["num_updates"], r["secagg_dropped"]) for r in course.monitor.records] == [(4, 1)] * 3
    reference, _ = _without(tmp_path, 5)
    assert _max_diff(course.server.aggregator.global_state, reference.server.aggregator.global_state) <= _bound(course)


# ---------------------------------------------------------------- inside the sum's bound
def _one_round(tmp_path, adversary, **extra):
    """A 6-client, 1-round secure course with client 6 as `adversary`; (course, its model before)."""
    course = _course(tmp_path, adversary, bad=6, federate__total_round_num=1, **extra)
    return course, {k: v.clone() for k, v in course.server.aggregator.global_state.items()}


def _step(course, before):
    """The round's mean delta as adopted: FedAvg adds it to the model unchanged."""
    after = course.server.aggregator.global_state
    return torch.cat([(after[k].double() - before[k].double()).reshape(-1) for k in sorted(before)])


@pytest.mark.parametrize("adversary, corner", [("sum_top", 1.0), ("sum_bottom", -1.0)])
def test_one_client_inside_the_sums_bound_puts_every_coordinate_of_the_mean_at_a_corner(
        tmp_path, caplog, adversary, corner):
    """docs/secure_aggregation.md, Bounded input: an accepted sum has every coordinate in
    [0, W (2^bits - 1)], i.e. every coordinate of the mean in [-c, c], and one client of any
    weight can encode an input that puts it anywhere there: the displacement of coordinate j from
    the honest mean m_j reaches c + |m_j| (at most 2c), not 2c w / W."""
    course, before = _one_round(tmp_path / "out", adversary)
    summary = _run(course, caplog)
    assert course.monitor.records[0]["num_updates"] == 6 and "secagg_out_of_range_rounds" not in summary
    c, levels = course.cfg["secure_aggregation.clip"], (1 << course.cfg["secure_aggregation.bits"]) - 1
    attacker = course.clients[6]
    honest_total = attacker.secagg_test_honest
    big_w, w = int(honest_total[-1]), int(course.secagg_test_inputs[1][6][-1])
    # the mean the honest round would have had, from its integer sum by the encoding's formula
    honest = torch.tensor([int(x) * 2 * c / levels / big_w - c for x in honest_total[:-1]], dtype=torch.float64)
    step = _step(course, before)
    assert torch.allclose(step, torch.full_like(step, corner * c), rtol=0, atol=1e-12)   # the corner, exactly
    moved = (step - honest).abs()
    assert torch.all(moved <= c + honest.abs() + 1e-12)                  # the documented bound ...
    assert torch.allclose(moved, c + corner * -honest, rtol=0, atol=1e-12)   # ... reached on every coordinate
    assert moved.max().item() > 2 * c * w / big_w                        # far past its weight's share
    assert w / big_w <= 1 / 6 + 1e-12


@pytest.mark.parametrize("adversary", ["sum_above_top", "sum_below_bottom"])
def test_one_step_past_the_sums_bound_is_refused(tmp_path, caplog, adversary):
    course, before = _one_round(tmp_path / "out", adversary)
    with pytest.raises(NothingAggregated):
        _run(course, caplog)
    assert course.monitor.records[0]["secagg_out_of_range"] == 1
    assert "round 1 out_of_range: the unmasked sum is refused: a coordinate is" in caplog.text
    assert _max_diff(course.server.aggregator.global_state, before) == 0


CENTRAL = {"privacy__dp__mode": "central", "privacy__dp__noise_multiplier": 0.0, "privacy__dp__clip_norm": 0.5}


def test_under_central_dp_a_mean_beyond_the_clip_norm_is_refused(tmp_path, caplog):
    """Each client clipped its delta to L2 norm C: a mean of norm above C + sqrt(n) c / (2^bits - 1)
    is one no honest inputs reach. The corner (norm c sqrt(n)) is refused; the attacker keeps
    the ball: the mean anywhere within that norm."""
    from fedcore.algorithms.secure_sum import norm_reach
    course, before = _one_round(tmp_path / "out", "sum_top", **CENTRAL)
    with pytest.raises(NothingAggregated):
        _run(course, caplog)
    assert course.monitor.records[0]["secagg_out_of_range"] == 1
    assert "the mean delta's L2 norm is" in caplog.text
    assert _max_diff(course.server.aggregator.global_state, before) == 0
    n = sum(v.numel() for v in before.values())
    assert norm_reach(0.5, n, 1.0, 16) == pytest.approx(0.5 + n ** 0.5 / 65535)


def test_under_central_dp_one_client_still_puts_the_mean_anywhere_in_the_ball(tmp_path, caplog):
    """What the norm check leaves: the mean at C = 0.5 on one coordinate, 0 elsewhere (to a
    level, c / (2^bits - 1) / W at most), accepted; weight 1 of 6."""
    course, before = _one_round(tmp_path / "out", "sum_ball", **CENTRAL)
    summary = _run(course, caplog)
    assert course.monitor.records[0]["num_updates"] == 6 and "secagg_out_of_range_rounds" not in summary
    c, levels = course.cfg["secure_aggregation.clip"], (1 << course.cfg["secure_aggregation.bits"]) - 1
    want = torch.zeros_like(_step(course, before))
    want[0] = 0.5
    assert torch.allclose(_step(course, before), want, rtol=0, atol=c / levels / 6 + 1e-12)
