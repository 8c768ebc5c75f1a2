"""Tools for multi-turn rollouts: built-ins, call parsing, parallel execution, config files."""

import json
import os
import subprocess
import textwrap
import threading
import time

import chex
import numpy as np
import pytest

from jrl.errors import ConfigError, DataError
from jrl.tools import (
    Calculator,
    PythonExpression,
    Tool,
    ToolCall,
    ToolError,
    calculate,
    call_metrics,
    create_instances,
    execute_calls,
    load_tools,
    parse_tool_calls,
    release_instances,
    tool_messages,
)


def _schema(name, required=("x",), types=None):
    properties = {arg: {"type": (types or {}).get(arg, "string")} for arg in required}
    return {"type": "function", "function": {
        "name": name, "description": f"The {name} test tool.",
        "parameters": {"type": "object", "properties": properties, "required": list(required)}}}


class Sleepy(Tool):
    def execute(self, instance_id, arguments):
        time.sleep(float(self.config.get("sleep_s", 0.3)))
        return "slept", 0.5, {"slept": 1.0}


class Raising(Tool):
    def execute(self, instance_id, arguments):
        raise KeyError("no such key")


class Counter(Tool):
    """Counts its calls per instance; the count is its end reward."""

    def execute(self, instance_id, arguments):
        state = self.instances[instance_id]
        state["calls"] = state.get("calls", 0) + 1
        return f"{state['start'] + state['calls']}", 0.1, {}

    def calc_reward(self, instance_id):
        return float(self.instances[instance_id]["calls"])


NotATool = dict  # a class that imports but is no Tool


# --- Calculator -----------------------------------------------------------------------

@pytest.mark.parametrize(("expression", "expected"), [
    ("123 * 456", "56088"),
    ("987*654", "645498"),
    ("12345 * 6789", "83810205"),
    ("999 * 999", "998001"),
    ("-7 * 8", "-56"),
    ("-(3 + 4) * 2", "-14"),
    ("2 ** 100", "1267650600228229401496703205376"),
    ("2 ** -2", "0.25"),
    ("10 / 2", "5"),  # exact division stays an integer
    ("7 / 2", "3.5"),
    ("(1 / 3) * 3", "1"),
    ("1 / 3", "0.3333333333333333"),  # no finite decimal: the nearest float
    ("0.1 + 0.2", "0.3"),  # decimal literals are exact
    ("1.5 * 2", "3"),
    ("7 // 2", "3"),
    ("-7 // 2", "-4"),
    ("7 % 3", "1"),
    ("1.5e3 + 1", "1501"),
    ("2 ** 0.5", "1.4142135623730951"),
])
def test_calculator_is_exact(expression, expected):
    assert calculate(expression) == expected
    assert Calculator().execute("row", {"expression": expression}) == (expected, 0.0, {})


def test_calculator_big_products_are_exact():
    a, b = 123456789123456789, 987654321987654321
    assert calculate(f"{a} * {b}") == str(a * b)
    assert calculate("99999999999 ** 3") == "999999999970000000000299999999999"


@pytest.mark.parametrize(("expression", "message"), [
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("9 ** 9 ** 9", "more than 4000 digits"),  # refused before it is computed
    ("10 ** 5000", "more than 4000 digits"),
    ("2 ^ 3", r"use \*\* for powers"),
    ("x + 1", "unsupported element 'x'"),
    ("__import__('os')", "unsupported element"),
    ("'a' * 3", "unsupported element"),
    ("(-8) ** (1 / 3)", "not a real number"),
    ("2 +", "invalid expression"),
])
def test_calculator_refusals(expression, message):
    with pytest.raises(ToolError, match=message):
        calculate(expression)


def test_calculator_config_limits():
    tool = Calculator({"max_length": 10, "type": "native"})
    with pytest.raises(ToolError, match="longer than 10"):
        tool.execute("row", {"expression": "1 + 2 + 3 + 4"})
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['max_len'\]"):
        Calculator({"max_len": 10})


# --- PythonExpression -----------------------------------------------------------------

