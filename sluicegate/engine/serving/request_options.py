"""What a request asks beyond sampling: several choices, tools, structured output, template
variables. Torch-free; the worker fills it from the wire ``Request``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluicegate.engine.protocol import LoraAdapter, Structured, Tool

TOOL_CHOICES = ("none", "auto", "required", "function")
MAX_N = 16


@dataclass
class RequestOptions:
    n: int = 1
    tools: list[Tool] | None = None
    tool_choice: str = "auto"
    tool_choice_name: str | None = None
    parallel_tool_calls: bool = True
    structured: Structured | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    priority: int = 0
    """Lower runs first (``sluicegate.engine.protocol.Request.priority``)."""
    lora: LoraAdapter | None = None
    """Run with this LoRA adapter (loaded from its path on first use); None: the base model."""

    def __post_init__(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.tool_choice not in TOOL_CHOICES:
            raise ValueError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)}")
        names = [tool.name for tool in self.tools or []]
        if self.tool_choice in ("required", "function") and not names:
            raise ValueError(f"tool_choice {self.tool_choice!r} needs tools")
        if self.tool_choice == "function" and self.tool_choice_name not in names:
            raise ValueError(
                f"tool_choice names function {self.tool_choice_name!r}, which is not in tools"
            )

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forces_tool_call(self) -> bool:
        return self.uses_tools and self.tool_choice in ("required", "function")

    @property
    def has_strict_tools(self) -> bool:
        """Calls the model chooses to make must still match the ``strict`` tools' schemas."""
        return self.uses_tools and any(tool.strict for tool in self.tools or [])

    def forced_tools(self) -> list[Tool]:
        tools = self.tools or []
        if self.tool_choice == "function":
            return [t for t in tools if t.name == self.tool_choice_name]
        return list(tools)
