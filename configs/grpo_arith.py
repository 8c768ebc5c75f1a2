"""GRPO on two-digit addition: the main job, runs on a laptop CPU in a few minutes.

A small decoder learns `a+b=` -> `sum` with the built-in character tokenizer:
a short supervised warm start, then GRPO (8 samples per prompt, exact-match
reward). Validation is greedy accuracy on 256 held-out problems.

    python -m jrl.train --config=configs/grpo_arith.py
"""

from jrl.config_defaults import base_config


def get_config(arg: str | None = None):
    del arg
    c = base_config()
    c.model.preset = "tiny"
    c.model.hidden_size = 128
    c.model.intermediate_size = 256
    c.model.head_dim = 32
    c.data.digits = 2
    c.data.train_batch_size = 32
    c.data.max_prompt_length = 8
    c.rollout.n = 8
    c.rollout.response_length = 5
    # A deliberately short warm start (~20% held-out accuracy): it teaches the format
    # and part of the skill, and leaves the rest for RL.
    c.sft.steps = 350
    c.sft.batch_size = 128
    c.sft.lr = 2e-3
    c.actor.optim.lr = 3e-4
    c.actor.ppo_mini_batch_size = 16
    c.actor.ppo_micro_batch_size = 128
    # Reshuffle the two mini-batches of a step each epoch (the runs in README used it).
    c.actor.shuffle = True
    c.critic.shuffle = True
    c.algorithm.adv_estimator = "grpo"
    c.trainer.total_training_steps = 200
    c.trainer.test_freq = 25
    c.trainer.save_freq = 100
    return c