def test_python_expression_results():
    tool = PythonExpression()
    assert tool.name == "python"
    assert tool.execute("row", {"code": "sum(i * i for i in range(10))"})[0] == "285"
    assert tool.execute("row", {"expression": "factorial(20)"})[0] == "2432902008176640000"
    assert tool.execute("row", {"code": "round(math.sqrt(2), 4)"})[0] == "1.4142"
    assert tool.execute("row", {"code": "sorted([3, 1, 2])"})[0] == "[1, 2, 3]"
    assert tool.execute("row", {"code": "str(7)"})[0] == "'7'"


@pytest.mark.parametrize(("code", "message"), [
    ("import os", "imports are not allowed"),
    ("__import__('os')", "name '__import__' is not allowed"),
    ("().__class__.__bases__", "attribute '__class__' is not allowed"),
    ("'{0.__class__}'.format(1)", "attribute 'format' is not allowed"),
    ("open('/etc/passwd').read()", "NameError: name 'open' is not defined"),
    ("eval('1')", "NameError: name 'eval' is not defined"),
    ("x = 1", "only a single expression"),
    ("1 / 0", "ZeroDivisionError: division by zero"),
])
def test_python_expression_refusals(code, message):
    with pytest.raises(ToolError, match=message):
        PythonExpression().execute("row", {"code": code})


def test_python_expression_is_killed_at_its_time_limit(monkeypatch):
    started = []
    popen = subprocess.Popen

    def recording_popen(*args, **kwargs):
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", recording_popen)
    tool = PythonExpression({"timeout_s": 0.5})
    start = time.perf_counter()
    with pytest.raises(ToolError, match="time limit of 0.5 s"):
        tool.execute("row", {"code": "sum(range(10 ** 18))"})  # would run for years
    assert time.perf_counter() - start < 1.5
    (child,) = started
    assert child.poll() is not None  # killed and reaped
    with pytest.raises(ProcessLookupError):
        os.kill(child.pid, 0)


def test_python_expression_memory_and_output_limits():
    tool = PythonExpression({"memory_mb": 256, "max_output_chars": 20})
    with pytest.raises(ToolError, match="MemoryError"):
        tool.execute("row", {"code": "[0] * 10 ** 10"})
    text = tool.execute("row", {"code": "list(range(100))"})[0]
    assert text.startswith("[0, 1, 2, 3, 4, 5, 6") and text.endswith("more characters]")


def test_python_expression_config_is_checked():
    with pytest.raises(ConfigError, match="timeout_s must be a positive number"):
        PythonExpression({"timeout_s": 0})


# --- Parsing --------------------------------------------------------------------------

def test_hermes_one_and_two_calls():
    one = ('I will compute it.\n<tool_call>\n{"name": "calculator", "arguments": '
           '{"expression": "2 + 2"}}\n</tool_call>')
    assert parse_tool_calls(one, "hermes") == (
        [ToolCall("calculator", {"expression": "2 + 2"})], [])
    two = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}}\n'
           '</tool_call>\n<tool_call>\n{"name": "python", "arguments": {"code": "2"}}\n'
           '</tool_call><|im_end|>')
    calls, errors = parse_tool_calls(two, "hermes")
    assert [c.name for c in calls] == ["calculator", "python"]
    assert calls[1].arguments == {"code": "2"} and errors == []


def test_hermes_without_markup_and_string_arguments():
    assert parse_tool_calls("The answer is 4.", "hermes") == ([], [])
    text = ('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"3*3\\"}"}'
            '</tool_call>')
    assert parse_tool_calls(text, "hermes") == ([ToolCall("calculator", {"expression": "3*3"})],
                                                [])


