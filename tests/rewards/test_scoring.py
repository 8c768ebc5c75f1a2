"""Custom reward functions by path, the (parallel) RewardScorer, DAPO's overlong penalty."""

import os
import textwrap

import numpy as np
import pytest

from jrl.rewards.custom import load_custom_fn
from jrl.rewards.overlong import overlong_extras, overlong_penalty
from jrl.rewards.scoring import RewardScorer

CUSTOM = textwrap.dedent('''
    import math
    import os
    import sys

    LIMIT = 3

    def reward(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "boom":
            raise ZeroDivisionError("boom on purpose")
        if solution_str == "nan":
            return math.nan
        if solution_str == "nokey":
            return {"acc": 1.0}
        if solution_str == "text":
            return "1.0"
        weight = (extra_info or {}).get("weight", 1)
        score = weight * len(solution_str) / 7 + (solution_str == ground_truth)
        return {"score": score, "acc": float(solution_str == ground_truth),
                "exact": solution_str == ground_truth, "note": "ignored, not a number",
                "pid": os.getpid(), "jax_loaded": "jax" in sys.modules}

    def plain(data_source, solution_str, ground_truth, extra_info=None):
        return len(solution_str)
''')


@pytest.fixture(scope="module")
def custom_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("custom") / "my_reward.py"
    path.write_text(CUSTOM)
    return path


ROWS = [
    {"data_source": "a", "reward_model": {"ground_truth": "xy"}, "extra_info": {"weight": 2}},
    {"data_source": "b", "reward_model": {"ground_truth": "z"}},
    {"data_source": "c", "reward_model": {"ground_truth": "q"}, "extra_info": {"weight": 3}},
]
# Sample i answers row i // 2.
TEXTS = ["xy", "abc", "z", "", "q", "qq"]


def _expected_scores():
    weights, truths = [2, 2, 1, 1, 3, 3], ["xy", "xy", "z", "z", "q", "q"]
    return np.array([w * len(t) / 7 + (t == g)
                     for w, t, g in zip(weights, TEXTS, truths, strict=True)], np.float32)


# --------------------------------------------------------------------------- custom functions


def test_load_custom_fn(custom_file):
    fn = load_custom_fn(f"{custom_file}:plain")
    assert fn("s", "four", None) == 4
    assert load_custom_fn(f"{custom_file}:plain") is fn  # imported once per process


@pytest.mark.parametrize(("spec", "error", "match"), [
    ("no_colon_here", ValueError, "must be 'path/to/file.py:function_name'"),
    ("file.txt:fn", ValueError, "'file.txt' is not a .py file"),
    ("file.py:", ValueError, "Python identifier"),
    ("file.py:not-a-name", ValueError, "Python identifier"),
    ("missing_dir/reward.py:fn", FileNotFoundError, "missing_dir/reward.py"),
])
def test_load_custom_fn_spec_errors(spec, error, match):
    with pytest.raises(error, match=match):
        load_custom_fn(spec)


def test_load_custom_fn_import_and_name_errors(custom_file, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ImportError, match=r"broken.py' failed: ModuleNotFoundError"):
        load_custom_fn(f"{broken}:fn")
    with pytest.raises(ValueError, match=r"defines no 'rewrd'.*\['plain', 'reward'\]"):
        load_custom_fn(f"{custom_file}:rewrd")
    with pytest.raises(TypeError, match="'LIMIT' .* is a int, not a function"):
        load_custom_fn(f"{custom_file}:LIMIT")


# --------------------------------------------------------------------------- scorer


def test_serial_scores_extras_and_row_mapping(custom_file):
    with RewardScorer(f"{custom_file}:reward") as scorer:
        result = scorer.score(ROWS, TEXTS, n=2)
    np.testing.assert_array_equal(result.scores, _expected_scores())
    assert result.scores.dtype == np.float32 and result.num_errors == 0
    np.testing.assert_array_equal(result.extras["acc"], [1, 0, 1, 0, 1, 0])
    np.testing.assert_array_equal(result.extras["exact"], [1, 0, 1, 0, 1, 0])  # bool -> float
    assert "note" not in result.extras
    assert set(result.extras["pid"]) == {os.getpid()}


def test_float_results_and_default_dispatch(custom_file):
    with RewardScorer(f"{custom_file}:plain") as scorer:
        result = scorer.score(ROWS, TEXTS, n=2)
    np.testing.assert_array_equal(result.scores, [2, 3, 1, 0, 1, 2])
    assert result.extras == {}
    rows = [{"data_source": "openai/gsm8k", "reward_model": {"ground_truth": "7"}}]
    result = RewardScorer(None).score(rows, ["#### 7", "#### 8", "7"], n=3)
    np.testing.assert_array_equal(result.scores, [1, 0, 0])
    np.testing.assert_array_equal(result.extras["acc"], [1, 0, 0])


