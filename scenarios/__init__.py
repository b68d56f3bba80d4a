"""Ready-to-run YAML courses, and the dataset, partitioner and model builders they use."""
from fedcore.scenarios import (bn_models, data, datasets, models, moon_models, partition,  # noqa: F401
                               text, vertical_data)
from fedcore.scenarios import llm_data, llm_models  # noqa: F401  (transformers is imported on use)

__all__ = ["bn_models", "data", "datasets", "llm_data", "llm_models", "models", "moon_models", "partition",
           "text", "vertical_data"]
