"""PPO with a critic (GAE) on two-digit addition; the same task and warm start as grpo_arith.

    python -m jrl.train --config=configs/ppo_arith.py

Variants go after a colon, e.g. `--config=configs/ppo_arith.py:critic_lr=3e-4`
(the default workdir names the variant, e.g. `runs/ppo_arith-n=8`):

    n          samples per prompt, rollout.n (4)
    lr         actor learning rate, actor.optim.lr (1e-4, as grpo_arith)
    critic_lr  critic learning rate, critic.optim.lr (1e-3)
    steps      RL steps, trainer.total_training_steps (100, as grpo_arith)
    seed       root seed of init, sampling and shuffling, seed (0)
"""

import math

from jrl.config.defaults import parse_arg, sibling_config

grpo_arith = sibling_config(__file__, "grpo_arith")

# The variants `get_config(arg)` accepts, with their values when not given.
ARG_DEFAULTS = {**grpo_arith.ARG_DEFAULTS, "n": 4, "critic_lr": 1e-3}


def get_config(arg: str | None = None):
    a = parse_arg(arg, **ARG_DEFAULTS)
    # grpo_arith applies the variants the two share (n, lr, steps, seed).
    c = grpo_arith.get_config(",".join(f"{name}={a[name]}" for name in grpo_arith.ARG_DEFAULTS))
    c.algorithm.adv_estimator = "gae"
    c.algorithm.gamma = 1.0
    c.algorithm.lam = 0.95
    c.data.train_batch_size = 64
    c.actor.ppo_mini_batch_size = 32
    # 128 sequences per forward/backward, or fewer where that does not divide the
    # mini-batch of 32 x n sequences (actor and critic).
    c.actor.ppo_micro_batch_size = math.gcd(128, 32 * a.n)
    c.critic.optim.lr = a.critic_lr
    c.critic.ppo_mini_batch_size = 32
    c.critic.ppo_micro_batch_size = c.actor.ppo_micro_batch_size
    c.critic.cliprange_value = 0.5
    # A KL penalty in the reward keeps the policy near the warm start (verl's PPO default).
    c.algorithm.use_kl_in_reward = True
    c.algorithm.kl_penalty = "kl"
    c.algorithm.kl_ctrl.kl_coef = 0.001
    return c
