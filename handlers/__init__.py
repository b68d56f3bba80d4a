"""The default <event, handler> sets. Each module registers handlers on worker roles."""
from fedcore.handlers import analytics, asyn, deployment, evaluation, join, rounds, sync, training, trees  # noqa: F401
from fedcore.handlers import attack, edge, performance_drop, secure_aggregation  # noqa: F401  (plug-ins)
from fedcore.handlers import analytics_secure  # noqa: F401  (after secure_aggregation, whose handlers it changes)
from fedcore.handlers import vertical, vertical_deploy, vertical_lr  # noqa: F401
from fedcore.handlers import secureboost  # noqa: F401  (after vertical, whose alignment it runs)

__all__ = ["analytics", "analytics_secure", "asyn", "attack", "deployment", "edge", "evaluation", "join", "performance_drop", "rounds",
           "secure_aggregation", "secureboost", "sync", "training", "trees", "vertical", "vertical_deploy", "vertical_lr"]
