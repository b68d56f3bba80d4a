"""Ready-to-run YAML courses, and the dataset, partitioner and model builders they use."""
from fedcore.scenarios import data, datasets, models, partition  # noqa: F401  (registers plug-ins)
from fedcore.scenarios import bn_models  # noqa: F401  (models with BatchNorm)

__all__ = ["data", "datasets", "models", "partition", "bn_models"]
