"""The full experiment configuration with its defaults; configs/*.py override parts of it.

Keys follow verl's names where verl has the concept. Every key is commented; the
comment above a key is its documentation. `parse_arg` reads the variant string of
`--config=configs/<name>.py:k=v,...` for the config files.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import os

import ml_collections
from ml_collections import config_dict

from jrl.errors import ConfigError

# From this response length `rollout.decode_buckets`' default (None) compacts the decode
# loop's rows into 8 batch sizes, not 4 (R8192, lengths uniform in [512, 8192]: the
# rollout 16.9 -> 15.5 s on an H200; docs/performance.md, "Long responses").
LONG_DECODE = 4096


def decode_buckets(value, response_length) -> int:
    """`rollout.decode_buckets` as the sampler takes it: `value`, or for None (the
    default) 4, or 8 from `LONG_DECODE` response tokens."""
    if value is not None:
        return value
    return 8 if isinstance(response_length, int) and response_length >= LONG_DECODE else 4


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    # Root seed: model init, rollout sampling and update shuffling all derive from it.
    c.seed = 0

    c.model = ml_collections.ConfigDict()
    # Local Hugging Face checkpoint directory (config.json + safetensors; `~` allowed);
    # None: use `preset`.
    c.model.path = config_dict.placeholder(str)
    # Named architecture for random init when no path is given (see jrl.models.PRESETS).
    c.model.preset = "tiny"
    # Parameter dtype: float32 (training needs it; set model.dtype for bfloat16 compute).
    c.model.param_dtype = "float32"
    # Compute dtype of activations and matmuls: float32 or bfloat16.
    c.model.dtype = "float32"
    # Rematerialisation in training: none, full or dots_saveable (keep matmul outputs).
    c.model.remat = "none"
    # LoRA adapters (verl's names): rank (0 = off, full fine-tuning), alpha (the scale is
    # alpha / rank) and the projections that get them: all-linear or a comma-separated
    # list of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj. With a rank,
    # only the adapters train and the reference is the frozen base.
    c.model.lora_rank = 0
    # LoRA scale numerator.
    c.model.lora_alpha = 16.0
    # Projections with adapters.
    c.model.target_modules = "all-linear"
    # How rollouts apply the adapters: merged (W + A B formed once per rollout: faster
    # decoding, a second copy of those kernels meanwhile) or unmerged (x W + (x A) B at
    # every decode step; no copy, for when memory is tight).
    c.model.lora_rollout = "merged"
    # Attention of the training passes (prefills, log-prob, value and update passes):
    # auto (cuDNN flash attention on a GPU for bfloat16/float16 with a head_dim it takes,
    # up to 256 on Hopper and 128 before, and no attention soft-cap; Pallas splash
    # attention on a TPU for head_dim a multiple of 128; else XLA), xla, cudnn or splash
    # (forced; off a TPU splash runs in Pallas' interpret mode, for tests).
    c.model.attention_impl = "auto"
    # Cache write and attention of decode steps: auto (one Pallas kernel on its Mosaic
    # GPU backend that writes the new key/value and attends over the filled cache slots,
    # on a Hopper GPU with a bfloat16/float16 cache; else XLA), xla or mosaic (the
    # kernel, forced; a ConfigError where jax lacks Mosaic GPU).
    c.model.decode_attention_impl = "auto"
    # Unembedding + log-softmax of the log-prob and update passes (forward, and the
    # update's backward through d loss / d logits): auto (a Pallas kernel on its Mosaic
    # GPU backend that keeps the logits on chip, on Hopper GPUs for hidden sizes up to
    # 2,048; else XLA), xla (chunked float32 logits) or mosaic (the kernel, forced; a
    # ConfigError where jax lacks Mosaic GPU).
    c.model.logprob_impl = "auto"
    # The sampler's unembedding and draw at each decode step: auto (a Pallas kernel on
    # its Mosaic GPU backend that reduces each row's logits on chip to the masses of
    # blocks of the vocabulary, and the draw recomputes one block's logits, on Hopper GPUs
    # for hidden sizes up to 2,048 when drawing with temperature alone: no top-k, top-p
    # or greedy decoding; else XLA, which writes each step's float32 logits and reads
    # them back), xla or mosaic (the kernel, forced, for the temperature draws: a
    # ConfigError where jax lacks Mosaic GPU or the training rollout draws with top-k,
    # top-p or greedily; validation's greedy draws take XLA's head).
    c.model.decode_head_impl = "auto"
    # Decode each layer's q/k/v projections as one matmul and gate/up as one (weights
    # joined once per rollout; not under tensor parallelism).
    c.model.fuse_decode_projections = True
    # Unroll the scan over layers in the update passes (those that take gradients) into
    # straight-line code: no zero-filled [layers, ...] buffers per micro-batch for what
    # the backward pass reads and for the layers' gradients, at the price of longer
    # compilation. With remat dots_saveable XLA may also reuse the forward's attention
    # in the backward (more memory held). The log-prob and value passes stay rolled.
    # None: unrolled when the actor or critic trains on token-budget micro-batches
    # (`use_dynamic_bsz`: long responses, where a step outlasts the extra compilation).
    c.model.scan_unroll = config_dict.placeholder(bool)
    # Preset overrides (None keeps the preset's value).
    c.model.hidden_size = config_dict.placeholder(int)
    # MLP width override.
    c.model.intermediate_size = config_dict.placeholder(int)
    # Decoder layers override.
    c.model.num_layers = config_dict.placeholder(int)
    # Query heads override.
    c.model.num_heads = config_dict.placeholder(int)
    # Key/value heads override.
    c.model.num_kv_heads = config_dict.placeholder(int)
    # Per-head width override.
    c.model.head_dim = config_dict.placeholder(int)
    # Experts per layer override (mixture-of-experts presets: tiny-moe, qwen3-30b-a3b,
    # mixtral-8x7b).
    c.model.num_experts = config_dict.placeholder(int)
    # Experts each token is routed to, override (MoE presets).
    c.model.num_experts_per_tok = config_dict.placeholder(int)
    # Each expert's MLP width override (MoE presets).
    c.model.moe_intermediate_size = config_dict.placeholder(int)

    c.tokenizer = ml_collections.ConfigDict()
    # "char" (built-in character tokenizer) or "hf" (tokenizer files in model.path or `path`).
    c.tokenizer.name = "char"
    # Tokenizer directory for name="hf" when it differs from model.path.
    c.tokenizer.path = config_dict.placeholder(str)

    c.data = ml_collections.ConfigDict()
    # Training rows in verl's schema: a .parquet/.jsonl path or a list of them (verl's
    # data.train_files). None: the synthetic `task`.
    c.data.train_files = config_dict.placeholder(object)
    # Validation rows (same formats); None: no validation set (or the task's held-out part).
    c.data.val_files = config_dict.placeholder(object)
    # Column of the rows holding the prompt (chat messages or a string).
    c.data.prompt_key = "prompt"
    # Drop rows whose prompt exceeds max_prompt_length (the count is printed); False: such a
    # row is an error naming it.
    c.data.filter_overlong_prompts = False
    # Prompts per generation round when algorithm.filter_groups is on (None: train_batch_size).
    c.data.gen_batch_size = config_dict.placeholder(int)
    # Synthetic dataset when no train_files are given: "arithmetic", or
    # "tool_multiplication" (a*b answered with a calculator tool; multi-turn rollouts).
    c.data.task = "arithmetic"
    # Arithmetic: operand digits.
    c.data.digits = 2
    # Arithmetic: operators, from "+-*".
    c.data.ops = "+"
    # Arithmetic: write answers least-significant digit first (easier for small models).
    c.data.reverse_answer = False
    # Arithmetic: share of the carrying training sums whose warm-start demonstration drops
    # the carries (a noisy teacher; the reward still checks the true sum). 0: none.
    c.data.carry_slip_rate = 0.0
    # Tool multiplication: share of the warm-start demonstrations that call the calculator
    # (the rest guess).
    c.data.tool_rate = 0.3
    # Held-out problems for validation.
    c.data.num_val = 256
    # Cap on training problems (None: all that are not held out).
    c.data.num_train = config_dict.placeholder(int)
    # Prompts per RL step (verl's data.train_batch_size).
    c.data.train_batch_size = 32
    # Prompts per validation generate call.
    c.data.val_batch_size = 256
    # Prompt tokens (prompts are left-padded to this length; longer prompts are an error).
    c.data.max_prompt_length = 16
    # Encode prompts through the tokenizer's chat template.
    c.data.apply_chat_template = False
    # Seed of the per-epoch shuffle of the training prompts.
    c.data.seed = 0

    c.sft = ml_collections.ConfigDict()
    # Supervised warm-start steps before RL (0: none).
    c.sft.steps = 0
    # Examples per SFT step.
    c.sft.batch_size = 64
    # SFT learning rate (AdamW; constant after the warmup).
    c.sft.lr = 1e-3
    # Steps over which the SFT learning rate rises linearly from 0 to sft.lr.
    c.sft.lr_warmup_steps = 0

    c.actor = ml_collections.ConfigDict()
    _add_update_keys(c.actor, lr=1e-6)
    # PPO clip epsilon.
    c.actor.clip_ratio = 0.2
    # Lower clip epsilon (None: clip_ratio).
    c.actor.clip_ratio_low = config_dict.placeholder(float)
    # Upper clip epsilon (None: clip_ratio); DAPO's clip-higher sets e.g. 0.28.
    c.actor.clip_ratio_high = config_dict.placeholder(float)
    # Dual-clip bound for negative advantages (> 1).
    c.actor.clip_ratio_c = 3.0
    # token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm.
    c.actor.loss_agg_mode = "token-mean"
    # Divisor of seq-mean-token-sum-norm (None: the response length).
    c.actor.loss_scale_factor = config_dict.placeholder(float)
    # Entropy bonus coefficient (subtracted from the loss).
    c.actor.entropy_coeff = 0.0
    # Add a KL(actor || reference) term to the actor loss (GRPO-style).
    c.actor.use_kl_loss = False
    # Weight of the KL loss.
    c.actor.kl_loss_coef = 0.001
    # KL estimator of the KL loss: k1, k2, k3 (low_var_kl), abs, mse, or a `+` variant.
    c.actor.kl_loss_type = "low_var_kl"
    # Mixture-of-experts models: weight of the router's load-balancing loss (transformers'
    # load_balancing_loss_func over the micro-batch's tokens, added to the actor loss;
    # metric actor/router_aux_loss). None: the checkpoint's router_aux_loss_coef. 0: off.
    c.actor.router_aux_loss_coef = config_dict.placeholder(float)
    # Mixture-of-experts routing replay (verl's router_replay): "rollout" (verl's R3)
    # records each token's experts in every layer during the rollout and routes the
    # actor's log-prob and update passes to them (the weights still the training
    # router's), so rollout and training use the same experts; not with multi-turn
    # rollouts or rollout.cache_segments > 1. "old_log_prob" (R2) records them in the
    # actor's old-log-prob pass and replays them in every update mini-batch and epoch
    # (where that pass runs; a single on-policy update is its own old pass; not with
    # rollout_correction.bypass_mode, which has no such pass). Neither with token-budget
    # micro-batches. "disabled": each pass routes for itself.
    c.actor.router_replay = "disabled"
    # Response tokens per chunk when computing log-probs (bounds the [B, chunk, V] logits).
    c.actor.logprob_chunk_size = 128
    # Response-length buckets of every log-prob, value and update pass: the rows are
    # sorted by used length and each micro-batch runs on the smallest of this many evenly
    # spaced lengths (up to rollout.response_length) that holds its longest response, so
    # padding after early stops costs nothing (verl's use_remove_padding/use_dynamic_bsz,
    # with static shapes). Each bucket compiles one more copy of the pass. 1: off.
    c.actor.response_buckets = 4
    # Run each prompt once for its rollout.n samples in the log-prob, value and update
    # passes: a micro-batch's rows are regrouped as one prompt followed by its responses,
    # each response attending to the shared prompt and to itself. Same outputs and
    # gradients as the plain layout (up to summation order), with the prompt's FLOPs
    # divided by the samples per micro-batch shard that share it. False: every row
    # runs its own copy of the prompt.
    c.actor.share_prompts = True
    # When a step's update is on-policy (one mini-batch, one epoch), take the old log-probs
    # (the current ones, detached, as verl's actor does) and the entropy metric from the
    # update's own forward pass and skip the separate old-log-prob pass. It never applies
    # with algorithm.use_kl_in_reward (the reward needs them first) or a critic warm-up.
    # False: always run the pass.
    c.actor.reuse_update_log_probs = True
    c.actor.policy_loss = ml_collections.ConfigDict()
    # vanilla, gspo, gpg, cispo, sapo, clip_cov, kl_cov or geo_mean.
    c.actor.policy_loss.loss_mode = "vanilla"
    # Clip-Cov: share of tokens whose loss is dropped.
    c.actor.policy_loss.clip_cov_ratio = 0.0002
    # Clip-Cov: covariance lower bound.
    c.actor.policy_loss.clip_cov_lb = 1.0
    # Clip-Cov: covariance upper bound.
    c.actor.policy_loss.clip_cov_ub = 5.0
    # KL-Cov: share of tokens that get the KL penalty.
    c.actor.policy_loss.kl_cov_ratio = 0.0002
    # KL-Cov: weight of the |log ratio| penalty.
    c.actor.policy_loss.ppo_kl_coef = 0.1
    # SAPO: gate temperature for positive advantages.
    c.actor.policy_loss.tau_pos = 1.0
    # SAPO: gate temperature for negative advantages.
    c.actor.policy_loss.tau_neg = 1.05

    c.critic = ml_collections.ConfigDict()
    _add_update_keys(c.critic, lr=1e-5)
    # Value clip range around the old values.
    c.critic.cliprange_value = 0.5
    # Aggregation of the value loss.
    c.critic.loss_agg_mode = "token-mean"
    # When the critic's update is on-policy (one mini-batch of the whole batch, one
    # epoch) under GAE, take the batch's values from the update's own forward pass
    # (detached; its micro-batches all run the parameters that would value the batch)
    # and skip the separate value pass: each micro-batch computes its returns by GAE
    # from them, and the advantages follow from all of them after the critic's update.
    # The numbers are the separate pass's. False: always run the pass.
    c.critic.reuse_update_values = True
    c.critic.model = ml_collections.ConfigDict()
    # LoRA on the critic (verl's names; needs model.lora_rank > 0): adapters of its own
    # on the actor's frozen base, and a fully trained value head. 0: the critic trains
    # a full copy of the backbone.
    c.critic.model.lora_rank = 0
    # The critic's LoRA scale numerator.
    c.critic.model.lora_alpha = 16.0
    # Projections with critic adapters.
    c.critic.model.target_modules = "all-linear"

    c.rollout = ml_collections.ConfigDict()
    # Samples per prompt (GRPO's group size).
    c.rollout.n = 8
    # Sampling temperature.
    c.rollout.temperature = 1.0
    # Nucleus sampling mass (1.0: off).
    c.rollout.top_p = 1.0
    # Top-k sampling (-1: off).
    c.rollout.top_k = -1
    # Sample (True) or decode greedily (False).
    c.rollout.do_sample = True
    # Keep generating after a stop token, to the full response_length (benchmarks).
    c.rollout.ignore_eos = False
    # Batch sizes the decode loop may run at: when every batch shard's unfinished rows
    # fit the next smaller one (evenly spaced down to 1/decode_buckets of the rows), they
    # are compacted into it, so finished rows stop costing decode steps. Each size
    # compiles one more copy of the decode step. 1: the whole batch to the end.
    # None: 4, or 8 from response_length 4,096 (long decodes gain more than the compile).
    c.rollout.decode_buckets = config_dict.placeholder(int)
    # Decode in this many segments (1: one program, a KV cache of prompt + response_length
    # slots for every row): segment k decodes up to (k+1)/cache_segments of the response
    # in a cache of just those slots holding only the rows still running, so cache
    # memory follows the tokens generated; samples and log-probs are the single
    # program's (bit for bit on XLA:CPU, tested) at its decode cost (decode_buckets).
    # Costs a host sync per segment and a program per (batch, cache rows, slots) shape.
    # From 1 to response_length; not with multi_turn.
    c.rollout.cache_segments = 1
    # Partial rollouts: each generation round draws at most partial_max_tokens tokens a
    # row; rows still running keep their tokens and log-probs and go on in the next round
    # or step, under the weights of then (prefilled again), and a finished row's slot
    # takes the next prompt's samples. A step trains on the first
    # data.train_batch_size groups whose samples have all finished (rounds run until
    # there are that many); the rollout-correction keys weigh the tokens drawn under
    # earlier weights. Logged: rollout/partial_rounds, rollout/partial_in_flight_rows,
    # rollout/partial_waiting_groups, rollout/partial_continued_fraction (trained rows
    # begun in an earlier step), rollout/partial_staleness/{mean,max} (steps since a
    # trained row's first token). Single-turn, on the training devices, host rewards.
    c.rollout.partial = False
    # The most tokens a row draws in one round of partial rollouts (from 1 to
    # response_length - 1); needed with partial=True.
    c.rollout.partial_max_tokens = config_dict.placeholder(int)
    # Partial rollouts: hand a round's KV cache to the step's next round (same weights),
    # whose rows still running are then prefilled from their last token rather than in
    # full. Costs a second cache of every decode row at the round's full width, and the
    # last round's is alive through the next round (up to three of the rollout's caches
    # at once); worth it where the prefill is a large part of a round.
    # Not with mesh.tensor > 1, sliding-window layers or the paged cache.
    c.rollout.partial_keep_cache = False
    # The rollout's KV cache: "contiguous" (every row P + response_length slots for the
    # whole program) or "paged" (a pool of page_size-slot pages that rows take as their
    # tokens need them and give back when they stop, over max_num_seqs decode slots that
    # are refilled from the step's waiting rows inside the decode loop; the contiguous
    # cache's tokens and log-probs up to float32 rounding). Partial rollouts too (a
    # continued row is prefilled into pages each round), and multi-turn ones (a row keeps
    # its pages across its turns and tool calls; every row decoded at once, max_num_seqs
    # 0); not with cache_segments > 1 or routing replay from the rollout.
    c.rollout.kv_cache = "contiguous"
    # Slots per page of the paged cache. On a Hopper GPU its decode steps read the pages
    # in place (the decode kernel) for a power of two from 8 to 128 (64 at head_dim 256);
    # other sizes attend a gathered copy of the pages, several times slower.
    c.rollout.page_size = 16
    # Pages in the paged cache's pool, one of them a trash page (0: every decode slot at
    # full length). Fewer pages than the rows could fill send the row admitted last back
    # to wait when the pool runs out (it starts over and draws the same tokens; a
    # multi-turn row has its prompt and tokens so far prefilled again, its tools not run
    # again; logged as rollout/preemptions); at least one row at full length must fit.
    # The most pages held at once, as a fraction of the pool, is logged as
    # rollout/page_usage.
    c.rollout.num_pages = 0
    # Decode slots of the paged cache: rows decoded at once (0: every row of the step).
    c.rollout.max_num_seqs = 0
    # Rows prefilled into freed decode slots at once (0: an eighth of max_num_seqs, at
    # least 2).
    c.rollout.refill_rows = 0
    # On a GPU, how the sampler's programs compile their matmuls: "cublas" (each a
    # cuBLAS call: faster for a decode step's one token per row, and quicker to
    # compile) or "xla" (XLA's choice, Triton GEMM fusions included). No effect off a GPU.
    c.rollout.gemm = "cublas"
    # Sequences per forward pass when computing old/reference log-probs and values
    # (bounds the logits buffer; None: the whole batch at once).
    c.rollout.log_prob_micro_batch_size = config_dict.placeholder(int)
    # Token-budget micro-batches for the old/reference log-prob and value passes, as
    # actor.use_dynamic_bsz does for the update (None: as actor.use_dynamic_bsz).
    c.rollout.log_prob_use_dynamic_bsz = config_dict.placeholder(bool)
    # Tokens per device per micro-batch of those passes with log_prob_use_dynamic_bsz.
    c.rollout.log_prob_max_token_len_per_gpu = 16384
    # Most response tokens (verl's data.max_response_length).
    c.rollout.response_length = 8
    # One-step asynchronous training: the first this many devices (of each host) form
    # a sampling group and the others train (the `mesh` keys then describe the training
    # group); step t+1's rollout runs on the sampling group with the weights of step t
    # while the training group learns from step t's. 0: one group (synchronous).
    c.rollout.devices = 0
    # The sampling group's tensor-parallel size (its data axis takes the rest).
    c.rollout.tensor_model_parallel_size = 1
    # Steps the sampling group's weights lag the update: 1 (one-step off-policy,
    # sampling overlaps training) or 0 (wait for the new weights: no overlap).
    c.rollout.staleness = 1
    c.rollout.multi_turn = ml_collections.ConfigDict()
    # Multi-turn rollouts with tools: the model calls tools between its turns; the
    # response budget (response_length) covers every turn and tool output. Logged per
    # step (under val-aux/ for validation): num_turns/{mean,max,min} (model turns and
    # tool answers per row), multi_turn/tool_calls/{mean,total} (every call written,
    # malformed ones too), multi_turn/tool_calls/malformed (not parsed, not run),
    # multi_turn/tool_errors (answered with an error, at most tool_calls/total); the
    # console shows calls and turns per row and tool errors (docs/guide.md).
    c.rollout.multi_turn.enable = False
    # verl's tool config file (YAML or JSON): `tools: [{class_name, config, tool_schema}]`.
    c.rollout.multi_turn.tool_config_path = config_dict.placeholder(str)
    # A row ends after this many model turns ...
    c.rollout.multi_turn.max_assistant_turns = 4
    # ... or this many tool responses.
    c.rollout.multi_turn.max_user_turns = 4
    # How the model writes tool calls: hermes (Qwen: <tool_call>{json}</tool_call>) or
    # llama3 (a JSON object {"name", "parameters"}).
    c.rollout.multi_turn.format = "hermes"
    # Tool calls run at once (threads).
    c.rollout.multi_turn.max_parallel_calls = 16
    # A tool call taking longer is answered with a timeout error (seconds).
    c.rollout.multi_turn.tool_timeout_s = 5.0
    # A tool's text is cut to this many characters ...
    c.rollout.multi_turn.max_tool_response_length = 256
    # ... keeping its left, right or middle (both ends).
    c.rollout.multi_turn.tool_response_truncate_side = "middle"
    # Most tokens of one tool block (the tool messages with the chat template's markup);
    # a longer one ends the row.
    c.rollout.multi_turn.max_tool_response_tokens = 64
    # Token ids that end a turn besides the EOS ids (e.g. a tool-call closing token).
    c.rollout.multi_turn.turn_stop_ids = ()
    # Decoding returns to the host (to run tools) once this share of the rows have
    # ended their turn; the rest resume where they stopped (1.0: wait for every row).
    c.rollout.multi_turn.segment_end_fraction = 0.5
    # Add the sum of a row's tool rewards (each call's step reward and each tool's
    # calc_reward) to its score. Either way the reward function gets them by tool name
    # in extra_info["rollout_reward_scores"], as verl's; False, as verl, leaves adding
    # them to the function.
    c.rollout.multi_turn.add_tool_rewards = False
    c.rollout.val_kwargs = ml_collections.ConfigDict()
    # Validation samples per prompt.
    c.rollout.val_kwargs.n = 1
    # Validation temperature.
    c.rollout.val_kwargs.temperature = 1.0
    # Validation top-p.
    c.rollout.val_kwargs.top_p = 1.0
    # Validation top-k.
    c.rollout.val_kwargs.top_k = -1
    # Validation samples (False: greedy).
    c.rollout.val_kwargs.do_sample = False

    c.algorithm = ml_collections.ConfigDict()
    # gae, grpo, grpo_passk, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax,
    # opo or gpg.
    c.algorithm.adv_estimator = "grpo"
    # Discount factor.
    c.algorithm.gamma = 1.0
    # GAE lambda.
    c.algorithm.lam = 1.0
    # GRPO: divide by the group std (False: Dr. GRPO).
    c.algorithm.norm_adv_by_std_in_grpo = True
    # Subtract beta * KL(old || reference) from the token rewards (PPO-style).
    c.algorithm.use_kl_in_reward = False
    # KL estimator of the in-reward penalty.
    c.algorithm.kl_penalty = "kl"
    c.algorithm.kl_ctrl = ml_collections.ConfigDict()
    # fixed or adaptive.
    c.algorithm.kl_ctrl.type = "fixed"
    # Initial (fixed) KL coefficient beta.
    c.algorithm.kl_ctrl.kl_coef = 0.001
    # Adaptive: target KL.
    c.algorithm.kl_ctrl.target_kl = 0.1
    # Adaptive: horizon in samples.
    c.algorithm.kl_ctrl.horizon = 10000.0
    c.algorithm.filter_groups = ml_collections.ConfigDict()
    # DAPO dynamic sampling: drop groups whose samples all score the same and generate
    # more (data.gen_batch_size prompts a round) until train_batch_size groups remain.
    c.algorithm.filter_groups.enable = False
    # What must vary within a group: "acc", "score" or another reward extra.
    c.algorithm.filter_groups.metric = "acc"
    # Most generation rounds per step before stopping with an error (0: no limit).
    c.algorithm.filter_groups.max_num_gen_batches = 10

    c.algorithm.rollout_correction = ml_collections.ConfigDict()
    # One of verl's named settings (e.g. "decoupled_k3_rs", "bypass_ppo_clip"; the list is
    # in docs/from_verl.md); the keys below that are left at their defaults take its values.
    c.algorithm.rollout_correction.preset = config_dict.placeholder(str)
    # Correct the rollout/training mismatch (the sampler's log-probs vs the trainer's)
    # by importance sampling: None (off), "token" or "sequence".
    c.algorithm.rollout_correction.rollout_is = config_dict.placeholder(str)
    # The IS weights' bounds, a string: "u" truncates them at u (TIS); "l_u" sets those
    # outside [l, u] to 0 (IcePop).
    c.algorithm.rollout_correction.rollout_is_threshold = "2.0"
    # Divide the IS weights by their batch mean.
    c.algorithm.rollout_correction.rollout_is_batch_normalize = False
    # Rejection sampling: comma-separated options <level>_<k>, level token, seq_sum,
    # seq_mean or seq_max, k k1 (log pi_rollout/pi_train; not with seq_max), k2 or k3
    # (divergences), e.g. "token_k1,seq_mean_k3". A token or row outside an option's
    # bounds leaves the loss.
    c.algorithm.rollout_correction.rollout_rs = config_dict.placeholder(str)
    # Rejection bounds, a string: one for all options or one per option, comma separated;
    # "l_u" or "u" (l = 1/u) for k1, on the ratio pi_rollout/pi_train; "u" for k2 and k3.
    c.algorithm.rollout_correction.rollout_rs_threshold = config_dict.placeholder(str)
    # Reject a whole row when a token's ratio pi_train/pi_rollout is below this (None: off).
    c.algorithm.rollout_correction.rollout_token_veto_threshold = config_dict.placeholder(
        float)
    # The rollout's log-probs are the old ones (no old-log-prob pass).
    c.algorithm.rollout_correction.bypass_mode = False
    # With bypass_mode: ppo_clip (the policy loss, its ratio to the rollout policy) or
    # reinforce (-w A log pi with the IS weights w).
    c.algorithm.rollout_correction.loss_type = "ppo_clip"

    c.mesh = ml_collections.ConfigDict()
    # Devices on the data-parallel axis (parameters replicated); -1: all the others leave.
    c.mesh.data = -1
    # Devices on the FSDP axis (parameters, gradients and optimizer states split; -1 allowed).
    c.mesh.fsdp = 1
    # Devices each sequence of the training passes is split over (context parallelism,
    # Ulysses attention; the rollout splits its rows over them instead). Sequences are
    # padded to a multiple of it; actor.share_prompts does not apply (docs/guide.md).
    c.mesh.context = 1
    # Devices on the tensor-parallel axis (heads, MLP width and vocabulary split).
    c.mesh.tensor = 1
    # Devices on the expert-parallel axis: each holds 1/expert of every MoE layer's experts
    # and of the batch; a layer's tokens go to their experts' devices and back
    # (mixture-of-experts models; dense models treat it as data parallelism).
    c.mesh.expert = 1
    # Devices the runs of one program (trainer.runs, reward.in_graph_fn) are split over,
    # each holding runs / mesh.runs of them (-1: all devices); with runs, the other axes
    # do not apply.
    c.mesh.runs = 1
    c.mesh.rules = ml_collections.ConfigDict()
    # Mesh axes (comma-separated, "" for none) each logical axis is split over: batch rows.
    c.mesh.rules.batch = "data,fsdp,expert"
    # Vocabulary (embedding rows, LM head columns, logits).
    c.mesh.rules.vocab = "tensor"
    # Hidden dimension of the parameters (the FSDP split).
    c.mesh.rules.embed = "fsdp"
    # Query heads.
    c.mesh.rules.heads = "tensor"
    # Key/value heads (and the KV cache).
    c.mesh.rules.kv_heads = "tensor"
    # MLP width.
    c.mesh.rules.mlp = "tensor"
    # Stacked layer axis of the parameters and the cache.
    c.mesh.rules.layers = ""
    # Per-head width.
    c.mesh.rules.head_dim = ""
    # KV-cache slots.
    c.mesh.rules.cache_length = ""
    # Tokens of a sequence in the training passes (activations; the context split).
    c.mesh.rules.length = "context"
    # The experts of each MoE layer.
    c.mesh.rules.experts = "expert"

    c.distributed = ml_collections.ConfigDict()
    # Start jax.distributed: "auto" (when a coordinator is configured or the environment
    # names a multi-process cluster: TPU pod, SLURM), "yes" or "no".
    c.distributed.initialize = "auto"
    # host:port of process 0 (None: detected from the cluster environment).
    c.distributed.coordinator_address = config_dict.placeholder(str)
    # Number of processes (None: detected).
    c.distributed.num_processes = config_dict.placeholder(int)
    # This process's index (None: detected).
    c.distributed.process_id = config_dict.placeholder(int)
    # Devices of this process to use, e.g. "0,1" (None: all of them).
    c.distributed.local_device_ids = config_dict.placeholder(str)

    c.reward = ml_collections.ConfigDict()
    # Your reward function, "path/to/file.py:name", with verl's signature
    # fn(data_source, solution_str, ground_truth, extra_info) -> float | dict (verl's
    # custom_reward_function.path and .name). None: the built-in scorer of each data_source.
    c.reward.custom_fn = config_dict.placeholder(str)
    # A reward computed on the device, a JAX function of token ids (jrl/rewards/in_graph.py):
    # "exact_match", "path/to/file.py:name" or "package.module:name", called per sample as
    # fn(data_source, solution_ids, solution_mask, ground_truth_ids, ground_truth_mask).
    # For runs whose steps stay on the device; it excludes host-only rewards and features
    # (reward.custom_fn, a reward model, overlong shaping, multi-turn, dynamic sampling,
    # remax). None: rewards scored on the host.
    c.reward.in_graph_fn = config_dict.placeholder(str)
    # Worker processes scoring responses in parallel (0: a background thread of this
    # process; use workers for reward code that needs a main thread, e.g. signal timeouts).
    c.reward.num_workers = 0
    # When the reward function raises: "raise" (stop, naming the sample) or "score" (use
    # error_score and count it in reward/num_errors).
    c.reward.on_error = "raise"
    # Score of a sample whose reward function raised, with on_error="score".
    c.reward.error_score = 0.0

    c.reward_model = ml_collections.ConfigDict()
    # Score responses with a reward model (its score replaces the rule reward).
    c.reward_model.enable = False
    c.reward_model.model = ml_collections.ConfigDict()
    # Local HF *ForSequenceClassification checkpoint directory (with its tokenizer).
    c.reward_model.model.path = config_dict.placeholder(str)
    # Most tokens of prompt + response the reward model reads.
    c.reward_model.max_length = 1024
    # Truncation of longer conversations: "left" (keep the end), "right" or "error".
    c.reward_model.truncation = "left"
    # Sequences per reward-model forward pass (None: all at once).
    c.reward_model.micro_batch_size = config_dict.placeholder(int)
    c.reward_model.overlong_buffer = ml_collections.ConfigDict()
    # DAPO overlong shaping: penalise responses longer than response_length - len.
    c.reward_model.overlong_buffer.enable = False
    # Length of the buffer before the response limit over which the penalty grows.
    c.reward_model.overlong_buffer.len = 4
    # Penalty at the response limit (it grows linearly from 0 over the buffer).
    c.reward_model.overlong_buffer.penalty_factor = 1.0

    c.trainer = ml_collections.ConfigDict()
    # RL steps (0: total_epochs passes over the training prompts).
    c.trainer.total_training_steps = 0
    # Passes over the training prompts when total_training_steps is 0.
    c.trainer.total_epochs = 1
    # Checkpoint every this many steps and at the end (0: never).
    c.trainer.save_freq = 0
    # Validate every this many steps and at the end (0: never).
    c.trainer.test_freq = 0
    # Steps during which only the critic is trained.
    c.trainer.critic_warmup = 0
    # Validate before the first step.
    c.trainer.val_before_train = True
    # Checkpoints kept (None: all).
    c.trainer.max_actor_ckpt_to_keep = config_dict.placeholder(int)
    # Where metrics go: console, jsonl, tensorboard, wandb.
    c.trainer.logger = ("console", "jsonl", "tensorboard")
    # On a non-finite loss or gradient: skip the update and count it ("skip"), or stop ("raise").
    c.trainer.nan_policy = "skip"
    # Write the final actor as a Hugging Face checkpoint (when the model came from one).
    c.trainer.export_hf = True
    # Write each training step's samples to <dir>/<step>.jsonl, one JSON line per response:
    # input (prompt text), output (response text, tool blocks included), gts (ground
    # truth), score, step and the reward's extra values (verl's; None: off).
    c.trainer.rollout_data_dir = config_dict.placeholder(str)
    # Write each validation's samples to <dir>/<step>.jsonl as rollout_data_dir does
    # (step 0: the validation before training; verl's; None: off).
    c.trainer.validation_data_dir = config_dict.placeholder(str)
    # Print the first this many samples of each validation on the console: prompt,
    # response (a multi-turn one with its tool turns) and score (verl's; 0: none).
    c.trainer.log_val_generations = 0
    # Start of a run in a workdir that already holds one: "auto" (same config: resume;
    # changed keys: stop and list them), "disable" (start over: the workdir's
    # checkpoints, warm start and metrics are removed) or "resume_path" (resume from
    # trainer.resume_from_path, whatever changed).
    c.trainer.resume_mode = "auto"
    # With resume_mode="resume_path": a checkpoint directory, <workdir>/checkpoints/<step>.
    c.trainer.resume_from_path = config_dict.placeholder(str)
    # Runs trained at once in one program, vmapped (needs reward.in_graph_fn; jrl.rl.runs):
    # seeds seed, seed + 1, ... for each setting of trainer.sweep.
    c.trainer.runs = 1
    # Hyperparameters that differ between the runs, crossed with the seeds, as
    # "key=v1,v2,..." (several joined by ";"); sweepable: actor.optim.lr, actor.clip_ratio,
    # rollout.temperature and algorithm.kl_ctrl.kl_coef (with use_kl_in_reward). None: none.
    c.trainer.sweep = config_dict.placeholder(str)
    # RL and warm-start steps per device program (a lax.scan; needs reward.in_graph_fn).
    # Validation and checkpoints happen between calls; a call never crosses their steps.
    c.trainer.steps_per_call = 1
    # JAX's persistent compilation cache, set by `python -m jrl.train` before anything
    # compiles, so a second start of a config reads its programs back instead of
    # compiling them (jrl.app.compilation_cache). A path wins over the environment; None:
    # $JAX_COMPILATION_CACHE_DIR when set, else $XDG_CACHE_HOME/jrl/xla (~/.cache/jrl/xla);
    # "": off (jax's own setting left alone). Library use of jrl never sets it.
    c.trainer.compilation_cache_dir = config_dict.placeholder(str)
    # Compile the first step's programs (rollout, forward, update; the first validation's
    # rollout with val_before_train; with rollout.partial, the rounds' programs for every
    # prefix width) at once, one thread each, before the step, which then
    # waits for less than the sum of their compiles (RLTrainer.compile_programs). None: on
    # a GPU or TPU, off on a CPU (whose compiles share its cores with each other: tests ran
    # slower). Off, and for runs with rollout.devices, multi-turn, rollout.cache_segments
    # > 1 or several runs in one program (trainer.runs, reward.in_graph_fn), each program
    # compiles when first called.
    c.trainer.parallel_compile = config_dict.placeholder(bool)
    return c


def _add_update_keys(model: ml_collections.ConfigDict, lr: float) -> None:
    """The keys actor and critic share: optimizer and PPO mini-batching."""
    model.optim = _optim(lr)
    # Global-norm gradient clipping (0: off).
    model.grad_clip = 1.0
    # Prompts per optimizer step, multiplied by rollout.n as in verl.
    model.ppo_mini_batch_size = 16
    # Sequences per forward/backward pass; gradients accumulate over a mini-batch.
    model.ppo_micro_batch_size = 64
    # Token-budget micro-batches (verl's use_dynamic_bsz, padding removed): the update's
    # sequences are packed end to end, each with its own positions and no attention
    # across them, into micro-batches of ppo_max_token_len_per_gpu tokens per device;
    # their number follows the real token count. ppo_micro_batch_size, response_buckets
    # and share_prompts then do not apply to this update. The long-response setting.
    model.use_dynamic_bsz = False
    # Tokens (prompt + response) per device per micro-batch with use_dynamic_bsz; at
    # least data.max_prompt_length + rollout.response_length.
    model.ppo_max_token_len_per_gpu = 16384
    # Passes over each batch.
    model.ppo_epochs = 1
    # Reshuffle the batch before splitting it into mini-batches, each epoch (verl: off).
    model.shuffle = False


def _optim(lr: float) -> ml_collections.ConfigDict:
    o = ml_collections.ConfigDict()
    # Peak learning rate (AdamW).
    o.lr = lr
    # Decoupled weight decay.
    o.weight_decay = 0.01
    # Adam betas.
    o.betas = (0.9, 0.999)
    # Linear warmup steps.
    o.lr_warmup_steps = 0
    # constant or cosine (after warmup).
    o.lr_scheduler_type = "constant"
    # Cosine floor as a fraction of lr.
    o.min_lr_ratio = 0.0
    return o


# How a bool variant may be written (any case).
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def sibling_config(config_file: str, name: str):
    """The config module `name` from the directory of `config_file`, loaded by path, so a
    config file that builds on another works from any working directory."""
    path = os.path.join(os.path.dirname(os.path.abspath(config_file)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"jrl_config_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_arg(arg: str | None, **defaults) -> ml_collections.FrozenConfigDict:
    """The variant a config file was asked for: `"n=16,lr=3e-4"` over `defaults`.

    `--config=configs/grpo_arith.py:n=16,lr=3e-4` passes the text after the colon to
    `get_config(arg)` (ml_collections' config flags), as in big_vision; the config file
    reads it with `parse_arg(arg, n=8, lr=1e-4)`. Each value takes the type of its
    default: int, float (finite), bool (true/false, 1/0, yes/no) or str.

    Args:
      arg: comma-separated `name=value` pairs; None or "" gives the defaults.
      **defaults: every name the config file accepts, with its value when not given.

    Returns:
      A frozen ConfigDict of every name in `defaults` (`a.n`, `a.lr`).

    Raises:
      ConfigError: an unknown name (the valid ones listed), a name given twice, an
        item without `=`, or a value that does not read as its default's type.
    """
    for name, default in defaults.items():
        if not isinstance(default, (bool, int, float, str)):
            raise TypeError(f"parse_arg: the default of {name} must be a bool, int, float or "
                            f"str, got {default!r}")
    valid = f"valid names: {', '.join(defaults)}" if defaults else "this config takes no arg"
    values, given = dict(defaults), set()
    for item in (arg or "").split(","):
        if not item.strip():
            continue
        name, eq, text = (part.strip() for part in item.partition("="))
        where = f"config arg {item.strip()!r}"
        if not eq or not name:
            raise ConfigError(f"{where}: expected name=value pairs separated by commas, e.g. "
                              f"'n=16,lr=3e-4'; {valid}")
        if name not in defaults:
            nearest = difflib.get_close_matches(name, list(defaults), n=1)
            hint = f" (did you mean {nearest[0]}?)" if nearest else ""
            raise ConfigError(f"{where}: unknown name {name!r}{hint}; {valid}")
        if name in given:
            raise ConfigError(f"{where}: {name} is given twice")
        given.add(name)
        values[name] = _parse_value(where, name, text, defaults[name])
    return ml_collections.FrozenConfigDict(values)


def _parse_value(where: str, name: str, text: str, default):
    if isinstance(default, str):
        return text
    if isinstance(default, bool):
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        kind = "true or false"
    else:
        kind = "an integer" if isinstance(default, int) else "a finite number"
        try:
            value = type(default)(text)
            if math.isfinite(value):
                return value
        except ValueError:
            pass
    raise ConfigError(f"{where}: {name} must be {kind} (default {default!r}), got {text!r}")
