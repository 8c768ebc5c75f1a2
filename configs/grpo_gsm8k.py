"""GRPO on GSM8K with Qwen2.5-0.5B-Instruct on one GPU (verl's GSM8K GRPO example, resized).

128 prompts a step, 5 samples each, responses of up to 512 tokens; a KL loss
(low_var_kl, 0.001) to the initial model and no KL in the reward, as in verl's
example (which runs 1024 prompts a step on 8 GPUs). The reward is GSM8K's strict
rule (`jrl.rewards.gsm8k`: the number after "#### "). Validation is greedy accuracy
on the 1319 test problems every 20 steps.

Needs the model and the dataset on disk (nothing is downloaded):

    # a local copy of the Hugging Face dataset openai/gsm8k (config "main") -> verl rows
    python -m jrl.data.preprocess gsm8k --local_dir ~/downloads/gsm8k \\
        --output_dir ~/data/gsm8k
    # ~/models/Qwen2.5-0.5B-Instruct: config.json, model.safetensors, tokenizer files

    python -m jrl.train --config=configs/grpo_gsm8k.py --workdir=runs/grpo_gsm8k

Other locations: `--config.model.path=/path/to/Qwen2.5-0.5B-Instruct
--config.data.train_files=/path/train.parquet --config.data.val_files=/path/test.parquet`.
"""

import os

from jrl.config.defaults import base_config, parse_arg

MODEL_PATH = "~/models/Qwen2.5-0.5B-Instruct"
DATA_DIR = "~/data/gsm8k"


def get_config(arg: str | None = None):
    parse_arg(arg)  # no variants: a `:name=value` arg is refused, not ignored
    c = base_config()
    c.model.path = MODEL_PATH
    c.tokenizer.name = "hf"
    # float32 master parameters, bfloat16 matmuls; each layer recomputed in the backward pass.
    c.model.dtype = "bfloat16"
    c.model.remat = "full"

    c.data.train_files = os.path.join(DATA_DIR, "train.parquet")
    c.data.val_files = os.path.join(DATA_DIR, "test.parquet")
    # The prompts are chat messages; Qwen's template adds its default system prompt.
    c.data.max_prompt_length = 512
    c.data.filter_overlong_prompts = True
    c.data.train_batch_size = 128
    c.data.val_batch_size = 512

    c.rollout.n = 5
    c.rollout.temperature = 1.0
    c.rollout.response_length = 512
    c.rollout.val_kwargs.do_sample = False

    c.algorithm.adv_estimator = "grpo"
    c.algorithm.use_kl_in_reward = False
    c.actor.optim.lr = 1e-6
    c.actor.use_kl_loss = True
    c.actor.kl_loss_coef = 0.001
    c.actor.kl_loss_type = "low_var_kl"
    c.actor.entropy_coeff = 0.0
    c.actor.loss_agg_mode = "token-mean"
    # 32 prompts x 5 samples per optimizer step: 4 updates per RL step (verl: 1024 / 256).
    c.actor.ppo_mini_batch_size = 32
    # Sequences per forward/backward; gradients accumulate over the 160 of a mini-batch.
    c.actor.ppo_micro_batch_size = 32
    # Bounds the [sequences, chunk, 151936] float32 logits of the log-prob passes.
    c.actor.logprob_chunk_size = 32

    # 7473 training problems // 128 = 58 steps an epoch.
    c.trainer.total_epochs = 15
    c.trainer.test_freq = 20
    c.trainer.save_freq = 50
    c.trainer.max_actor_ckpt_to_keep = 2
    c.trainer.val_before_train = True
    c.trainer.logger = ("console", "jsonl", "tensorboard")
    return c
