"""What the tool-calling tests share: chat templates that render tools, and tool definitions."""

from __future__ import annotations

# A Hermes / Qwen2.5-style template (written for these tests): tools in the system turn, calls
# as <tool_call> JSON, results as user turns in <tool_response>.
QWEN_STYLE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a function with <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{% if m.content %}{{ m.content }}{% endif %}
{%- for call in m.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role != 'system' %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
LLAMA_STYLE = (
    "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}Respond in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}.'
    "{{ tools | tojson }}{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "rain": {"type": "boolean"},
            },
            "required": ["city", "unit", "rain"],
        },
    },
}
PING = {"type": "function", "function": {"name": "ping", "description": "Check the network"}}
