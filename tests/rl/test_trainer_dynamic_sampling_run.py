"""DAPO dynamic sampling in the trainer (algorithm.filter_groups) on the tiny config.

The reward functions record every call. Scoring is in-process and in sample order,
so the test can replay the generation rounds from the calls alone: which groups
were dropped, how many rounds each step took, and which groups made the batch.
"""

import math

import numpy as np
import pytest

from jrl.metrics import read_jsonl
from jrl.train import run
from tests.tiny import tiny_config

N = 2  # tiny_config's rollout.n
BATCH = 4  # tiny_config's data.train_batch_size (prompts)
GEN_BATCH = 6
PROMPT_TOKENS = 4  # "a+b=" with one-digit operands


def _replay(calls, steps, gen_batch, metric):
    """Per step: (rounds, dropped groups, calls of the batch) from the calls in order."""
    out, position = [], 0
    for _ in range(steps):
        kept, rounds, dropped = [], 0, 0
        while len(kept) < BATCH:
            round_calls = calls[position:position + gen_batch * N]
            assert len(round_calls) == gen_batch * N, "fewer reward calls than rounds need"
            position += gen_batch * N
            rounds += 1
            for g in range(gen_batch):
                group = round_calls[g * N:(g + 1) * N]
                if len({c[metric] for c in group}) > 1:
                    kept.append(group)
                else:
                    dropped += 1
        out.append((rounds, dropped, [c for group in kept[:BATCH] for c in group]))
    assert position == len(calls), "reward calls beyond the rounds the steps needed"
    return out


def test_dropped_groups_are_replaced_until_the_batch_is_full(tmp_path):
    calls = []

    def reward_fn(data_source, solution_str, ground_truth, extra_info):
        # `acc` varies within the groups of prompts whose first operand is 1, 4 or 7
        # and is constant (0) for the others; `score` always varies, so only
        # filtering by the configured metric ("acc") drops the others.
        a, b = extra_info["a"], extra_info["b"]
        alternate = len(calls) % 2  # the n samples of a group are scored one after another
        acc = float(alternate) if a % 3 == 1 else 0.0
        score = 10 * a + b + 0.5 * alternate
        calls.append({"a": a, "score": score, "acc": acc})
        return {"score": score, "acc": acc}

    config = tiny_config(**{"algorithm.filter_groups.enable": True,
                            "data.gen_batch_size": GEN_BATCH,
                            "algorithm.filter_groups.max_num_gen_batches": 10})
    assert config.algorithm.filter_groups.metric == "acc"
    run(config, str(tmp_path), reward_fn=reward_fn)
    records = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2]

    replay = _replay(calls, 2, GEN_BATCH, "acc")
    # The data exercise the filter: some step needed more than one round.
    assert max(rounds for rounds, _, _ in replay) > 1, replay
    for record, (rounds, dropped, batch) in zip(records, replay, strict=True):
        assert all(c["a"] % 3 == 1 for c in batch)
        scores = [c["score"] for c in batch]
        assert record["train/num_gen_batches"] == rounds
        assert record["train/num_filtered_groups"] == dropped
        # The batch is the first BATCH kept groups, all n samples each.
        assert len(scores) == BATCH * N
        assert record["critic/score/mean"] == pytest.approx(np.mean(scores))
        assert record["critic/score/min"] == min(scores)
        assert record["critic/score/max"] == max(scores)
        assert record["prompt_length/mean"] == PROMPT_TOKENS
        # Every sample has its prompt and 1..response_length response tokens; a batch of
        # only the kept groups of one round would be at most half this size.
        response_length = config.rollout.response_length
        prompt_tokens = BATCH * N * PROMPT_TOKENS
        assert (prompt_tokens + BATCH * N <= record["perf/total_num_tokens"]
                <= prompt_tokens + BATCH * N * response_length)
        assert math.isfinite(record["actor/pg_loss"])


def test_constant_reward_exhausts_the_generation_bound(tmp_path):
    calls = []

    def reward_fn(data_source, solution_str, ground_truth, extra_info):
        calls.append(solution_str)
        return 1.0

    config = tiny_config(**{"algorithm.filter_groups.enable": True,
                            "algorithm.filter_groups.metric": "score",
                            "algorithm.filter_groups.max_num_gen_batches": 3})
    with pytest.raises(RuntimeError,
                       match=r"algorithm\.filter_groups\.max_num_gen_batches=3") as err:
        run(config, str(tmp_path), reward_fn=reward_fn)
    assert "0 of the 4" in str(err.value)
    # Exactly three rounds of train_batch_size prompts (the default gen_batch_size) x n.
    assert len(calls) == 3 * BATCH * N
