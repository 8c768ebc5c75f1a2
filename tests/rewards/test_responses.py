"""The host side of a step's rewards: responses decoded, scores placed at the last token,
the dynamic-sampling metric picked by verl's names."""

import numpy as np
import pytest

from jrl.data.tokenizers import CharTokenizer
from jrl.rewards.responses import decode_responses, filter_metric, place_scores


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
