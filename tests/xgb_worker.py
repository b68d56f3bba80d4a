"""One worker of XGBoost's own distributed `hist` (tests/test_trees.py compares the federated
histogram method with it). A module of its own: the spawned worker imports this and xgboost,
not the test module with torch and fedcore (seconds of imports in each worker)."""
from __future__ import annotations


def distributed_worker(args: dict, rank: int, x, y, params: dict, rounds: int, queue) -> None:
    """Train `rounds` trees on this worker's rows in the tracker's communicator; rank 0 puts the
    model (XGBoost's JSON) on `queue`."""
    import xgboost as xgb
    from xgboost import collective
    with collective.CommunicatorContext(**args, dmlc_task_id=str(rank)):
        bst = xgb.train(params, xgb.DMatrix(x, label=y), rounds)
        if rank == 0:
            queue.put(bytes(bst.save_raw("json")))
