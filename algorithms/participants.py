"""Which clients a plug-in applies to: a list of ids, a seeded fraction, or all."""
from __future__ import annotations

import numpy as np

from fedcore.kernel.errors import ConfigError

__all__ = ["chosen_clients"]


def chosen_clients(client_ids: list[int], ids: list | None, fraction: float | None, seed: int,
                   salt: int, key: str) -> set[int]:
    """`ids` if given (checked against `client_ids`), else round(fraction * N) clients drawn
    with the run's seed (`salt` keeps different plug-ins' draws independent), else all."""
    if ids is not None:
        unknown = [c for c in ids if c not in client_ids]
        if unknown:
            raise ConfigError(f"{key}.clients: {unknown} are not client ids (1..{len(client_ids)})")
        return set(int(c) for c in ids)
    if fraction is None:
        return set(client_ids)
    k = int(round(fraction * len(client_ids)))
    rng = np.random.default_rng([seed, salt])
    return set(int(c) for c in rng.permutation(np.asarray(client_ids))[:k])
