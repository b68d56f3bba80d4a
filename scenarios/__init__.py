"""Ready-to-run YAML courses, and the dataset, partitioner and model builders they use."""
from fedcore.scenarios import bn_models, data, datasets, models, partition, text  # noqa: F401

__all__ = ["bn_models", "data", "datasets", "models", "partition", "text"]
