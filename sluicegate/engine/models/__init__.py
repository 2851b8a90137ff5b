"""Native torch decoder models that read the paged KV cache, and their loader."""

from sluicegate.engine.models.loader import ARCHITECTURES, UnsupportedModelError, load_model

__all__ = ["ARCHITECTURES", "UnsupportedModelError", "load_model"]