@pytest.mark.parametrize(("text", "message"), [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": }</tool_call>',
     "tool call 1: malformed JSON"),
    ('<tool_call>{"arguments": {"expression": "1"}}</tool_call>', "missing the tool's \"name\""),
    ('<tool_call>{"name": "calculator", "arguments": [1, 2]}</tool_call>',
     "arguments must be a JSON object, got list"),
    ('<tool_call>{"name": "calculator", "arguments": "not json"}</tool_call>',
     "arguments are a string that is not JSON"),
    ('<tool_call>["calculator"]</tool_call>', "expected a JSON object, got list"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"', "never closed"),
])
def test_hermes_malformed_calls(text, message):
    calls, errors = parse_tool_calls(text, "hermes")
    assert calls == []
    assert len(errors) == 1 and message in errors[0], errors


def test_hermes_good_call_survives_a_bad_one():
    text = ('<tool_call>{"name": broken}</tool_call>\n'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "5"}}</tool_call>')
    calls, errors = parse_tool_calls(text, "hermes")
    assert calls == [ToolCall("calculator", {"expression": "5"})]
    assert len(errors) == 1 and errors[0].startswith("tool call 1:")


def test_llama3_calls():
    tagged = ('<|python_tag|>{"name": "calculator", "parameters": {"expression": "6*7"}}'
              '<|eom_id|>')
    assert parse_tool_calls(tagged, "llama3") == (
        [ToolCall("calculator", {"expression": "6*7"})], [])
    bare = '{"name": "python", "arguments": {"code": "1; 2"}}'  # ";" inside a string
    assert parse_tool_calls(bare, "llama3") == ([ToolCall("python", {"code": "1; 2"})], [])
    several = ('{"name": "a", "parameters": {"x": "1"}}; '
               '{"name": "b", "parameters": {}}')
    assert [c.name for c in parse_tool_calls(several, "llama3")[0]] == ["a", "b"]
    assert parse_tool_calls("The answer is 42.", "llama3") == ([], [])


def test_llama3_malformed():
    calls, errors = parse_tool_calls('<|python_tag|>{"name": "a", "parameters": ', "llama3")
    assert calls == [] and "malformed JSON" in errors[0]
    calls, errors = parse_tool_calls('{"parameters": {"x": 1}}', "llama3")
    assert calls == [] and "missing the tool's \"name\"" in errors[0]
    calls, errors = parse_tool_calls('{"name": "a", "parameters": {}} and more', "llama3")
    assert calls == [ToolCall("a", {})] and "expected ';'" in errors[0]


def test_unknown_format():
    with pytest.raises(ConfigError, match="unknown tool-call format 'chatml'; known: hermes"):
        parse_tool_calls("", "chatml")


# --- Execution ------------------------------------------------------------------------

def _tools():
    return {"calculator": Calculator(),
            "sleepy": Sleepy({"sleep_s": 0.3}, _schema("sleepy", required=())),
            "raising": Raising({}, _schema("raising", required=())),
            "hanging": Sleepy({"sleep_s": 5}, _schema("hanging", required=()))}


def test_execute_calls_mixed_batch():
    calls = [ToolCall("calculator", {"expression": "987*654"}),
             ToolCall("raising", {}),
             ToolCall("foo", {"a": 1}),
             ToolCall("calculator", {}),
             ToolCall("calculator", {"expression": 12}),
             ToolCall("calculator", {"expression": "1/0"})]
    results = execute_calls(calls, _tools(), ["row0"] * 3 + ["row1"] * 3, timeout_s=2.0,
                            max_workers=4)
    assert [r.name for r in results] == [c.name for c in calls]
    assert results[0].text == "645498" and results[0].error is None
    assert results[1].text == "Error: KeyError: 'no such key'"
    assert results[2].text == ("Error: unknown tool 'foo'; available tools: calculator, "
                               "hanging, raising, sleepy")
    assert "missing required argument 'expression'" in results[3].text
    assert "argument 'expression' must be of type string, got int 12" in results[4].text
    assert results[5].text == "Error: division by zero"
    assert [r.error is None for r in results] == [True] + [False] * 5
    assert all(r.reward == 0.0 and r.latency_s >= 0 for r in results)
    metrics = call_metrics(results)
    assert metrics["tools/calls"] == 6 and metrics["tools/errors"] == 5
    assert metrics["tools/timeouts"] == 0


