"""Runs the tool calls of a rollout turn in parallel and renders the results as messages.

Every call runs in its own daemon thread, watched by a pool of `max_workers` threads
that wait at most `timeout_s` for it. A call past its limit is answered with a
timeout message at once; its thread cannot be stopped from outside and lingers until
the tool returns (its result is dropped). Being a daemon, it never holds up the
process's exit, and it does not occupy a pool thread, so later calls still start.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from jrl.errors import DataError
from jrl.tools.base import Tool, ToolError, argument_problems
from jrl.tools.calls import ToolCall

# Names in rows' `tools_kwargs` of tools that were not loaded, already warned about.
_IGNORED_NAMES: set[str] = set()


class ToolResult(NamedTuple):
    """The outcome of one call."""

    name: str  # the tool the call named
    text: str  # shown to the model as the tool's message
    reward: float  # the step reward the tool gave; 0 on an error
    metrics: dict  # the tool's own flat metrics; empty on an error
    error: str | None  # why the call failed (also in `text`), None when it ran
    latency_s: float  # from the call's start to its answer
    timed_out: bool = False  # cut at the time limit


def execute_calls(calls: Sequence[ToolCall], tools: Mapping[str, Tool],
                  instance_ids: Sequence[str], timeout_s: float,
                  max_workers: int = 8) -> list[ToolResult]:
    """Runs the calls of a batch (any number of rows, any number of calls each) at once.

    No failure of a call propagates: an unknown tool, arguments that miss the schema's
    required names or types, an exception in the tool and a time-out each become an
    `Error: ...` text for the model, with `error` set.

    Args:
      calls: the calls, flattened over rows.
      tools: the tools by name, as `load_tools` returns them.
      instance_ids: per call, the instance of its row (the id given to `create`).
      timeout_s: the longest one call may run, from its own start.
      max_workers: calls running at once; with more calls than workers, the batch
        takes up to ceil(len(calls) / max_workers) * timeout_s.

    Returns:
      One result per call, in the order of `calls`.

    Raises:
      ValueError: `calls` and `instance_ids` differ in length.
    """
    if len(calls) != len(instance_ids):
        raise ValueError(f"{len(calls)} calls but {len(instance_ids)} instance ids")
    if not calls:
        return []
    with concurrent.futures.ThreadPoolExecutor(min(max_workers, len(calls)),
                                               "jrl-tool-watch") as pool:
        return list(pool.map(lambda call, instance_id: run_call(call, tools, instance_id,
                                                                timeout_s),
                             calls, instance_ids))


def run_call(call: ToolCall, tools: Mapping[str, Tool], instance_id: str,
             timeout_s: float) -> ToolResult:
    """Runs one call in a daemon thread and waits at most `timeout_s` for it.

    Returns:
      The tool's result, or an `Error: ...` result (see `execute_calls`).
    """
    start = time.perf_counter()

    def failed(message: str, timed_out: bool = False) -> ToolResult:
        return ToolResult(call.name, f"Error: {message}", 0.0, {}, message,
                          time.perf_counter() - start, timed_out)

    tool = tools.get(call.name)
    if tool is None:
        return failed(f"unknown tool {call.name!r}; available tools: "
                      f"{', '.join(sorted(tools)) or 'none'}")
    if problems := argument_problems(tool.schema, call.arguments):
        return failed(f"bad arguments for tool {call.name!r}: {'; '.join(problems)}")
    outcome: list = []
    worker = threading.Thread(target=_execute_into, args=(tool, instance_id, call, outcome),
                              name=f"jrl-tool-{call.name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return failed(f"tool {call.name!r} timed out after {timeout_s:g} s", timed_out=True)
    kind, value = outcome[0]
    if kind == "error":
        return failed(value)
    text, reward, metrics = value
    return ToolResult(call.name, text, reward, metrics, None, time.perf_counter() - start)


def _execute_into(tool: Tool, instance_id: str, call: ToolCall, outcome: list) -> None:
    """Runs the tool and appends ("ok", (text, reward, metrics)) or ("error", message)."""
    try:
        value = tool.execute(instance_id, call.arguments)
        text, reward, metrics = value
        if not isinstance(text, str) or not isinstance(metrics, dict):
            raise TypeError(f"{type(tool).__name__}.execute must return (str, float, dict), "
                            f"got {value!r:.120}")
        outcome.append(("ok", (text, float(reward), metrics)))
    except ToolError as err:
        outcome.append(("error", str(err)))
    except Exception as err:  # a tool's bug is the model's answer, not the run's end
        outcome.append(("error", f"{type(err).__name__}: {err}"))


def tool_messages(results: Sequence[ToolResult]) -> list[dict]:
    """Chat messages `{"role": "tool", "name", "content"}` of the results, in call order."""
    return [{"role": "tool", "name": r.name, "content": r.text} for r in results]


def call_metrics(results: Sequence[ToolResult]) -> dict[str, float]:
    """Flat scalars for logging: calls, errors, time-outs, mean and max latency (s)."""
    latency = [r.latency_s for r in results]
    return {
        "tools/calls": float(len(results)),
        "tools/errors": float(sum(r.error is not None for r in results)),
        "tools/timeouts": float(sum(r.timed_out for r in results)),
        "tools/latency_mean_s": sum(latency) / max(len(latency), 1),
        "tools/latency_max_s": max(latency, default=0.0),
    }


def create_instances(tools: Mapping[str, Tool], instance_id: str,
                     tools_kwargs: Mapping | None = None) -> None:
    """Creates one row's instance of every tool, under the same id.

    As verl's tool agent loop, which looks up `tools_kwargs` by the name of the tool a
    call runs, entries for tools the tool config does not load are ignored (logged
    once per name), so a data set that carries kwargs for its own tools runs with
    another tool set.

    Args:
      tools: the tools by name.
      instance_id: the row's id.
      tools_kwargs: the row's `extra_info.tools_kwargs`:
        `{tool_name: {"create_kwargs": {...}}}`; tools it does not name get none.

    Raises:
      DataError: the entry of a loaded tool is malformed.
    """
    tools_kwargs = dict(tools_kwargs or {})
    if unknown := set(tools_kwargs) - set(tools) - _IGNORED_NAMES:
        _IGNORED_NAMES.update(unknown)
        logging.warning("extra_info.tools_kwargs names tool(s) %s that the tool config "
                        "does not load (loaded: %s); their create_kwargs are ignored",
                        sorted(unknown), sorted(tools))
    for name, tool in tools.items():
        entry = tools_kwargs.get(name) or {}
        if not isinstance(entry, Mapping):
            raise DataError(f"extra_info.tools_kwargs.{name} must be a mapping with "
                            f"'create_kwargs', got {type(entry).__name__}")
        create_kwargs = entry.get("create_kwargs") or {}
        if not isinstance(create_kwargs, Mapping):
            raise DataError(f"extra_info.tools_kwargs.{name}.create_kwargs must be a "
                            f"mapping, got {type(create_kwargs).__name__}")
        tool.create(instance_id, **create_kwargs)


def release_instances(tools: Mapping[str, Tool], instance_id: str) -> dict[str, float]:
    """Collects each tool's `calc_reward` for the row's instance, then releases it.

    Returns:
      The rewards by tool name.
    """
    rewards = {}
    for name, tool in tools.items():
        rewards[name] = float(tool.calc_reward(instance_id))
        tool.release(instance_id)
    return rewards
