"""configs/tools/graded_calculator.py: a user tool with verl GSM8K-style rewards, loaded
by file from its yaml as a run from the repository root loads it."""

import os

import pytest

from jrl.errors import DataError
from jrl.tools import (
    Calculator,
    ToolCall,
    create_instances,
    execute_calls,
    load_tools,
    release_instances,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRADED_YAML = "configs/tools/graded_calculator.yaml"


@pytest.fixture
def tools(monkeypatch):
    """The graded yaml's tools, loaded from the repository root (its class_name is a
    path relative to the directory the run starts in)."""
    monkeypatch.chdir(REPO)
    return load_tools(GRADED_YAML)


def _rewards(tools, expressions, truth="56088"):
    """(step rewards of the calls in order, the rewards `release_instances` collects)."""
    create_instances(tools, "row0", {"calculator": {"create_kwargs": {"ground_truth": truth}}})
    steps = []
    for expression in expressions:  # one call per turn, as a row's turns run
        [result] = execute_calls([ToolCall("calculator", {"expression": expression})], tools,
                                 ["row0"], 1.0)
        assert result.error is None
        steps.append(result.reward)
    return steps, release_instances(tools, "row0")


def test_the_yaml_loads_a_calculator_under_the_calculators_name(tools):
    [(name, tool)] = tools.items()
    assert name == "calculator" and type(tool).__name__ == "GradedCalculator"
    assert isinstance(tool, Calculator) and tool.schema == Calculator.default_schema


def test_solved_on_the_first_call(tools):
    assert _rewards(tools, ["123*456"]) == ([0.0], {"calculator": 1.0})


def test_a_wrong_call_then_a_right_one(tools):
    assert _rewards(tools, ["123*465", "123*456"]) == ([-0.05, 0.0], {"calculator": 1.0})


def test_two_wrong_calls(tools):
    steps, end = _rewards(tools, ["123+456", "6*7"])
    assert steps == [-0.05, -0.05] and sum(steps) == pytest.approx(-0.1)
    assert end == {"calculator": 0.0}


def test_a_call_after_the_row_is_solved_is_penalised(tools):
    # Only the first solving call improves on the row: a repeat gets -0.05, as verl's.
    assert _rewards(tools, ["123*456", "56088"]) == ([0.0, -0.05], {"calculator": 1.0})


def test_the_calculators_answer_is_unchanged(tools):
    create_instances(tools, "r", {"calculator": {"create_kwargs": {"ground_truth": "408"}}})
    results = execute_calls([ToolCall("calculator", {"expression": "12*34"}),
                             ToolCall("calculator", {"expression": "1/0"})], tools, ["r", "r"],
                            1.0)
    assert [(r.text, r.reward, r.metrics) for r in results] == [
        ("408", 0.0, {"solved": 1.0}), ("Error: division by zero", 0.0, {})]


def test_rows_are_graded_apart(tools):
    for row, truth in (("a", "408"), ("b", "9801")):
        create_instances(tools, row, {"calculator": {"create_kwargs": {"ground_truth": truth}}})
    results = execute_calls([ToolCall("calculator", {"expression": "12*34"})] * 2, tools,
                            ["a", "b"], 1.0)
    assert [r.reward for r in results] == [0.0, -0.05]
    assert release_instances(tools, "a") == {"calculator": 1.0}
    assert release_instances(tools, "b") == {"calculator": 0.0}


def test_a_row_without_an_answer_is_named(tools):
    with pytest.raises(DataError, match=r"GradedCalculator needs each row's answer in "
                                        r"extra_info\.tools_kwargs\.calculator\.create_kwargs"):
        create_instances(tools, "r", None)
