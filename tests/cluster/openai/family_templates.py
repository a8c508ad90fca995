"""Chat templates in the shapes the served families ship (written for these tests): how each
lists tools, writes an assistant's tool calls and a tool's answer, and opens or closes a
thinking block, with the template helpers they call (`strftime_now`, `items`, `tojson`)."""

from __future__ import annotations

import json

# Qwen3.5: tools as JSON lines, calls in the XML form, thinking opened by the generation prompt
# unless enable_thinking is false (then an empty block is closed there).
QWEN3_5 = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a function as <tool_call>
<function=NAME>
<parameter=NAME>
VALUE
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if tools and loop.first and message.role == 'system' %}{% continue %}{% endif %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>
<function={{ call.function.name }}>
{% for name, value in call.function.arguments | items %}<parameter={{ name }}>
{{ value if value is string else value | tojson }}
</parameter>
{% endfor %}</function>
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""

# Qwen3-Next (instruct): hermes JSON calls, no thinking.
QWEN3_NEXT = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Return each call as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if tools and loop.first and message.role == 'system' %}{% continue %}{% endif %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# Granite 4.0: roles between <|start_of_role|> markers, today's date in the system prompt,
# hermes JSON calls.
GRANITE_4 = """\
<|start_of_role|>system<|end_of_role|>Today is {{ strftime_now('%B %d, %Y') }}.
{%- if messages[0].role == 'system' %} {{ messages[0].content }}{% endif %}
{%- if tools %} You can call these tools:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Write each call as <tool_call>{"name": ..., "arguments": ...}</tool_call>.{% endif %}<|end_of_text|>
{% for message in messages %}
{%- if message.role == 'system' %}{% continue %}{% endif %}
{%- if message.role == 'tool' %}<|start_of_role|>tool<|end_of_role|>{{ message.content }}\
<|end_of_text|>
{% elif message.role == 'assistant' %}<|start_of_role|>assistant<|end_of_role|>\
{{ message.content }}
{%- for call in message.tool_calls or [] %}<tool_call>
{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}
</tool_call>{% endfor %}<|end_of_text|>
{% else %}<|start_of_role|>{{ message.role }}<|end_of_role|>{{ message.content }}\
<|end_of_text|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_of_role|>assistant<|end_of_role|>{% endif %}"""

# Nemotron-H: /think or /no_think in the system turn, calls as one <TOOLCALL> list, tool
# answers in <TOOL_RESPONSE> blocks, the generation prompt opening the thinking block.
NEMOTRON_H = """\
<SPECIAL_10>System
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}
{%- if tools %}
<AVAILABLE_TOOLS>[{% for tool in tools %}{{ tool | tojson }}{% if not loop.last %}, \
{% endif %}{% endfor %}]</AVAILABLE_TOOLS>{% endif %}
{% for message in messages %}
{%- if message.role == 'system' %}{% continue %}{% endif %}
{%- if message.role == 'user' %}<SPECIAL_11>User
{{ message.content }}
{% elif message.role == 'tool' %}<SPECIAL_11>User
<TOOL_RESPONSE>[{{ message.content }}]</TOOL_RESPONSE>
{% else %}<SPECIAL_11>Assistant
{{ message.content }}
{%- if message.tool_calls %}<TOOLCALL>[
{%- for call in message.tool_calls %}{"name": "{{ call.function.name }}", "arguments": \
{{ call.function.arguments | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}\
]</TOOLCALL>{% endif %}
<SPECIAL_12>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<SPECIAL_11>Assistant
{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>
{% endif %}{% endif %}"""

# LFM2: tools as a JSON list between list markers in the system turn, calls as one Python
# list between call markers, tool answers between response markers.
LFM2 = """\
<|startoftext|>
{%- if tools or messages[0].role == 'system' %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}
{%- if tools %}
List of tools: <|tool_list_start|>[{% for tool in tools %}{{ tool | tojson }}\
{% if not loop.last %}, {% endif %}{% endfor %}]<|tool_list_end|>{% endif %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% continue %}{% endif %}
{%- if message.role == 'tool' %}<|im_start|>tool
<|tool_response_start|>{{ message.content }}<|tool_response_end|><|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{%- if message.tool_calls %}<|tool_call_start|>[
{%- for call in message.tool_calls %}{{ call.function.name }}(
{%- for name, value in call.function.arguments | items %}{{ name }}={{ value | tojson }}\
{% if not loop.last %}, {% endif %}{% endfor %}){% if not loop.last %}, {% endif %}\
{% endfor %}]<|tool_call_end|>{% endif %}{{ message.content or '' }}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# OLMo 3 (and OLMo-Hybrid) instruct: tools in <functions>, one Python call a line in
# <function_calls>, tool answers as the environment's turn.
OLMO_3 = """\
{%- if tools or messages[0].role == 'system' %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}
{%- if tools %} <functions>{{ tools | tojson }}</functions>{% endif %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% continue %}{% endif %}
{%- if message.role == 'tool' %}<|im_start|>environment
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content or '' }}
{%- if message.tool_calls %}<function_calls>
{%- for call in message.tool_calls %}{{ '\\n' }}{{ call.function.name }}(
{%- for name, value in call.function.arguments | items %}{{ name }}={{ value | tojson }}\
{% if not loop.last %}, {% endif %}{% endfor %}){% endfor %}{{ '\\n' }}</function_calls>\
{% endif %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# Jamba 1.5 and later: turns between <|bom|> and <|eom|> with role tokens, tools as JSON in
# the system turn, calls as one JSON list in <tool_calls>, tool answers as the tool's turn.
JAMBA = """\
<|startoftext|><|bom|><|system|> {% if messages[0].role == 'system' %}{{ messages[0].content }}\
{% endif %}
{%- if tools %}
# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>{% endif %}<|eom|>
{%- for message in messages %}
{%- if message.role == 'system' %}{% continue %}{% endif %}
{%- if message.role == 'assistant' %}<|bom|><|assistant|> {{ message.content or '' }}
{%- if message.tool_calls %}<tool_calls>[
{%- for call in message.tool_calls %}{"name": "{{ call.function.name }}", "arguments": \
{{ call.function.arguments | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}\
]</tool_calls>{% endif %}<|eom|>
{%- else %}<|bom|><|{{ message.role }}|> {{ message.content }}<|eom|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|bom|><|assistant|>{% endif %}"""

# Kimi Linear (Kimi K2's format): role markers, tools as JSON in the system turn, a section of
# calls each named by its id `functions.NAME:INDEX`, tool answers in the tool's turn.
KIMI = """\
{%- if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}<|im_assistant|>assistant<|im_middle|>\
{{ message.content or '' }}
{%- if message.tool_calls %}<|tool_calls_section_begin|>
{%- for call in message.tool_calls %}<|tool_call_begin|>{{ call.id }}\
<|tool_call_argument_begin|>{{ call.function.arguments | tojson }}<|tool_call_end|>\
{% endfor %}<|tool_calls_section_end|>{% endif %}<|im_end|>
{%- elif message.role == 'tool' %}<|im_system|>tool<|im_middle|>## Return of \
{{ message.tool_call_id }}
{{ message.content }}<|im_end|>
{%- else %}<|im_{{ 'user' if message.role == 'user' else 'system' }}|>{{ message.role }}\
<|im_middle|>{{ message.content }}<|im_end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"""

FAMILIES = {
    "qwen3_5": QWEN3_5,
    "qwen3_next": QWEN3_NEXT,
    "granite_4": GRANITE_4,
    "nemotron_h": NEMOTRON_H,
    "lfm2": LFM2,
    "olmo_3": OLMO_3,
    "jamba": JAMBA,
    "kimi": KIMI,
}
# The tool-call format and whether a reasoning parser is read from each template.
EXPECTED_PARSERS = {
    "qwen3_5": ("qwen3_coder", True),
    "qwen3_next": ("hermes", False),
    "granite_4": ("hermes", False),
    "nemotron_h": ("nemotron_json", True),
    "lfm2": ("lfm2", False),
    "olmo_3": ("olmo3", False),
    "jamba": ("jamba", False),
    "kimi": ("kimi_k2", False),
}


def written(format_name: str, calls: list[tuple[str, dict]]) -> str:
    """Calls as a model of a family writes them (one format of tool_parsers.FORMATS)."""
    if format_name == "hermes":
        return "".join(
            f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>\n"
            for n, a in calls
        )
    if format_name == "qwen3_coder":
        blocks = []
        for name, arguments in calls:
            params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
            blocks.append(f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>\n")
        return "".join(blocks)
    python = [f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in calls]
    if format_name == "lfm2":
        return f"<|tool_call_start|>[{', '.join(python)}]<|tool_call_end|>"
    if format_name == "olmo3":
        return "<function_calls>\n" + "\n".join(python) + "\n</function_calls>"
    if format_name == "kimi_k2":
        written_calls = "".join(
            f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{json.dumps(a)}"
            "<|tool_call_end|>"
            for i, (n, a) in enumerate(calls)
        )
        return f"<|tool_calls_section_begin|>{written_calls}<|tool_calls_section_end|>"
    entries = json.dumps([{"name": n, "arguments": a} for n, a in calls])
    if format_name == "jamba":
        return f"<tool_calls>{entries}</tool_calls>"
    return f"<TOOLCALL>{entries}</TOOLCALL>"
