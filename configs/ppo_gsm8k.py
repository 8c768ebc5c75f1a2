"""PPO with a critic (GAE) on GSM8K with Qwen2.5-0.5B-Instruct on one GPU (verl's GSM8K
PPO quickstart, resized).

256 prompts a step, one sample each, responses of up to 512 tokens; the critic
starts from the actor's weights with a fresh value head. No KL term (neither in
the reward nor as a loss). Data, model and validation as in `grpo_gsm8k.py`:

    python -m jrl.data.preprocess gsm8k --local_dir ~/downloads/gsm8k \\
        --output_dir ~/data/gsm8k

    python -m jrl.train --config=configs/ppo_gsm8k.py --workdir=runs/ppo_gsm8k
"""

from jrl.config.defaults import sibling_config

grpo_gsm8k = sibling_config(__file__, "grpo_gsm8k")


def get_config(arg: str | None = None):
    c = grpo_gsm8k.get_config(arg)
    c.algorithm.adv_estimator = "gae"
    c.algorithm.gamma = 1.0
    c.algorithm.lam = 1.0
    c.algorithm.use_kl_in_reward = False
    c.actor.use_kl_loss = False
    c.rollout.n = 1
    c.data.train_batch_size = 256
    # 64 prompts per optimizer step: 4 actor and 4 critic updates per RL step.
    c.actor.ppo_mini_batch_size = 64
    c.actor.ppo_micro_batch_size = 32
    c.critic.optim.lr = 1e-5
    c.critic.ppo_mini_batch_size = 64
    c.critic.ppo_micro_batch_size = 32
    c.critic.cliprange_value = 0.5
    # 7473 // 256 = 29 steps an epoch.
    c.trainer.total_epochs = 15
    c.trainer.test_freq = 10
    c.trainer.save_freq = 30
    return c
