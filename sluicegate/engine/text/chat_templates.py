"""Hermes-style chat templates (the Qwen2.5 layout) for the locally built models: the demo model
``sluicegate up`` serves and the tiny test models. With ``tools`` they list the functions and ask
for ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``; earlier calls and tool results
render back the same way. The thinking variant opens ``<think>`` in the generation prompt
unless ``enable_thinking`` is false (then it writes an empty block, as Qwen3 does)."""

from __future__ import annotations

# Added tokens that must stay in decoded text (markup the parsers read), unlike special tokens.
MARKUP_TOKENS = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]

_TOOLS_SYSTEM = (
    "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
_TOOLS_FORMAT = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>'
)


def hermes_chat_template(
    turn_start: str = "<|im_start|>", turn_end: str = "<|im_end|>", thinking: bool = False
) -> str:
    s, e = turn_start, turn_end
    generation = f"{{{{- '{s}assistant\\n' }}}}"
    if thinking:
        generation += (
            "{%- if enable_thinking is defined and enable_thinking is false %}"
            "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}"
        )
    return (
        "{%- if tools %}"
        f"{{{{- '{s}system\\n' }}}}"
        "{%- if messages[0].role == 'system' %}{{- messages[0].content }}"
        "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
        f'{{{{- "{_TOOLS_SYSTEM}" }}}}'
        '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
        f'{{{{- "{_TOOLS_FORMAT}{e}\\n" }}}}'
        "{%- elif messages[0].role == 'system' %}"
        f"{{{{- '{s}system\\n' + messages[0].content + '{e}\\n' }}}}"
        "{%- endif %}"
        "{%- for message in messages %}"
        "{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
        " or (message.role == 'assistant' and not message.tool_calls) %}"
        f"{{{{- '{s}' + message.role + '\\n' + (message.content or '') + '{e}\\n' }}}}"
        "{%- elif message.role == 'assistant' %}"
        f"{{{{- '{s}assistant' }}}}"
        "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
        "{%- for tool_call in message.tool_calls %}"
        "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}"
        "{%- endif %}"
        '{{- \'\\n<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
        "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
        "{%- endfor %}"
        f"{{{{- '{e}\\n' }}}}"
        "{%- elif message.role == 'tool' %}"
        "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
        f"{{{{- '{s}user' }}}}{{%- endif %}}"
        "{{- '\\n<tool_response>\\n' + (message.content or '') + '\\n</tool_response>' }}"
        "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
        f"{{{{- '{e}\\n' }}}}{{%- endif %}}"
        "{%- endif %}"
        "{%- endfor %}"
        f"{{%- if add_generation_prompt %}}{generation}{{%- endif %}}"
    )
