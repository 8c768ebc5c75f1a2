"""The host side of multi-turn tool-calling rollouts.

A tool config file (`load_tools`) lists the tools; each rollout row gets an instance
of every tool (`create_instances`); after each assistant turn the calls are parsed in
the model family's markup (`parse_tool_calls`), run in parallel under a time limit
(`execute_calls`), and their results go back into the conversation as tool messages
(`tool_messages`); at the row's end the tools' rewards are collected and the instances
freed (`release_instances`).

    tools = load_tools("tools.yaml")
    create_instances(tools, row_id, row["extra_info"].get("tools_kwargs"))
    calls, errors = parse_tool_calls(turn_text, "hermes")
    results = execute_calls(calls, tools, [row_id] * len(calls), timeout_s=5.0)
    messages += tool_messages(results)
"""

from jrl.tools.base import Tool, ToolError, argument_problems, schema_problems
from jrl.tools.builtin import Calculator, PythonExpression, calculate
from jrl.tools.calls import FORMATS, ToolCall, parse_tool_calls
from jrl.tools.config import load_tools
from jrl.tools.execute import (
    ToolResult,
    call_metrics,
    create_instances,
    execute_calls,
    release_instances,
    run_call,
    tool_messages,
)

__all__ = [
    "FORMATS",
    "Calculator",
    "PythonExpression",
    "Tool",
    "ToolCall",
    "ToolError",
    "ToolResult",
    "argument_problems",
    "calculate",
    "call_metrics",
    "create_instances",
    "execute_calls",
    "load_tools",
    "parse_tool_calls",
    "release_instances",
    "run_call",
    "schema_problems",
    "tool_messages",
]
