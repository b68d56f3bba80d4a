"""Ready-to-run YAML courses, and the dataset, partitioner and model builders they use."""
from fedcore.scenarios import (bn_models, data, datasets, models, moon_models, partition,  # noqa: F401
                               text)

__all__ = ["bn_models", "data", "datasets", "models", "moon_models", "partition", "text"]
