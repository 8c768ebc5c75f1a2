"""PPO with a critic (GAE) on two-digit addition; the same task and warm start as grpo_arith.

    python -m jrl.train --config=configs/ppo_arith.py
"""

from configs import grpo_arith


def get_config(arg: str | None = None):
    c = grpo_arith.get_config(arg)
    c.algorithm.adv_estimator = "gae"
    c.algorithm.gamma = 1.0
    c.algorithm.lam = 0.95
    c.rollout.n = 4
    c.data.train_batch_size = 64
    c.actor.ppo_mini_batch_size = 32
    c.critic.optim.lr = 1e-3
    c.critic.ppo_mini_batch_size = 32
    c.critic.ppo_micro_batch_size = 128
    c.critic.cliprange_value = 0.5
    # A KL penalty in the reward keeps the policy near the warm start (verl's PPO default).
    c.algorithm.use_kl_in_reward = True
    c.algorithm.kl_penalty = "kl"
    c.algorithm.kl_ctrl.kl_coef = 0.001
    return c
