"""Tool calling: rendering tools into the chat template, parsing calls out of the model's
output per model family, and the grammars that force a call when the client requires one."""

from engine.tools.parsers import TOOL_PARSERS, ToolCallParser, detect_tool_parser, make_tool_parser

__all__ = ["TOOL_PARSERS", "ToolCallParser", "detect_tool_parser", "make_tool_parser"]