def test_missing_argument_never_reaches_execute():
    seen = []

    class Recording(Tool):
        def execute(self, instance_id, arguments):
            seen.append(arguments)
            return "ran", 0.0, {}

    tools = {"rec": Recording({}, _schema("rec", required=("query",)))}
    (result,) = execute_calls([ToolCall("rec", {"other": "x"})], tools, ["r"], 1.0, 2)
    assert result.text == ("Error: bad arguments for tool 'rec': missing required argument "
                           "'query'")
    assert seen == []


def test_hanging_tool_is_answered_on_time():
    start = time.perf_counter()
    calls = [ToolCall("hanging", {}), ToolCall("calculator", {"expression": "1+1"})]
    results = execute_calls(calls, _tools(), ["r", "r"], timeout_s=0.3, max_workers=2)
    assert time.perf_counter() - start < 2.0
    assert results[0].text == "Error: tool 'hanging' timed out after 0.3 s"
    assert results[0].timed_out and results[0].error is not None
    assert results[1].text == "2"
    # The abandoned call's thread is a daemon: it cannot hold up the interpreter's exit.
    assert all(t.daemon for t in threading.enumerate() if t.name == "jrl-tool-hanging")


def test_calls_run_in_parallel():
    calls = [ToolCall("sleepy", {})] * 4
    start = time.perf_counter()
    results = execute_calls(calls, _tools(), ["a", "b", "c", "d"], timeout_s=2.0, max_workers=4)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, elapsed
    assert [r.text for r in results] == ["slept"] * 4
    chex.assert_trees_all_close(np.array([r.reward for r in results]), np.full(4, 0.5))
    assert all(0.25 < r.latency_s < 1.0 for r in results)


def test_python_calls_run_in_parallel_processes():
    tools = {"python": PythonExpression()}
    calls = [ToolCall("python", {"code": f"{i} * {i}"}) for i in range(4)]
    results = execute_calls(calls, tools, ["r"] * 4, timeout_s=5.0, max_workers=4)
    assert [r.text for r in results] == ["0", "1", "4", "9"]


def test_tool_messages_keep_call_order():
    results = execute_calls([ToolCall("calculator", {"expression": "6*7"}), ToolCall("foo", {})],
                            _tools(), ["r", "r"], timeout_s=1.0, max_workers=2)
    assert tool_messages(results) == [
        {"role": "tool", "name": "calculator", "content": "42"},
        {"role": "tool", "name": "foo", "content": results[1].text},
    ]
    assert tool_messages([]) == [] and execute_calls([], _tools(), [], 1.0, 2) == []


def test_instances_carry_row_state_and_rewards():
    tools = {"counter": Counter({}, _schema("counter", required=())), "calculator": Calculator()}
    create_instances(tools, "row0", {"counter": {"create_kwargs": {"start": 10}}})
    create_instances(tools, "row1", {"counter": {"create_kwargs": {"start": 100}}})
    calls = [ToolCall("counter", {})] * 3
    results = execute_calls(calls, tools, ["row0", "row0", "row1"], 1.0, 1)
    assert sorted(r.text for r in results[:2]) == ["11", "12"] and results[2].text == "101"
    assert release_instances(tools, "row0") == {"counter": 2.0, "calculator": 0.0}
    assert "row0" not in tools["counter"].instances and "row1" in tools["counter"].instances
    with pytest.raises(DataError, match=r"tools_kwargs\.counter\.create_kwargs must be a "):
        create_instances(tools, "row2", {"counter": {"create_kwargs": [10]}})


def test_kwargs_of_tools_not_loaded_are_ignored(caplog, monkeypatch):
    """As verl's tool agent loop: a row may name tools of another tool set (the
    `tool_multiplication` rows name the calculator); only loaded tools get kwargs, and
    the unknown names are logged once."""
    from jrl.tools import execute

    monkeypatch.setattr(execute, "_IGNORED_NAMES", set())
    tools = {"counter": Counter({}, _schema("counter", required=()))}
    row = {"counter": {"create_kwargs": {"start": 5}},
           "calculator": {"create_kwargs": {"ground_truth": "42"}}}
    create_instances(tools, "row0", row)
    create_instances(tools, "row1", row)
    assert tools["counter"].instances == {"row0": {"start": 5}, "row1": {"start": 5}}
    warnings = [r.getMessage() for r in caplog.records if "tools_kwargs" in r.getMessage()]
    assert warnings == ["extra_info.tools_kwargs names tool(s) ['calculator'] that the tool "
                        "config does not load (loaded: ['counter']); their create_kwargs "
                        "are ignored"]


