"""The host side of a step's rewards: responses decoded, scores placed at the last token,
the dynamic-sampling metric picked by verl's names."""

import types

import numpy as np
import pytest

from jrl.data.tokenizers import CharTokenizer
from jrl.rewards.responses import ResponseScorer, decode_responses, filter_metric, place_scores
from jrl.rewards.scoring import RewardScorer


def test_place_scores_at_last_valid_token():
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    out = place_scores(np.array([0.5, 1.0, 2.0]), mask)
    np.testing.assert_array_equal(out, [[0, 0, 0.5, 0], [1, 0, 0, 0], [0, 0, 0, 2]])


def test_filter_metric_follows_verl_names():
    """"seq_reward" is the shaped sequence reward, "score" the reward function's own,
    "acc" its field or (for a function returning a number) the score itself."""
    shaped, raw = np.array([1.0, 0.5]), np.array([1.0, 1.0])
    np.testing.assert_array_equal(filter_metric("seq_reward", shaped, {"score": raw}), [1.0, 0.5])
    np.testing.assert_array_equal(filter_metric("score", shaped, {"score": raw}), [1.0, 1.0])
    np.testing.assert_array_equal(filter_metric("acc", shaped, {}), [1.0, 0.5])
    acc = np.array([0.0, 1.0])
    np.testing.assert_array_equal(filter_metric("acc", shaped, {"acc": acc}), [0, 1])
    with pytest.raises(ValueError, match="filter_groups.metric='digits'"):
        filter_metric("digits", shaped, {})


def test_decode_responses_drops_the_stop_token_and_padding():
    tok = CharTokenizer()
    ids = [*tok.encode("12"), tok.eos_token_ids[0], tok.pad_token_id]
    responses = np.array([ids, ids])
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert decode_responses(tok, responses, mask) == ["12", "1"]


_TOOL_ROWS = [
    {"data_source": "t", "reward_model": {"ground_truth": "12"}, "extra_info": {"a": 1}},
    {"data_source": "t", "reward_model": {"ground_truth": "7"}},
]
_TOOL_SCORES = [{"calc": 0.5, "judge": 0.0}, {"calc": 0.0, "judge": -0.25},
                {"calc": 1.0, "judge": 0.25}, {"calc": 0.0, "judge": 0.0}]


def _score_with_tools(add_tool_rewards, reward_scores):
    """Scores "12", "13" (row 0) and "7", "7" (row 1) with an exact-match function that
    records the extra_info it gets; returns (scores, extras, extra_infos)."""
    tok, seen = CharTokenizer(), []

    def exact(data_source, solution_str, ground_truth, extra_info):
        seen.append(extra_info)
        return float(solution_str == ground_truth)

    texts = ["12", "13", "7", "7"]
    responses = np.full((4, 3), tok.pad_token_id, np.int32)
    mask = np.zeros((4, 3), np.int32)
    for i, text in enumerate(texts):
        responses[i, :len(text)], mask[i, :len(text)] = tok.encode(text), 1
    settings = types.SimpleNamespace(overlong_buffer_len=0, error_score=0.0)
    scorer = ResponseScorer(tok, RewardScorer(exact), None, settings, max_new_tokens=3,
                            add_tool_rewards=add_tool_rewards)
    try:
        scores, extras, _, _ = scorer.submit(_TOOL_ROWS, responses, mask, 2, reward_scores)()
    finally:
        scorer.close()
    return scores, extras, seen


@pytest.mark.parametrize("add_tool_rewards", [False, True])
def test_tool_rewards_reach_the_reward_function_as_verls(add_tool_rewards):
    """Each sample's extra_info is its row's with verl's "rollout_reward_scores" (that
    sample's tool rewards by tool name); the rows are left as they were. Off (verl), the
    score is the function's; on, the function's plus the sum of the tool rewards."""
    scores, extras, seen = _score_with_tools(add_tool_rewards, _TOOL_SCORES)
    assert seen == [{"a": 1, "rollout_reward_scores": _TOOL_SCORES[0]},
                    {"a": 1, "rollout_reward_scores": _TOOL_SCORES[1]},
                    {"rollout_reward_scores": _TOOL_SCORES[2]},
                    {"rollout_reward_scores": _TOOL_SCORES[3]}]
    assert _TOOL_ROWS[0]["extra_info"] == {"a": 1} and "extra_info" not in _TOOL_ROWS[1]
    if add_tool_rewards:  # 1 + 0.5, 0 - 0.25, 1 + 1.25, 1 + 0
        np.testing.assert_array_equal(scores, [1.5, -0.25, 2.25, 1.0])
        np.testing.assert_array_equal(extras["score"], [1, 0, 1, 1])  # the function's own
    else:
        np.testing.assert_array_equal(scores, [1, 0, 1, 1])
        assert "score" not in extras


@pytest.mark.parametrize("add_tool_rewards", [False, True])
def test_single_turn_extra_info_is_the_rows(add_tool_rewards):
    """Without tool rewards (single-turn) the function gets the row's own extra_info."""
    scores, _, seen = _score_with_tools(add_tool_rewards, None)
    np.testing.assert_array_equal(scores, [1, 0, 1, 1])
    assert seen == [{"a": 1}, {"a": 1}, None, None]
