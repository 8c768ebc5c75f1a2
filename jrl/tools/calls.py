"""Tool calls in a model turn's text, in the markup of the model's family.

"hermes" (Qwen2, Qwen2.5, Qwen3 and other Hermes-style templates) wraps each call in
tags, one or more per turn:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2 + 2"}}
    </tool_call>

"llama3" (Llama 3.1 to 3.3 JSON tool calling) makes the whole turn a JSON object,
optionally after `<|python_tag|>`, and separates several with ";":

    <|python_tag|>{"name": "calculator", "parameters": {"expression": "2 + 2"}}
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

from jrl.errors import ConfigError

FORMATS = ("hermes", "llama3")

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_HERMES_OPEN = "<tool_call>"
_LLAMA_TAG = "<|python_tag|>"
_LLAMA_END_TOKENS = ("<|eom_id|>", "<|eot_id|>")


class ToolCall(NamedTuple):
    """One call the model made."""

    name: str  # the function name, as in the tool's schema
    arguments: dict  # JSON object of arguments


def parse_tool_calls(text: str, fmt: str) -> tuple[list[ToolCall], list[str]]:
    """The tool calls in one model turn.

    Args:
      text: the turn's decoded text (special tokens kept, for "llama3"'s python tag).
      fmt: "hermes" or "llama3".

    Returns:
      (calls in the order written, one error line per malformed call). A turn without
      tool-call markup gives ([], []).

    Raises:
      ConfigError: an unknown `fmt`.
    """
    if fmt == "hermes":
        return _parse_hermes(text)
    if fmt == "llama3":
        return _parse_llama3(text)
    raise ConfigError(f"unknown tool-call format {fmt!r}; known: {', '.join(FORMATS)}")


def _parse_hermes(text: str) -> tuple[list[ToolCall], list[str]]:
    calls, errors = [], []
    blocks = _HERMES_BLOCK.findall(text)
    for i, block in enumerate(blocks):
        where = f"tool call {i + 1}"
        try:
            payload = json.loads(block)
        except json.JSONDecodeError as err:
            errors.append(f"{where}: malformed JSON inside <tool_call>: {err}")
            continue
        _add_call(payload, "arguments", where, calls, errors)
    # A generation cut at its length limit leaves an opening tag without its close.
    if text.count(_HERMES_OPEN) > len(blocks):
        errors.append(f"tool call {len(blocks) + 1}: <tool_call> is never closed by "
                      "</tool_call>")
    return calls, errors


def _parse_llama3(text: str) -> tuple[list[ToolCall], list[str]]:
    content = text.split(_LLAMA_TAG, 1)[1] if _LLAMA_TAG in text else text.lstrip()
    for token in _LLAMA_END_TOKENS:
        content = content.replace(token, "")
    content = content.strip()
    if _LLAMA_TAG not in text and not content.startswith("{"):
        return [], []  # a plain answer
    calls, errors = [], []
    decoder, position, i = json.JSONDecoder(), 0, 0
    while position < len(content):
        i += 1
        where = f"tool call {i}"
        try:
            payload, position = decoder.raw_decode(content, position)
        except json.JSONDecodeError as err:
            errors.append(f"{where}: malformed JSON: {err}")
            break
        _add_call(payload, "parameters", where, calls, errors)
        rest = content[position:].lstrip()
        if rest and not rest.startswith(";"):
            errors.append(f"{where}: expected ';' or the end after the call, got {rest[:20]!r}")
            break
        position = len(content) - len(rest.removeprefix(";").lstrip())
    return calls, errors


def _add_call(payload: Any, arguments_key: str, where: str,
              calls: list[ToolCall], errors: list[str]) -> None:
    """Appends the call `payload` holds, or the reason it holds none."""
    if not isinstance(payload, dict):
        errors.append(f"{where}: expected a JSON object, got {type(payload).__name__}")
        return
    name = payload.get("name")
    if not isinstance(name, str) or not name.strip():
        errors.append(f"{where}: missing the tool's \"name\"")
        return
    other_key = "arguments" if arguments_key == "parameters" else "parameters"
    arguments = payload.get(arguments_key, payload.get(other_key, {}))
    if isinstance(arguments, str):  # some templates encode the arguments a second time
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as err:
            errors.append(f"{where} ({name}): arguments are a string that is not JSON: {err}")
            return
    if not isinstance(arguments, dict):
        errors.append(f"{where} ({name}): arguments must be a JSON object, got "
                      f"{type(arguments).__name__}")
        return
    calls.append(ToolCall(name.strip(), arguments))