def test_calculator_ignores_a_ground_truth():
    calculator = Calculator()
    create_instances({"calculator": calculator}, "row0",
                     {"calculator": {"create_kwargs": {"ground_truth": "56088"}}})
    [result] = execute_calls([ToolCall("calculator", {"expression": "123*456"})],
                             {"calculator": calculator}, ["row0"], 1.0)
    assert (result.text, result.reward, result.error) == ("56088", 0.0, None)
    assert release_instances({"calculator": calculator}, "row0") == {"calculator": 0.0}


def test_tool_base_defaults():
    tool = Tool({}, _schema("bare", required=()))
    instance = tool.create()
    assert tool.name == "bare" and instance in tool.instances
    assert tool.calc_reward(instance) == 0.0
    tool.release(instance)
    tool.release(instance)  # twice is harmless
    assert tool.instances == {}
    (result,) = execute_calls([ToolCall("bare", {})], {"bare": tool}, ["i"], 1.0, 1)
    assert result.text == "Error: NotImplementedError: Tool does not define execute"
    with pytest.raises(ConfigError, match="Tool has no default schema"):
        Tool({})


# --- Config files ---------------------------------------------------------------------

_YAML = """
tools:
  - class_name: jrl.tools.Calculator
    config: {type: native, max_digits: 100}
  - class_name: jrl.tools.PythonExpression
    config:
      type: native
      timeout_s: 0.5
  - class_name: tests.tools.test_tools.Sleepy
    config: {sleep_s: 0.01}
    tool_schema:
      type: function
      function:
        name: nap
        description: Sleeps a little.
        parameters:
          type: object
          properties: {minutes: {type: integer, description: How long.}}
          required: [minutes]
"""


