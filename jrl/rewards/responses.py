"""The host's part of a step: responses come off the devices, are decoded and scored,
and the scores go back as token-level rewards.

Scoring starts as soon as the responses are on the host and runs in a background
thread (and in the scorer's worker processes), so the device programs that follow
the rollout overlap it; `ResponseScorer.submit` returns a function that waits.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Sequence

import numpy as np

from jrl import sharding
from jrl.data.dataset import Row
from jrl.errors import ConfigError
from jrl.rewards import overlong, scoring

# What `ResponseScorer.submit`'s function returns: (scores [N] with DAPO's overlong
# penalty and, with `add_tool_rewards`, the tools' rewards; extras {name: [N]}
# (extras["score"] is then the reward function's own score); the number of failed
# reward calls; the response texts).
Scored = tuple[np.ndarray, dict[str, np.ndarray], int, list[str]]


def decode_responses(tokenizer, responses: np.ndarray, response_mask: np.ndarray) -> list[str]:
    """Response texts without the stop token and padding."""
    out = []
    for ids, mask in zip(responses, response_mask, strict=True):
        ids = ids[mask > 0].tolist()
        out.append(tokenizer.decode(ids, skip_special_tokens=True))
    return out


def place_scores(scores: np.ndarray, response_mask: np.ndarray) -> np.ndarray:
    """Token-level scores `[N, R]`: each score at its row's last valid response token
    (the last the model wrote, where a multi-turn loss mask has gaps; 0 in an empty row)."""
    out = np.zeros(response_mask.shape, np.float32)
    valid = np.asarray(response_mask) > 0
    last = np.where(valid.any(-1), valid.shape[-1] - 1 - np.argmax(valid[:, ::-1], axis=-1), 0)
    out[np.arange(len(scores)), last] = scores
    return out


def filter_metric(name: str, scores: np.ndarray, extras: dict[str, np.ndarray]) -> np.ndarray:
    """What must vary within a group for dynamic sampling, by verl's names:
    "seq_reward" / "seq_final_reward" the sequence's reward (with the overlong penalty),
    "score" the reward function's score, "acc" its "acc" field (the score itself when
    it returns a number)."""
    if name in ("seq_reward", "seq_final_reward"):
        return scores
    if name in extras:
        return extras[name]
    if name in ("score", "acc"):
        return extras.get("score", scores)
    raise ConfigError(f"algorithm.filter_groups.metric={name!r} is not among the reward's "
                      f"fields {['score', 'seq_reward', *sorted(extras)]}")


class ResponseScorer:
    """Scores a rollout's responses with rule rewards (a `scoring.RewardScorer`) or a
    reward model, adding DAPO's overlong penalty when configured.

    Args:
      tokenizer: decodes the responses.
      scorer: the rule scorer (parallel workers, error policy).
      reward_model: a `jrl.rewards.reward_model.RewardModel` whose scores replace the
        rule rewards (None: rule rewards).
      settings: `Settings.reward`.
      max_new_tokens: the rollout's response length (the overlong penalty's limit).
      add_tool_rewards: add the sum of a multi-turn response's tool rewards to its
        score (`rollout.multi_turn.add_tool_rewards`).
    """

    def __init__(self, tokenizer, scorer: scoring.RewardScorer, reward_model, settings,
                 max_new_tokens: int, add_tool_rewards: bool = False):
        self.tokenizer, self.scorer, self.reward_model = tokenizer, scorer, reward_model
        self.settings, self.max_new_tokens = settings, max_new_tokens
        self.add_tool_rewards = add_tool_rewards
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "jrl-reward")

    def submit(self, rows: Sequence[Row], responses, response_mask, n: int,
               reward_scores: Sequence[dict[str, float]] | None = None
               ) -> Callable[[], Scored]:
        """Starts scoring the first `len(rows) * n` responses (rows padded for the mesh
        are not scored); returns a function that waits for the result. Only the
        responses come to the host. `reward_scores`: a multi-turn rollout's tool rewards
        per response (`MultiTurnOutput.reward_scores`), given to the reward function as
        `extra_info["rollout_reward_scores"]`."""
        count = len(rows) * n
        responses = sharding.host_array(responses)[:count]
        response_mask = sharding.host_array(response_mask)[:count]
        reward_scores = None if reward_scores is None else reward_scores[:count]
        texts = decode_responses(self.tokenizer, responses, response_mask)
        if self.reward_model is None:
            future = self._thread.submit(self.scorer.score, rows, texts, n, reward_scores)
        return lambda: self._collect(rows, texts, n, response_mask,
                                     None if self.reward_model else future, reward_scores)

    def _collect(self, rows, texts, n, response_mask, future, reward_scores) -> Scored:
        reward = self.settings
        if future is None:
            result = scoring.ScoreResult(self.reward_model.score(rows, texts, n), {}, 0)
        else:
            result = future.result()
        scores, extras = result.scores, dict(result.extras)
        if self.add_tool_rewards and reward_scores is not None:
            extras.setdefault("score", scores)
            scores = scores + np.asarray([sum(r.values()) for r in reward_scores], np.float32)
        if reward.overlong_buffer_len:
            penalty = overlong.overlong_penalty(
                response_mask.sum(-1), self.max_new_tokens, reward.overlong_buffer_len,
                reward.overlong_penalty_factor)
            extras.update(overlong.overlong_extras(penalty))
            extras.setdefault("score", scores)
            scores = scores + penalty
        if result.num_errors:
            logging.warning("%d reward failures scored %s; first: %s", result.num_errors,
                            reward.error_score, result.first_error)
        return scores, extras, result.num_errors, texts

    def close(self) -> None:
        """Stops the background thread and the scorer's workers."""
        self._thread.shutdown()
        self.scorer.close()
