"""Staleness discounts s(tau): how much an update computed from a model tau rounds old counts.

FedAsync's (Xie et al., 2019) families, with tau the number of aggregations
between the model a client started from and the current one:

    none        s(tau) = 1
    polynomial  s(tau) = (1 + tau) ** -a
    hinge       s(tau) = 1                      if tau <= b
                         1 / (a (tau - b) + 1)  otherwise

Every family gives s(0) = 1, so fresh updates (all updates of a synchronous
course) are never discounted.
"""
from __future__ import annotations

from typing import Callable

from fedcore.kernel.config import declare, non_negative

__all__ = ["polynomial", "hinge", "discount_function", "DISCOUNTS"]


declare("asyn.staleness_discount", str, "none",
        "how tolerated stale updates are down-weighted: none, polynomial ((1+tau)^-a, "
        "a = asyn.staleness_exponent) or hinge (1 up to tau = b, then 1/(a(tau-b)+1))",
        choices=("none", "polynomial", "hinge"))
declare("asyn.staleness_exponent", float, 0.5, "polynomial discount: the exponent a",
        check=non_negative)
declare("asyn.staleness_hinge_a", float, 10.0, "hinge discount: the slope a after the hinge",
        check=non_negative)
declare("asyn.staleness_hinge_b", float, 4.0, "hinge discount: staleness b up to which updates "
        "count fully", check=non_negative)


def polynomial(tau: int, a: float) -> float:
    return (1.0 + tau) ** -a


def hinge(tau: int, a: float, b: float) -> float:
    return 1.0 if tau <= b else 1.0 / (a * (tau - b) + 1.0)


DISCOUNTS = ("none", "polynomial", "hinge")


def discount_function(cfg) -> Callable[[int], float] | None:
    """The configured s(tau), or None for `none` (every update counts fully)."""
    kind = cfg["asyn.staleness_discount"]
    if kind == "polynomial":
        a = cfg["asyn.staleness_exponent"]
        return lambda tau: polynomial(tau, a)
    if kind == "hinge":
        a, b = cfg["asyn.staleness_hinge_a"], cfg["asyn.staleness_hinge_b"]
        return lambda tau: hinge(tau, a, b)
    return None