def _write(tmp_path, text, name="tools.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_load_tools_from_yaml(tmp_path):
    tools = load_tools(_write(tmp_path, _YAML))
    assert list(tools) == ["calculator", "python", "nap"]
    assert isinstance(tools["calculator"], Calculator)
    assert tools["calculator"].config["max_digits"] == 100
    assert tools["python"].config["timeout_s"] == 0.5
    assert tools["nap"].schema["function"]["parameters"]["required"] == ["minutes"]
    results = execute_calls([ToolCall("nap", {"minutes": 1}), ToolCall("nap", {})], tools,
                            ["r", "r"], 1.0, 2)
    assert results[0].text == "slept" and "missing required argument 'minutes'" in results[1].text


def test_load_tools_from_json(tmp_path):
    document = {"tools": [{"class_name": "jrl.tools.Calculator", "config": {}}]}
    path = _write(tmp_path, json.dumps(document), "tools.json")
    assert list(load_tools(str(path))) == ["calculator"]
    assert load_tools(_write(tmp_path, "", "empty.yaml")) == {}


_NAP = "\n  tool_schema: {type: function, function: {name: nap, parameters: {type: object}}}"


@pytest.mark.parametrize(("entries", "message"), [
    ("- class_name: jrl.tools.Nope", r"tools\[0\]: class_name 'jrl.tools.Nope' cannot be "
                                     "imported: AttributeError"),
    ("- class_name: no_such_package.Tool", "cannot be imported: ModuleNotFoundError"),
    ("- class_name: Calculator", r"must be a dotted import path \(e.g. jrl.tools.Calculator\) "
                                 r"or 'path/to/file.py:ClassName'"),
    ("- class_name: tests.tools.test_tools.NotATool" + _NAP, "is not a subclass of jrl.tools.Tool"),
    ("- class_name: jrl.tools.Calculator\n- class_name: jrl.tools.Calculator",
     r"tools\[1\] \(jrl.tools.Calculator\): tool name 'calculator' is already used by "
     r"tools\[0\]"),
    ("- class_name: tests.tools.test_tools.Sleepy", "no tool_schema, and the class has no "
                                                    "default schema"),
    ("- class_name: tests.tools.test_tools.Sleepy\n  tool_schema: {type: function, function: "
     "{parameters: {type: object}}}", "tool_schema.function.name is missing"),
    ("- class_name: tests.tools.test_tools.Sleepy\n  tool_schema: {type: function, function: "
     "{name: nap}}", "tool_schema.function.parameters is missing"),
    ("- class_name: jrl.tools.PythonExpression\n  config: {timeout: 3}",
     r"constructing the tool failed: ConfigError: .*unknown key\(s\) \['timeout'\]"),
    ("- config: {}", r"tools\[0\]: expected a mapping with 'class_name'"),
    ("- class_name: jrl.tools.Calculator\n  schema: {}", r"unknown key\(s\) \['schema'\]"),
])
def test_load_tools_errors_name_file_and_entry(tmp_path, entries, message):
    path = _write(tmp_path, "tools:\n" + textwrap.indent(entries, "  "))
    with pytest.raises(ConfigError, match=message) as info:
        load_tools(path)
    assert str(info.value).startswith(f"tool config {path}: tools[")


_TOOL_FILE = """
from jrl.tools import Tool


class Echo(Tool):
    default_schema = {"type": "function", "function": {
        "name": "echo", "parameters": {"type": "object", "properties": {
            "text": {"type": "string"}}, "required": ["text"]}}}
    config_defaults = {"times": 1}

    def execute(self, instance_id, arguments):
        return arguments["text"] * self.config["times"], 0.0, {}


NOT_A_CLASS = 3
"""


def test_a_tool_class_named_by_its_file(tmp_path, monkeypatch):
    """`path/to/file.py:Class` as reward.custom_fn names a function: nothing on PYTHONPATH,
    a relative path taken from the current directory."""
    (tmp_path / "my_tools").mkdir()
    (tmp_path / "my_tools" / "echo.py").write_text(_TOOL_FILE)
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path, """
        tools:
          - class_name: my_tools/echo.py:Echo
            config: {times: 2}
        """)
    tools = load_tools(path)
    assert list(tools) == ["echo"] and type(tools["echo"]).__name__ == "Echo"
    assert execute_calls([ToolCall("echo", {"text": "ab"})], tools, ["r"], 1.0, 1)[0].text == "abab"


@pytest.mark.parametrize(("class_name", "message"), [
    ("my_tools/echo.py:Ecko", r"class_name: '.*echo.py' defines no 'Ecko'; its public classes "
                              r"are \['Echo', 'Tool'\]"),
    ("my_tools/echo.py:NOT_A_CLASS", "class_name 'my_tools/echo.py:NOT_A_CLASS' is not a "
                                     "subclass of jrl.tools.Tool"),
    ("my_tools/nowhere.py:Echo", r"class_name: file 'my_tools/nowhere.py' .* does not exist"),
    ("my_tools/echo.txt:Echo", r"'my_tools/echo.txt' is not a .py file"),
])
def test_a_bad_tool_file_spec_is_named(tmp_path, monkeypatch, class_name, message):
    (tmp_path / "my_tools").mkdir()
    (tmp_path / "my_tools" / "echo.py").write_text(_TOOL_FILE)
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path, f"tools:\n  - class_name: {class_name}\n")
    with pytest.raises(ConfigError, match=message) as info:
        load_tools(path)
    assert str(info.value).startswith(f"tool config {path}: tools[0]")


def test_load_tools_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="missing.yaml: file not found"):
        load_tools(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="cannot parse it"):
        load_tools(_write(tmp_path, "tools: [unclosed"))
    with pytest.raises(ConfigError, match="expected a mapping with a 'tools' list"):
        load_tools(_write(tmp_path, "tools: {class_name: jrl.tools.Calculator}"))
