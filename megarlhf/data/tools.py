"""Tool calls in the formats of the families' chat templates.

A tool is described by a JSON schema in the OpenAI shape, ``{"type": "function",
"function": {"name", "description", "parameters"}}``, which a chat template renders from
its ``tools`` variable (``ChatTemplate.render(..., tools=...)``). A call the model made is
kept in the assistant message as transformers keeps it, ``{"role": "assistant",
"content": text, "tool_calls": [{"type": "function", "function": {"name": ...,
"arguments": {...}}}]}``, and the tool's answer is a ``{"role": "tool", "content": ...}``
message. What the model writes is read back by :func:`parse_tool_calls`:

- ``hermes`` (Qwen2.5 / Qwen3, Hermes): every ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`` block; the text outside them is the message's content;
- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3 JSON tool calling): a response that is one JSON
  object ``{"name": ..., "parameters": {...}}`` (after an optional ``<|python_tag|>``);
  any other response is text.

A malformed call - JSON that does not parse, a name that is not a string, arguments that
are not an object, an unclosed ``<tool_call>`` - is a :class:`ToolCallError` whose
message is meant for the model (:func:`error_observation`), never a crash of the run.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

FORMATS = ("hermes", "llama3_json")
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class ToolCallError(ValueError):
    """A tool call the model wrote that cannot be carried out (the text says why)."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict

    def message_entry(self) -> dict:
        """The call as an assistant message's ``tool_calls`` entry."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(obj, key: str, text: str) -> ToolCall:
    if not isinstance(obj, dict):
        raise ToolCallError(f"a tool call must be a JSON object, got {text.strip()[:80]!r}")
    name, arguments = obj.get("name"), obj.get(key, {})
    if not isinstance(name, str) or not name:
        raise ToolCallError(f'a tool call needs a "name" string, got {text.strip()[:80]!r}')
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        raise ToolCallError(f'the "{key}" of a call to {name} must be a JSON object, got '
                            f"{json.dumps(arguments)[:80]}")
    return ToolCall(name, arguments)


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ToolCallError(f"the tool call {text.strip()[:80]!r} is not valid JSON ({err.msg} "
                            f"at character {err.pos})") from None


def parse_tool_calls(text: str, fmt: str) -> tuple[str, list[ToolCall]]:
    """(the response's text outside its tool calls, the calls) in format ``fmt``."""
    if fmt == "hermes":
        calls = [_call(_loads(body), "arguments", body) for body in _HERMES.findall(text)]
        rest = _HERMES.sub("", text)
        if "<tool_call>" in rest:
            raise ToolCallError("a <tool_call> is not closed by </tool_call>")
        return rest.strip(), calls
    if fmt == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        return "", [_call(_loads(body), "parameters", body)]
    raise ValueError(f"tool call format {fmt!r}: use one of {', '.join(FORMATS)}")


def check_tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's ``tool_calls`` (a data file's), as message entries."""
    if not isinstance(calls, list) or not calls:
        raise ValueError(f"{where}: tool_calls must be a non-empty list")
    out = []
    for j, entry in enumerate(calls):
        fn = entry.get("function", entry) if isinstance(entry, dict) else None
        try:
            out.append(_call(fn, "arguments", json.dumps(fn)).message_entry())
        except ToolCallError as err:
            raise ValueError(f"{where} tool call {j}: {err}") from None
    return out


def error_observation(err: ToolCallError) -> dict:
    """The tool message that tells the model its call failed."""
    return {"role": "tool", "content": f"Error: {err}"}


def check_tools(value, where: str) -> list[dict] | None:
    """A row's tools (``data.tools_key``): None, or a list of JSON schemas - OpenAI's
    ``{"type": "function", "function": {"name", ...}}`` or the bare ``{"name", ...}`` -
    given as a list or as its JSON text (as ToolACE / xLAM rows store them)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: tools is not valid JSON ({err})") from None
    if not isinstance(value, list):
        raise ValueError(f"{where}: tools must be a list of JSON schemas, got "
                         f"{type(value).__name__}")
    for j, tool in enumerate(value):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{where}: tool {j} must be a JSON schema with a 'name' (or "
                             "{'type': 'function', 'function': {'name': ...}})")
    return value or None
