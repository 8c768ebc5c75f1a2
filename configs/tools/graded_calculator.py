"""A calculator that grades its calls, as verl's GSM8K tool grades answers.

A user tool, loaded by file (configs/tools/graded_calculator.yaml:
`class_name: configs/tools/graded_calculator.py:GradedCalculator`, a path taken from
the directory the run starts in). Each row's instance gets the row's answer,
`extra_info.tools_kwargs.calculator.create_kwargs.ground_truth` (the
`tool_multiplication` rows carry it). A call computes as `jrl.tools.Calculator` does;
a result equal to the answer solves the row. As verl's `Gsm8kTool` penalises an
answer that does not improve on the last, the step reward is 0 for the call that
first solves the row and -0.05 for every other call (a wrong result, or any call
after the row is solved); `calc_reward` is 1 for a solved row, else 0. A call the
calculator refuses (bad syntax) is an error: jrl gives it step reward 0.

    python -m jrl.train --config=configs/grpo_tool_calc.py \\
        --config.rollout.multi_turn.tool_config_path=configs/tools/graded_calculator.yaml \\
        --config.rollout.multi_turn.add_tool_rewards=True
"""

from __future__ import annotations

import threading

import jrl.tools
from jrl.errors import DataError

PENALTY = -0.05  # verl's Gsm8kTool: a call that does not newly solve the row


class GradedCalculator(jrl.tools.Calculator):
    """`jrl.tools.Calculator` (schema name "calculator") with verl GSM8K-style rewards."""

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        super().__init__(config, tool_schema)
        self._lock = threading.Lock()  # one row's calls may run at once

    def create(self, instance_id: str | None = None, **kwargs) -> str:
        """Keeps the row's `ground_truth` (required) and starts it unsolved.

        Raises:
          DataError: no `ground_truth` in the row's create_kwargs.
        """
        if kwargs.get("ground_truth") is None:
            raise DataError(f"{type(self).__name__} needs each row's answer in "
                            "extra_info.tools_kwargs.calculator.create_kwargs.ground_truth")
        instance_id = super().create(instance_id, **kwargs)
        self.instances[instance_id] = {"ground_truth": str(kwargs["ground_truth"]).strip(),
                                       "solved": False}
        return instance_id

    def execute(self, instance_id: str, arguments: dict) -> tuple[str, float, dict]:
        """The calculator's text; step reward 0 when this call first solves the row, else
        -0.05; metrics {"solved": 0 or 1} (the call's result equals the answer)."""
        text, _, _ = super().execute(instance_id, arguments)
        state = self.instances[instance_id]
        correct = text.strip() == state["ground_truth"]
        with self._lock:
            newly_solved = correct and not state["solved"]
            state["solved"] = state["solved"] or correct
        return text, 0.0 if newly_solved else PENALTY, {"solved": float(correct)}

    def calc_reward(self, instance_id: str) -> float:
        """1.0 when a call computed the row's answer, else 0.0."""
        return 1.0 if self.instances[instance_id]["solved"] else 0.0