def test_parallel_equals_serial_and_runs_in_spawned_workers(custom_file):
    texts = ["boom" if i % 7 == 3 else "x" * (i % 5) for i in range(60)]
    rows = [{**ROWS[i % 3], "extra_info": {"weight": i % 4}} for i in range(20)]
    spec = f"{custom_file}:reward"
    serial = RewardScorer(spec, on_error="score", error_score=-1.0).score(rows, texts, n=3)
    with RewardScorer(spec, num_workers=2, on_error="score", error_score=-1.0) as scorer:
        pending = scorer.submit(rows, texts, n=3)
        parallel = pending.result()
    np.testing.assert_array_equal(parallel.scores, serial.scores)
    assert parallel.extras.keys() == serial.extras.keys()
    for key in ("acc", "exact"):
        np.testing.assert_array_equal(parallel.extras[key], serial.extras[key])
    assert parallel.num_errors == serial.num_errors == sum(t == "boom" for t in texts) > 0
    assert np.all(serial.scores[[t == "boom" for t in texts]] == -1.0)
    # Scored in other processes that never imported JAX (spawned, not forked from pytest).
    worker_pids = set(parallel.extras["pid"][parallel.extras["pid"] > 0])
    assert worker_pids and os.getpid() not in worker_pids
    assert not parallel.extras["jax_loaded"].any()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_raise_names_sample_source_and_exception(custom_file, num_workers):
    texts = ["xy", "abc", "z", "boom", "q", "qq"]
    with RewardScorer(f"{custom_file}:reward", num_workers=num_workers) as scorer:
        with pytest.raises(RuntimeError, match=r"sample 3 \(data_source='b'\): "
                                               r"ZeroDivisionError: boom on purpose"):
            scorer.score(ROWS, texts, n=2)


@pytest.mark.parametrize(("text", "match"), [
    ("nan", "non-finite score nan"),
    ("nokey", r"dict without 'score' \(keys: \['acc'\]\)"),
    ("text", "score of type str"),
])
def test_bad_return_values_are_errors(custom_file, text, match):
    scorer = RewardScorer(f"{custom_file}:reward")
    with pytest.raises(RuntimeError, match=match):
        scorer.score(ROWS[:1], [text], n=1)
    lenient = RewardScorer(f"{custom_file}:reward", on_error="score", error_score=0.5)
    result = lenient.score(ROWS[:1], [text, "xy"], n=2)
    np.testing.assert_array_equal(result.scores, np.float32([0.5, 2 * 2 / 7 + 1]))
    assert result.num_errors == 1 and "sample 0 (data_source='a')" in result.first_error


def test_scorer_argument_errors(custom_file):
    with pytest.raises(ValueError, match="on_error='ignore'"):
        RewardScorer(None, on_error="ignore")
    with pytest.raises(ValueError, match="num_workers=-1"):
        RewardScorer(None, num_workers=-1)
    with pytest.raises(FileNotFoundError, match="nope.py"):
        RewardScorer("nope.py:fn")
    scorer = RewardScorer(f"{custom_file}:plain")
    with pytest.raises(ValueError, match=r"5 responses for 3 prompts with n=2; expected 3 \* 2"):
        scorer.score(ROWS, TEXTS[:5], n=2)
    scorer.close()
    scorer.close()
    with pytest.raises(RuntimeError, match="after close"):
        scorer.score(ROWS, TEXTS, n=2)


# --------------------------------------------------------------------------- overlong penalty


def test_overlong_penalty_golden():
    # L_max = 20, B = 4: expected length 16; each token past 16 costs f / 4.
    lengths = np.array([0, 10, 16, 17, 18, 20])
    np.testing.assert_allclose(overlong_penalty(lengths, 20, 4, 1.0),
                               [0, 0, 0, -0.25, -0.5, -1.0])
    np.testing.assert_allclose(overlong_penalty(lengths, 20, 4, 0.5),
                               [0, 0, 0, -0.125, -0.25, -0.5])
    # B = L_max: every token costs.
    np.testing.assert_allclose(overlong_penalty(np.array([0, 5, 10]), 10, 10, 2.0),
                               [0, -1.0, -2.0])
    assert overlong_penalty(lengths, 20, 4, 1.0).dtype == np.float32


def test_overlong_extras_and_errors():
    extras = overlong_extras(np.array([0.0, -0.25]))
    np.testing.assert_array_equal(extras["overlong_reward"], [0.0, -0.25])
    np.testing.assert_array_equal(extras["overlong"], [0.0, 1.0])
    with pytest.raises(ValueError, match=r"overlong_buffer.len=0 must be in \(0, "):
        overlong_penalty(np.array([1]), 10, 0, 1.0)
    with pytest.raises(ValueError, match="overlong_buffer.len=11 .*rollout.response_length=10"):
        overlong_penalty(np.array([1]), 10, 11, 1.0)
    with pytest.raises(ValueError, match="penalty_factor=-1"):
        overlong_penalty(np.array([1]), 10, 2, -1.0)
