"""Analytics over secure aggregation: the SecAgg+ stages (handlers/secure_aggregation.py) carry
a client's integer sums instead of a quantized model delta, so the server learns only the sum
over the round's surviving clients.

Two handlers change, nothing else: the client's first stage masks its sums vector (each entry
a 32-bit limb or a count below 2^40, then its weight 1) where a training client masks its
update, and the server's last stage hands the unmasked sum, checked against what honest
inputs can reach (each entry at most survivors x (2^40 - 1)), to the analytics aggregator as
one update, where a training course dequantizes it to a mean delta. The sums are integers, so
the secure sum is exact. min/max (one record's value, not a sum) are refused.
"""
from __future__ import annotations

import numpy as np
import torch

from fedcore.algorithms import analytics_stats as st
from fedcore.handlers import analytics, evaluation, rounds, secagg_client
from fedcore.handlers.secure_aggregation import start_secure_round, whole_sum
from fedcore.kernel.contract import ReceivedUpdate
from fedcore.kernel.registry import behaviours
from fedcore.kernel.worker import Stopwatch

__all__ = ["mask_sums", "sum_securely", "install"]


def mask_sums(client, msg) -> None:
    """Client `receiving_models`: compute the round's sums and enter them into the protocol."""
    from fedcore.algorithms.secagg_settings import Settings
    client.round = msg.round
    with Stopwatch() as sw:
        result = client.course.trainer.fit(client.id, client.data, msg.content, msg.round)
    client.spend(result.work, sw.seconds)
    modulus = Settings.of(client.course.cfg).modulus
    sums = result.content["sums"].numpy().astype(np.uint64) % np.uint64(modulus)
    secagg_client.advertise(client, msg.round, np.append(sums, np.uint64(1)), 1)


def sum_securely(server, _event=None) -> None:
    """`secagg_shares_revealed`: unmask the round's sum, check it, aggregate it as the round's
    one update; a sum that cannot be unmasked or is out of range stops the course
    (NothingAggregated): a statistic of the union cannot skip a round."""
    from fedcore.algorithms.secure_sum import out_of_range
    sr, total = whole_sum(server, "analytics", "a statistic of the union cannot skip a round",
                          lambda sr, total: out_of_range(total, sum(sr.weights[v] for v in sr.survivors),
                                                         st.ROW_BITS))
    update = ReceivedUpdate(0, {"sums": torch.from_numpy(total[:-1].astype(np.int64)),
                                "extremes": torch.zeros(0, dtype=torch.float64),
                                "num_samples": int(total[-1])}, sr.round, 0)
    fields = {"num_updates": len(sr.survivors), "secagg_survivors": len(sr.survivors), **sr.fields()}
    if analytics.settle(server, [update], fields):
        start_secure_round(server)


@behaviours.register("analytics_secure_sums")
def install(course) -> None:
    """After secure aggregation's own handlers: the two that carry sums instead of a model."""
    course.client_table.register("receiving_models", mask_sums, sends=("secagg_public_keys",), replaces=True)
    course.server_table.register("secagg_shares_revealed", sum_securely, replaces=True,
                                 sends=("models", "secagg_stage_timeout", "max_rounds_reached"))
    # the stages' ways of ending a round as a training course does (a skipped round evaluates,
    # may stop early) stop an analytics course in its aggregator; their events are handled too
    course.server_table.register("early_stop", rounds.finish_course, sends=("finish",))
    evaluation.install(course)


install.enabled = lambda cfg: cfg["task"] == "analytics" and cfg["secure_aggregation.enabled"]
