"""The start-up line on token-budget micro-batches: rows of `P + R` slots each device runs
a micro-batch in every packed pass, and the hint when a budget holds only one row."""

import pytest

from jrl.rl.trainer import RLTrainer
from tests.tiny import tiny_config, trainer_parts


def _report(tmp_path, **overrides):
    s, model, params, tokenizer, _, _, sharder = trainer_parts(tiny_config(**overrides))
    trainer = RLTrainer(s, model, params, tokenizer, [], [], lambda *a, **k: 0.0,
                        str(tmp_path), 0, sharder=sharder)
    try:
        return trainer.packing_report()
    finally:
        trainer.close()


def test_no_line_without_token_budgets(tmp_path):
    assert _report(tmp_path) is None


def test_no_log_prob_pass_listed_when_none_runs(tmp_path):
    # On-policy GRPO without a KL term or critic: the update's own pass gives the old
    # log-probs, no reference is kept, so the log-prob budget has nothing to pack.
    line = _report(tmp_path, **{"algorithm.adv_estimator": "grpo", "actor.use_dynamic_bsz": True,
                                "actor.ppo_mini_batch_size": 4, "actor.use_kl_loss": False,
                                "algorithm.use_kl_in_reward": False})
    # 4 prompts x 2 = 8 sequences a mini-batch (the whole batch): 8 rows of the 2,340
    # that 16,384 tokens hold.
    assert line == ("token-budget micro-batches, rows of 7 slots: actor update 8 "
                    "(actor.ppo_max_token_len_per_gpu=16384)")


@pytest.mark.parametrize("actor_budget, actor_rows", [(7, 1), (20, 2), (100, 4)])
def test_rows_a_micro_batch_follow_the_budget(tmp_path, actor_budget, actor_rows):
    # P4 + R3: rows of 7 slots. The log-prob passes run the batch's 4 prompts x 2 = 8
    # sequences (21 tokens: 3 rows); the actor's mini-batches hold 2 prompts x 2 = 4, so a
    # budget of 100 tokens (14 rows) runs 4, one a sequence.
    # One batch shard (the CPU's one device): its rows are all the pass's.
    line = _report(tmp_path, **{
        "algorithm.adv_estimator": "grpo", "actor.use_dynamic_bsz": True,
        "actor.ppo_max_token_len_per_gpu": actor_budget,
        "rollout.log_prob_max_token_len_per_gpu": 21})
    assert line.startswith("token-budget micro-batches, rows of 7 slots: ")
    assert ("log-prob/value passes 3 (rollout.log_prob_max_token_len_per_gpu=21), "
            f"actor update {actor_rows} (actor.ppo_max_token_len_per_gpu={actor_budget})"
            in line)
    hint = ("one row a micro-batch runs one full-length sequence: 14 tokens or more in "
            "actor.ppo_max_token_len_per_gpu give two")
    assert (hint in line) == (actor_rows == 1)
