"""The chat templates kept for the tool-format tests, and the one tool and the
call -> result conversation those tests render through each of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def chat_template(name: str) -> str:
    """A kept template's text (``TEMPLATES / name``)."""
    return (TEMPLATES / name).read_text()


def weather_turns(call_id: str = "call_1") -> list[dict[str, Any]]:
    """A user question, the assistant's get_weather call (``call_id``: Mistral's
    templates want 9 characters) and the tool's result."""
    return [{"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": call_id, "content": "22 C"}]
