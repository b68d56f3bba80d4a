"""Ready-to-run YAML courses, and the dataset, partitioner and model builders they use."""
from fedcore.scenarios import data, datasets, models, moon_models, partition  # noqa: F401  (registers plug-ins)

__all__ = ["data", "datasets", "models", "moon_models", "partition"]
