"""One full RL step of the real trainer (`jrl.rl.trainer.RLTrainer.train_step`), timed by phase.

A GRPO step (reference + KL loss, no critic) and a PPO step (critic, GAE) on a
preset's shape with random weights: float32 master parameters, bfloat16 compute.
The defaults are the Qwen2.5-0.5B shape, 64 prompts x n=8 samples, prompts of
exactly 128 tokens, responses of up to 256 tokens. With `ignore_stop` (the
default) every response is generated to full length, so runs compare at a fixed
token count; `--natural_stops` lets rows end at a stop token instead (a random
model almost never samples the single EOS of a 152k vocabulary; `--stop_prob`
adds stop ids so that rows end after about 1/stop_prob tokens).

Mini-batching follows verl's GSM8K GRPO example, except that the whole batch is
one mini-batch: `ppo_mini_batch_size = batch` (one optimizer step per RL step),
one PPO epoch, KL loss (low_var_kl, 0.001), entropy_coeff 0. PPO uses the same
mini-batching for actor and critic, GAE with gamma = lam = 1 and, by default, a
KL penalty in the reward (so the step also runs the reference).

Reported per algorithm, as means over the timed steps (after `--warmup` steps
that compile): the trainer's `timing_s/*` phases, verl's throughput (prompt +
response tokens of the step / step time / #devices), the MFU of the actor update
(6 * params * tokens * ppo_epochs / update time / peak bf16 FLOP/s) and the peak
device memory of the process up to the end of that algorithm's steps (with
`--algo both`, GRPO runs first, so PPO's figure is the larger of the two). For the
first step, the seconds each program took to trace, lower and compile are printed
and kept (`first_step_compiles_s`; none for a program read back from
$JAX_COMPILATION_CACHE_DIR).

    python experiments/bench_rl_step.py --out rl_step.json                   # one H100
    python experiments/bench_rl_step.py --preset tiny --batch 4 --n 2 \\
        --prompt_len 16 --response_len 16 --steps 1 --warmup 1               # CPU smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.metadata
import json
import math
import os
import statistics
import tempfile
import time
import zlib

# Leave headroom above JAX's default 75% of the GPU: the log-prob stages run the
# whole batch in one program.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import trace_summary  # noqa: E402  (this folder is on the path when a script here runs)

from jrl import metrics  # noqa: E402
from jrl.app import experiment  # noqa: E402
from jrl.config import settings  # noqa: E402
from jrl.config.defaults import base_config  # noqa: E402
from jrl.data.dataset import BatchIterator  # noqa: E402
from jrl.models import ModelConfig  # noqa: E402
from jrl.rl.trainer import RLTrainer  # noqa: E402
from jrl.rollout import paged, sampler  # noqa: E402

# The trainer's phases: the rollout, `step.forward` (old and reference log-probs,
# values), waiting for the rewards, `step.learn` (advantages, critic and actor updates).
# Results written before the step became two programs name the finer phases
# (old_log_prob, ref, values, adv, update_critic, update_actor).
# With a sampling group (one-step asynchronous), `gen` runs beside the other phases and
# `wait_rollout` is the part of it the step waits for.
PHASES = ("gen", "sync_rollout_weights", "wait_rollout", "forward", "reward", "learn", "step")
# Partial rollouts' metrics in each step's line.
PARTIAL_METRICS = ("rollout/partial_rounds", "rollout/partial_in_flight_rows",
                   "rollout/partial_staleness/mean")


class CompileLog:
    """Seconds JAX spends tracing, lowering and compiling each program while `active`
    (jax.monitoring's duration events, by the jitted function's name). A program read
    back from the persistent compilation cache records no compile."""

    EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
              "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
              "/jax/core/compile/backend_compile_duration": "compile"}

    def __init__(self):
        self.active = False
        self.seconds: dict[str, dict[str, float]] = {}
        jax.monitoring.register_event_duration_secs_listener(self._record)

    def _record(self, event: str, duration: float, **kwargs) -> None:
        kind = self.EVENTS.get(event)
        if self.active and kind:
            name = str(kwargs.get("fun_name", "?"))  # "jit(f)" when lowered, "f" traced
            name = name[4:-1] if name.startswith("jit(") and name.endswith(")") else name
            per = self.seconds.setdefault(name, {})
            per[kind] = per.get(kind, 0.0) + duration

    def table(self, top: int = 12) -> str:
        """The programs that took longest, as a markdown table."""
        total = lambda per: sum(per.values())
        ranked = sorted(self.seconds.items(), key=lambda kv: -total(kv[1]))
        lines = ["| program | trace s | lower s | compile s |", "|---|---|---|---|"]
        lines += [f"| {name} | {per.get('trace', 0):.1f} | {per.get('lower', 0):.1f} | "
                  f"{per.get('compile', 0):.1f} |" for name, per in ranked[:top]]
        sums = {k: sum(per.get(k, 0.0) for per in self.seconds.values())
                for k in ("trace", "lower", "compile")}
        lines.append(f"| all {len(ranked)} | {sums['trace']:.1f} | {sums['lower']:.1f} | "
                     f"{sums['compile']:.1f} |")
        return "\n".join(lines)


COMPILES = CompileLog()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen2.5-0.5b", help="jrl.models.PRESETS name")
    p.add_argument("--num_layers", type=int, default=None,
                   help="the preset's layers, fewer (a model too large for the card whole)")
    p.add_argument("--dtype", default="bfloat16", help="compute dtype (params stay float32)")
    p.add_argument("--algo", default="both", choices=("grpo", "ppo", "both"))
    p.add_argument("--batch", type=int, default=64, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt_len", type=int, default=128, help="tokens per prompt (exact)")
    p.add_argument("--response_len", type=int, default=256, help="most response tokens")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (compilation)")
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--natural_stops", action="store_true",
                   help="stop rows at stop tokens (default: every row runs to response_len)")
    p.add_argument("--stop_prob", type=float, default=0.0,
                   help="with --natural_stops: add ceil(stop_prob * vocab) stop ids, so a "
                        "near-uniform random model stops with about this chance per token")
    p.add_argument("--dynamic_bsz", action="store_true",
                   help="token-budget micro-batches (actor/critic use_dynamic_bsz)")
    p.add_argument("--max_token_len", type=int, default=16384,
                   help="tokens per device per micro-batch with --dynamic_bsz (every pass)")
    p.add_argument("--uniform_lengths", default=None, metavar="LO,HI",
                   help="rows stop at lengths drawn uniformly from [LO, HI] (seeded), "
                        "decoded as natural stops (needs --natural_stops)")
    p.add_argument("--long_tail", default=None, metavar="LO,HI,FRAC",
                   help="rows stop at lengths uniform in [LO, HI], except a FRAC share that "
                        "runs to --response_len, each row's length picked by its sampling "
                        "key (so a row carried over by partial rollouts keeps it); needs "
                        "--natural_stops")
    p.add_argument("--partial_max_tokens", type=int, default=0,
                   help="partial rollouts (rollout.partial) with this many tokens a row a "
                        "round; 0: off")
    p.add_argument("--partial_keep_cache", action="store_true",
                   help="rollout.partial_keep_cache: a round's cache handed to the next")
    p.add_argument("--kv_cache", default="contiguous", choices=sampler.KV_CACHES,
                   help="rollout.kv_cache; paged: --page_size, --num_pages, --max_num_seqs")
    p.add_argument("--page_size", type=int, default=16, help="rollout.page_size")
    p.add_argument("--num_pages", type=int, default=0,
                   help="rollout.num_pages (0: every decode slot at full length)")
    p.add_argument("--max_num_seqs", type=int, default=0, help="rollout.max_num_seqs (0: all)")
    p.add_argument("--micro_batch", type=int, default=32,
                   help="actor.ppo_micro_batch_size: sequences per forward/backward (global)")
    p.add_argument("--critic_micro_batch", type=int, default=None,
                   help="critic.ppo_micro_batch_size (default: --micro_batch)")
    p.add_argument("--mini_batch", type=int, default=None,
                   help="ppo_mini_batch_size in prompts (default: --batch, one update a step)")
    p.add_argument("--ppo_epochs", type=int, default=1)
    p.add_argument("--logprob_chunk_size", type=int, default=32,
                   help="response tokens per log-prob chunk: the old/ref log-prob stages hold "
                        "[B*n, chunk, vocab] float32 logits at once")
    p.add_argument("--log_prob_micro_batch", type=int, default=128,
                   help="sequences per old/ref log-prob and value forward (0: all at once)")
    p.add_argument("--response_buckets", type=int, default=4,
                   help="actor.response_buckets (1: every pass runs all response columns)")
    p.add_argument("--decode_buckets", type=int, default=None,
                   help="rollout.decode_buckets (1: the decode loop never compacts; default: "
                        "the trainer's, 4 or 8 from 4,096 response tokens)")
    p.add_argument("--rollout_gemm", default="cublas", choices=sampler.GEMMS,
                   help="rollout.gemm: how the sampler's matmuls compile on a GPU")
    p.add_argument("--share_prompts", default="on", choices=("on", "off"),
                   help="actor.share_prompts (off: every row runs its own prompt)")
    p.add_argument("--remat", default="none", choices=("none", "full", "dots_saveable"))
    p.add_argument("--scan_unroll", nargs="?", const="on", default="auto",
                   choices=("auto", "on", "off"),
                   help="model.scan_unroll: the update's layers unrolled (on), rolled (off) or "
                   "the default (auto: unrolled with --dynamic_bsz)")
    p.add_argument("--decode_attention", default="auto",
                   choices=("auto", "xla", "mosaic"),
                   help="model.decode_attention_impl")
    p.add_argument("--logprob_impl", default="auto", choices=("auto", "xla", "mosaic"),
                   help="model.logprob_impl")
    p.add_argument("--decode_head", default="auto", choices=("auto", "xla", "mosaic"),
                   help="model.decode_head_impl (the sampler's unembedding and draw)")
    p.add_argument("--attention_impl", default="auto", choices=("auto", "xla", "cudnn"),
                   help="model.attention_impl (the training passes' attention)")
    p.add_argument("--head_backward", default="mosaic", choices=("xla", "mosaic"),
                   help="jrl.kernels.logprob_head.BACKWARD: where the log-prob kernel's "
                        "backward forms d loss / d logits (mosaic: grad_logits on chip)")
    p.add_argument("--mosaic_tiles", default=None,
                   help="jrl.kernels.decode_attention.MOSAIC_TILES (with --decode_attention "
                        "mosaic): BLOCK,STAGES[,compact][,fused], e.g. 128,2,compact,fused")
    p.add_argument("--paged_fused", default=None, choices=("off", "auto", "always"),
                   help="jrl.kernels.decode_attention.PAGED_FUSED (with --kv_cache paged): "
                        "when the paged decode takes the fused Mosaic GPU kernel; unset: auto")
    p.add_argument("--paged_fused_max_splits", type=int, default=None,
                   help="PAGED_FUSED_TILES.fused_max_splits: with --paged_fused auto, the "
                        "most parts the unfused kernel would split a row's blocks into "
                        "where the fused one is taken")
    p.add_argument("--decode_split", default=None, metavar="PER_SM,MIN_SLOTS",
                   help="the decode kernel's split over slots (MosaicTiles.splits 0): "
                        "decode_attention.PROGRAMS_PER_MULTIPROCESSOR and MIN_SPLIT_SLOTS")
    p.add_argument("--head_blocks", default=None,
                   help="jrl.kernels.logprob_head.MOSAIC_FORWARD tiles: "
                   "t,v,k,stages,overlap,group,consumers")
    p.add_argument("--head_backward_blocks", default=None,
                   help="jrl.kernels.logprob_head.MOSAIC_BACKWARD tiles (grad_logits), as "
                        "--head_blocks")
    p.add_argument("--lora_rank", type=int, default=0,
                   help="model.lora_rank (0: full fine-tuning); the base is then frozen in "
                        "the compute dtype and only the adapters train")
    p.add_argument("--lora_alpha", type=float, default=None, help="default: 2 x rank")
    p.add_argument("--target_modules", default="all-linear")
    p.add_argument("--lora_rollout", default="merged", choices=("merged", "unmerged"),
                   help="model.lora_rollout")
    p.add_argument("--critic_lora_rank", type=int, default=0,
                   help="critic.model.lora_rank (PPO; needs --lora_rank)")
    p.add_argument("--no_ppo_kl_in_reward", action="store_true",
                   help="PPO without the KL-in-reward penalty (then it needs no reference)")
    p.add_argument("--recompute_old_log_probs", action="store_true",
                   help="actor.reuse_update_log_probs=False: run the old-log-prob pass even "
                        "when the update is on-policy")
    p.add_argument("--recompute_values", action="store_true",
                   help="critic.reuse_update_values=False: run the value pass even when the "
                        "critic's update is on-policy")
    p.add_argument("--mesh_data", type=int, default=-1)
    p.add_argument("--mesh_fsdp", type=int, default=1)
    p.add_argument("--mesh_tensor", type=int, default=1)
    p.add_argument("--mesh_context", type=int, default=1,
                   help="the context (sequence) axis: each sequence split over this many "
                        "devices in the passes after the rollout")
    p.add_argument("--mesh_expert", type=int, default=1,
                   help="the expert axis (mixture-of-experts): each device holds 1/this of "
                        "every MoE layer's experts and of the batch")
    p.add_argument("--rollout_devices", type=int, default=0,
                   help="rollout.devices: a sampling group of this many devices (one-step "
                        "asynchronous training); the mesh_* flags then describe the rest")
    p.add_argument("--rollout_tp", type=int, default=1,
                   help="rollout.tensor_model_parallel_size (the sampling group's)")
    p.add_argument("--staleness", type=int, default=1, help="rollout.staleness")
    p.add_argument("--rollout_is", default=None, choices=("token", "sequence"),
                   help="algorithm.rollout_correction.rollout_is (truncated IS)")
    p.add_argument("--rollout_is_threshold", default="2.0", help="u (TIS) or \"l_u\" (IcePop)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parallel_compile", default="on", choices=("on", "off"),
                   help="trainer.parallel_compile: the first step's programs compiled at once")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--trace_dir", default=None,
                   help="trace one more step of each algorithm here and summarise its kernels")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- data, tokenizer


class BenchTokenizer:
    """Ids written as decimal numbers: encoding and decoding cost next to nothing."""

    def __init__(self, vocab_size: int, pad_token_id: int, eos_token_ids: tuple[int, ...]):
        self._vocab_size = vocab_size
        self._pad = pad_token_id
        self._eos = tuple(eos_token_ids)

    vocab_size = property(lambda self: self._vocab_size)
    pad_token_id = property(lambda self: self._pad)
    eos_token_id = property(lambda self: self._eos[0])
    eos_token_ids = property(lambda self: self._eos)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kwargs):
        raise NotImplementedError("the benchmark's prompts are plain token strings")


def make_rows(num: int, prompt_len: int, vocab: int, avoid: set[int], seed: int) -> list[dict]:
    """verl-schema rows whose prompts encode to exactly `prompt_len` non-special ids."""
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab), np.fromiter(avoid, int))
    ids = rng.choice(allowed, size=(num, prompt_len))
    return [{"prompt": " ".join(map(str, row)), "data_source": "bench",
             "reward_model": {"ground_truth": ""}, "extra_info": {"index": i}}
            for i, row in enumerate(ids.tolist())]


def hash_reward(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """A cheap score in [0, 1) that differs between samples (GRPO groups get variance)."""
    return (zlib.crc32(solution_str.encode()) % 1000) / 1000.0


def stop_ids(model: ModelConfig, pad_id: int, natural: bool, stop_prob: float) -> tuple:
    eos = tuple(model.eos_token_ids) or (pad_id,)
    if not natural or stop_prob <= 0:
        return eos
    extra = math.ceil(stop_prob * model.vocab_size)
    # The highest ids (never used by the prompts of a small vocabulary's specials).
    candidates = [i for i in range(model.vocab_size - 1, -1, -1) if i not in eos and i != pad_id]
    return eos + tuple(candidates[:extra])


# ----------------------------------------------------------------------------- config, trainer


def make_config(args, algo: str):
    """The experiment config, built from `base_config()` as configs/*.py do."""
    c = base_config()
    c.seed = args.seed
    c.model.preset = args.preset
    c.model.num_layers = args.num_layers
    c.model.param_dtype = "float32"
    c.model.dtype = args.dtype
    c.model.remat = args.remat
    if "decode_attention_impl" in c.model:  # (older trees lack the key)
        c.model.decode_attention_impl = args.decode_attention
    if "logprob_impl" in c.model:
        c.model.logprob_impl = args.logprob_impl
    if args.decode_head != "auto":
        c.model.decode_head_impl = args.decode_head
    if args.attention_impl != "auto":
        c.model.attention_impl = args.attention_impl
    if args.scan_unroll != "auto":
        c.model.scan_unroll = args.scan_unroll == "on"
    if args.lora_rank:
        c.model.lora_rank = args.lora_rank
        c.model.lora_alpha = args.lora_alpha or 2.0 * args.lora_rank
        c.model.target_modules = args.target_modules
        c.model.lora_rollout = args.lora_rollout
        c.critic.model.lora_rank = args.critic_lora_rank
        c.critic.model.lora_alpha = 2.0 * args.critic_lora_rank
    c.data.train_batch_size = args.batch
    c.data.max_prompt_length = args.prompt_len
    c.rollout.n = args.n
    c.rollout.response_length = args.response_len
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.top_k = -1
    mini = args.mini_batch or args.batch
    for role, micro in (("actor", args.micro_batch),
                        ("critic", args.critic_micro_batch or args.micro_batch)):
        c[role].ppo_mini_batch_size = mini
        # A micro-batch larger than the mini-batch (small smoke runs) is the mini-batch.
        c[role].ppo_micro_batch_size = min(micro, mini * args.n)
        c[role].ppo_epochs = args.ppo_epochs
    c.actor.logprob_chunk_size = args.logprob_chunk_size
    c.actor.reuse_update_log_probs = not args.recompute_old_log_probs
    c.critic.reuse_update_values = not args.recompute_values
    c.actor.response_buckets = args.response_buckets
    if args.decode_buckets is not None:
        c.rollout.decode_buckets = args.decode_buckets
    c.rollout.gemm = args.rollout_gemm
    c.rollout.kv_cache = args.kv_cache
    c.rollout.page_size = args.page_size
    c.rollout.num_pages = args.num_pages
    c.rollout.max_num_seqs = args.max_num_seqs
    c.actor.share_prompts = args.share_prompts == "on"
    batch_sequences = args.batch * args.n
    if args.log_prob_micro_batch and batch_sequences % args.log_prob_micro_batch == 0:
        c.rollout.log_prob_micro_batch_size = args.log_prob_micro_batch
    if args.dynamic_bsz:
        for role in ("actor", "critic"):
            c[role].use_dynamic_bsz = True
            c[role].ppo_max_token_len_per_gpu = args.max_token_len
        c.rollout.log_prob_max_token_len_per_gpu = args.max_token_len
    # verl's rollout `ignore_eos`: every response runs to response_len.
    c.rollout.ignore_eos = not args.natural_stops
    if args.partial_max_tokens:
        c.rollout.partial = True
        c.rollout.partial_max_tokens = args.partial_max_tokens
        c.rollout.partial_keep_cache = args.partial_keep_cache
    c.actor.entropy_coeff = 0.0
    if algo == "grpo":
        c.algorithm.adv_estimator = "grpo"
        c.actor.use_kl_loss = True
        c.actor.kl_loss_coef = 0.001
        c.actor.kl_loss_type = "low_var_kl"
        c.algorithm.use_kl_in_reward = False
    else:
        c.algorithm.adv_estimator = "gae"
        c.algorithm.gamma = 1.0
        c.algorithm.lam = 1.0
        c.actor.use_kl_loss = False
        c.algorithm.use_kl_in_reward = not args.no_ppo_kl_in_reward
        c.algorithm.kl_penalty = "kl"
        c.algorithm.kl_ctrl.kl_coef = 0.001
    c.rollout.devices = args.rollout_devices
    c.rollout.tensor_model_parallel_size = args.rollout_tp
    c.rollout.staleness = args.staleness
    c.algorithm.rollout_correction.rollout_is = args.rollout_is
    c.algorithm.rollout_correction.rollout_is_threshold = args.rollout_is_threshold
    c.trainer.total_training_steps = args.warmup + args.steps + 1
    c.trainer.val_before_train = False
    c.trainer.test_freq = 0
    c.trainer.save_freq = 0
    c.trainer.logger = ("console",)
    if "parallel_compile" in c.trainer:  # (older trees lack the key)
        c.trainer.parallel_compile = args.parallel_compile == "on"
    if "mesh" in c:
        for axis in ("data", "fsdp", "tensor", "context", "expert"):
            if axis in c.mesh:
                c.mesh[axis] = getattr(args, f"mesh_{axis}")
    return c


def target_lengths(args) -> np.ndarray | None:
    """`--uniform_lengths`: each output row's response length, uniform in [LO, HI]
    (a fixed draw from `--seed`, the same in every step and run)."""
    if not args.uniform_lengths:
        return None
    lo, hi = (int(x) for x in args.uniform_lengths.split(","))
    if not (1 <= lo <= hi <= args.response_len) or not args.natural_stops:
        raise SystemExit("--uniform_lengths LO,HI needs 1 <= LO <= HI <= --response_len "
                         "and --natural_stops")
    return np.random.default_rng(args.seed).integers(lo, hi + 1, args.batch * args.n)


def stop_at_lengths(target_fn) -> None:
    """Makes the sampler stop each row at its target length `target_fn(rows, keys)` (`[M]`
    for the decode rows' output rows and sampling keys), as if it had emitted a stop
    token there: a random model cannot be made to, and the lengths of a reasoning batch
    are what the passes after the rollout are measured on. The decode loop sees the rows
    end (its batch compaction, or the paged cache's refill, follows them) exactly as
    with real stops; a continued row (partial rollouts) counts its tokens from its first
    call."""
    original = sampler._emit

    def emit(state, logits_nv, sampling):
        new = original(state, logits_nv, sampling)
        drawn = new.step if new.offsets is None else new.offsets + new.step
        reached = ~new.done & (drawn >= target_fn(new.rows, new.keys))
        return new.replace(done=new.done | reached,
                           lengths=jax.numpy.where(reached, drawn, new.lengths))

    stops = paged._stops

    def paged_stops(ctx, state, tokens):
        rows = jax.numpy.minimum(state.rows, ctx.num_rows - 1)
        drawn = ctx.offsets[rows] + state.lengths + 1
        return stops(ctx, state, tokens) | (drawn >= target_fn(rows, ctx.keys[rows]))

    sampler._emit = emit
    paged._stops = paged_stops


def stop_at_target_lengths(targets: np.ndarray) -> None:
    """`--uniform_lengths`: each output row at its length in `targets`."""
    stop_at_lengths(lambda rows, keys: jax.numpy.asarray(targets)[rows])


def stop_at_key_lengths(spec: str, response_len: int) -> None:
    """`--long_tail LO,HI,FRAC`: each row stops at a length picked by its sampling key's
    bits (the same in whichever call or round draws it): `response_len` for a FRAC share
    of the rows, else uniform in [LO, HI]."""
    lo, hi, frac = spec.split(",")
    lo, hi, frac = int(lo), int(hi), float(frac)
    if not (1 <= lo <= hi <= response_len and 0 <= frac <= 1):
        raise SystemExit("--long_tail LO,HI,FRAC needs 1 <= LO <= HI <= --response_len "
                         "and 0 <= FRAC <= 1")
    jnp = jax.numpy

    def target(rows, keys):
        bits = jax.random.key_data(keys).reshape(keys.shape[0], -1)
        long = bits[:, 0].astype(jnp.float32) / 2.0 ** 32 < frac
        return jnp.where(long, response_len, lo + bits[:, -1] % (hi - lo + 1))

    stop_at_lengths(target)


def attention_flops(args, targets: np.ndarray | None) -> float | None:
    """The update's attention FLOPs in one step (forward + backward, causal: 6 l^2 d per
    layer for a sequence of l tokens, d = heads x head_dim), known for forced and for
    `--uniform_lengths` lengths (None for other natural stops)."""
    model = ModelConfig.preset(args.preset)
    layers = args.num_layers or model.num_layers
    rows = args.batch * args.n
    if targets is not None:
        lengths = args.prompt_len + targets.astype(np.float64)
    elif not args.natural_stops:
        lengths = np.full(rows, args.prompt_len + args.response_len, np.float64)
    else:
        return None
    d = model.num_heads * model.head_dim
    return float(6.0 * d * layers * np.sum(lengths ** 2))


def build_trainer(args, algo: str, workdir: str):
    """The trainer as `jrl.train` builds it: mesh from `config.mesh`, parameters created
    in their shardings by `build_model`, then `RLTrainer`."""
    config = make_config(args, algo)
    s = settings.from_config(config)
    preset = ModelConfig.preset(args.preset)
    pad_id = preset.pad_token_id if preset.pad_token_id is not None else preset.eos_token_ids[0]
    tokenizer = BenchTokenizer(preset.vocab_size, pad_id, preset.eos_token_ids)
    sharder = experiment.build_sharder(s)
    model, params = experiment.build_model(s.experiment, tokenizer, sharder)
    stops = stop_ids(model, pad_id, args.natural_stops, args.stop_prob)
    rows = make_rows(2 * args.batch, args.prompt_len, model.vocab_size, {pad_id, *stops},
                     args.seed)
    s = s.with_data(stop_token_ids=stops, pad_token_id=pad_id, num_train_rows=len(rows))
    trainer = RLTrainer(s, model, params, tokenizer, rows, [], hash_reward, workdir,
                        args.seed, sharder=sharder,
                        rollout_sharder=experiment.build_rollout_sharder(s))
    iterator = BatchIterator(rows, args.batch, seed=args.seed, shuffle=True)
    info = dict(config=json.loads(config.to_json_best_effort()), num_stop_ids=len(stops),
                ignore_stop=s.rollout.ignore_stop, mini_batch_sequences=s.actor.update.mini_batch,
                micro_batch_sequences=s.actor.update.micro_batch, on_policy=s.actor.on_policy,
                critic_on_policy=s.critic is not None and s.critic.on_policy,
                mesh=dict(zip(sharder.mesh.axis_names, sharder.mesh.devices.shape, strict=True)),
                rollout_devices=args.rollout_devices, staleness=args.staleness)
    return trainer, iterator, info


# ----------------------------------------------------------------------------- measuring


def peak_memory_bytes() -> int | None:
    """The largest `peak_bytes_in_use` of this process's devices (None on CPU)."""
    stats = [d.memory_stats() for d in jax.local_devices()]
    peaks = [int(x["peak_bytes_in_use"]) for x in stats if x and "peak_bytes_in_use" in x]
    return max(peaks) if peaks else None


def mean(values):
    return statistics.fmean(values) if values else None


def run_algo(args, algo: str) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench_{algo}_") as workdir:
        start = time.perf_counter()
        trainer, iterator, info = build_trainer(args, algo, workdir)
        setup_s = time.perf_counter() - start
        print(f"[{algo}] trainer built in {setup_s:.1f} s\n{trainer.memory_report()}", flush=True)
        steps, first_compiles = [], {}
        for i in range(args.warmup + args.steps):
            start = time.perf_counter()
            COMPILES.seconds, COMPILES.active = {}, i == 0
            m = trainer.train_step(iterator)
            COMPILES.active = False
            m["wall_s"] = time.perf_counter() - start
            if i == 0:
                first_compiles = COMPILES.seconds
                print(f"[{algo}] the first step's programs:\n{COMPILES.table()}", flush=True)
            steps.append(m)
            timed = "timed" if i >= args.warmup else "warm-up"
            phases = ", ".join(f"{k} {m[f'timing_s/{k}']:.2f}" for k in PHASES
                               if f"timing_s/{k}" in m)
            partial = "".join(f", {k.removeprefix('rollout/partial_')} {m[k]:.2f}"
                              for k in PARTIAL_METRICS if k in m)
            print(f"[{algo}] step {i + 1} ({timed}): {m['wall_s']:.3f} s ({phases}), "
                  f"response_length/mean {m['response_length/mean']:.1f}{partial}", flush=True)
        if args.trace_dir:
            trace_dir = os.path.join(args.trace_dir, algo)
            with trace_summary.maybe_trace(trace_dir):
                trainer.train_step(iterator)
            trace_summary.summarize(trace_dir, top=40)
        num_params = trainer.num_params
        # Model FLOPs per token of the update (6N in full; less with LoRA's frozen base).
        flops_per_token = getattr(trainer, "train_flops_per_token", 6.0 * num_params)
        memory = trainer.memory_report()
        print(memory, flush=True)
        trainer.close()
        del trainer
        gc.collect()
    timed = steps[args.warmup:]
    if not timed:  # --steps 0: a compile and, with --trace_dir, a traced step only
        return dict(algo=algo, setup_s=setup_s, memory_report=memory,
                    warmup_wall_s=[m["wall_s"] for m in steps],
                    first_step_compiles_s=first_compiles, **info)
    devices = jax.device_count()
    phases = {k: mean([m[f"timing_s/{k}"] for m in timed if f"timing_s/{k}" in m])
              for k in PHASES}
    phases = {k: v for k, v in phases.items() if v is not None}
    tokens = mean([m["perf/total_num_tokens"] for m in timed])
    peak = metrics.peak_flops(jax.devices()[0].device_kind)
    epochs = args.ppo_epochs
    # `learn` holds the critic's update too (PPO): a lower bound on the actor's MFU then.
    mfu = (flops_per_token * tokens * epochs / phases["learn"] / (peak * devices)
           if peak and "learn" in phases else None)
    # The MFU above is the usual 6N FLOPs for every token of every row. What the update
    # executes is less: the unembedding only for response tokens, and with shared prompts
    # (actor.share_prompts) each prompt once per group of k rows. Hardware FLOPs
    # utilisation: 6 x (non-embedding weights) per token run through the layers plus
    # 6 x V x D per response token (attention and rematerialisation not counted).
    batch_shards = devices // max(args.mesh_tensor * args.mesh_context, 1)  # data x fsdp
    k = math.gcd(args.n, args.micro_batch // batch_shards) if args.share_prompts == "on" else 1
    rows = args.batch * args.n
    prompt_tokens = mean([m["prompt_length/mean"] for m in timed]) * rows
    response_tokens = tokens - prompt_tokens
    model = ModelConfig.preset(args.preset)
    unembed = model.vocab_size * model.hidden_size
    layers = flops_per_token / 6.0 - unembed * (1 if model.tie_word_embeddings else 2)
    executed = 6.0 * (layers * (prompt_tokens / k + response_tokens) + unembed * response_tokens)
    hfu = (executed * epochs / phases["learn"] / (peak * devices)
           if peak and "learn" in phases else None)
    # The MFU with attention's FLOPs counted as well (6N per token + causal attention).
    attention = attention_flops(args, target_lengths(args))
    mfu_attention = ((flops_per_token * tokens + attention) * epochs / phases["learn"]
                     / (peak * devices) if peak and attention and "learn" in phases else None)
    return dict(
        algo=algo, setup_s=setup_s, prompt_group=k, hfu_actor=hfu,
        mfu_actor_with_attention=mfu_attention, attention_flops=attention,
        warmup_wall_s=[m["wall_s"] for m in steps[:args.warmup]],
        first_step_compiles_s=first_compiles,
        timed_wall_s=[m["wall_s"] for m in timed], phases_s=phases,
        phases_per_step_s=[{k: m[f"timing_s/{k}"] for k in PHASES if f"timing_s/{k}" in m}
                           for m in timed],
        tokens_per_step=tokens, response_length_mean=mean([m["response_length/mean"]
                                                            for m in timed]),
        throughput_tokens_per_s_per_device=tokens / phases["step"] / devices,
        trainer_perf_throughput=mean([m["perf/throughput"] for m in timed]),
        mfu_actor=mfu, trainer_perf_mfu_actor=mean([m.get("perf/mfu/actor") for m in timed
                                                    if m.get("perf/mfu/actor") is not None]),
        num_params=num_params, flops_per_token=flops_per_token, memory_report=memory,
        peak_memory_bytes_process=peak_memory_bytes(),
        last_metrics={k: v for k, v in timed[-1].items() if isinstance(v, (int, float))},
        **info,
    )


def versions() -> dict:
    found = {}
    for name in ("jax", "jaxlib", "flax", "optax"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def print_table(args, results) -> None:
    stops = "natural stops" if args.natural_stops else "forced full length (ignore_stop)"
    params = "fp32 params"
    if args.lora_rank:
        params = (f"LoRA r{args.lora_rank} ({args.lora_rollout} rollout): "
                  f"{args.dtype} base + fp32 adapters")
    print(f"\n{args.preset}, {params} / {args.dtype} compute, {args.batch} prompts x "
          f"n={args.n}, P={args.prompt_len}, R<={args.response_len}, {stops}; "
          f"{args.steps} timed steps after {args.warmup} warm-up; "
          f"{jax.device_count()} x {jax.devices()[0].device_kind}\n")
    names = [r["algo"] for r in results]
    print("| phase (s) | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for phase in PHASES:
        cells = [f"{r['phases_s'][phase]:.3f}" if phase in r["phases_s"] else "-"
                 for r in results]
        print(f"| {phase} | " + " | ".join(cells) + " |")
    rows = [
        ("tokens/step (prompt+response)", lambda r: f"{r['tokens_per_step']:.0f}"),
        ("response length (mean)", lambda r: f"{r['response_length_mean']:.1f}"),
        ("throughput (tok/s/device)", lambda r: f"{r['throughput_tokens_per_s_per_device']:.0f}"),
        ("MFU actor update", lambda r: "-" if r["mfu_actor"] is None
         else f"{100 * r['mfu_actor']:.1f}%"),
        ("MFU actor update, attention counted", lambda r: "-"
         if r.get("mfu_actor_with_attention") is None
         else f"{100 * r['mfu_actor_with_attention']:.1f}%"),
        ("HFU actor update (executed FLOPs)", lambda r: "-" if r["hfu_actor"] is None
         else f"{100 * r['hfu_actor']:.1f}% (prompt group {r['prompt_group']})"),
        ("peak memory (GiB, process)", lambda r: "-" if r["peak_memory_bytes_process"] is None
         else f"{r['peak_memory_bytes_process'] / 2**30:.2f}"),
        ("first step (compile) s", lambda r: f"{r['warmup_wall_s'][0]:.1f}"
         if r["warmup_wall_s"] else "-"),
    ]
    for label, fn in rows:
        print(f"| {label} | " + " | ".join(fn(r) for r in results) + " |")


def set_head_kernel(args) -> None:
    """`--head_blocks`, `--head_backward_blocks`: the log-prob kernels' tiles, and
    `--head_backward`: where the backward forms d loss / d logits (`jrl.kernels.logprob_head`)."""
    from jrl.kernels import logprob_head
    blocks = lambda spec: logprob_head.MosaicBlocks(*map(int, spec.split(",")))
    if args.head_blocks:
        logprob_head.MOSAIC_FORWARD = blocks(args.head_blocks)
    if args.head_backward_blocks:
        logprob_head.MOSAIC_BACKWARD = blocks(args.head_backward_blocks)
    logprob_head.BACKWARD = args.head_backward


def set_mosaic_tiles(spec: str | None) -> None:
    """`--mosaic_tiles`: the Mosaic GPU decode kernel's settings (`decode_attention`)."""
    if spec:
        from jrl.kernels import decode_attention
        decode_attention.MOSAIC_TILES = decode_attention.MosaicTiles.from_spec(spec)


def set_decode_split(spec: str | None) -> None:
    """`--decode_split`: when the decode kernel splits a long cache's slots."""
    if spec:
        from jrl.kernels import decode_attention
        per_sm, min_slots = map(int, spec.split(","))
        decode_attention.PROGRAMS_PER_MULTIPROCESSOR = per_sm
        decode_attention.MIN_SPLIT_SLOTS = min_slots


def main(argv=None) -> None:
    args = parse_args(argv)
    set_head_kernel(args)
    set_mosaic_tiles(args.mosaic_tiles)
    set_decode_split(args.decode_split)
    if args.paged_fused:
        from jrl.kernels import decode_attention
        decode_attention.PAGED_FUSED = args.paged_fused
    if args.paged_fused_max_splits:
        from jrl.kernels import decode_attention
        decode_attention.PAGED_FUSED_TILES = dataclasses.replace(
            decode_attention.PAGED_FUSED_TILES, fused_max_splits=args.paged_fused_max_splits)
    algos = ("grpo", "ppo") if args.algo == "both" else (args.algo,)
    info = dict(versions=versions(), device=jax.devices()[0].device_kind,
                num_devices=jax.device_count(), backend=jax.default_backend())
    print(json.dumps(info), flush=True)
    targets = target_lengths(args)
    if targets is not None:
        stop_at_target_lengths(targets)
        info["target_length_mean"] = float(np.mean(targets))
    if args.long_tail:
        if not args.natural_stops:
            raise SystemExit("--long_tail needs --natural_stops")
        stop_at_key_lengths(args.long_tail, args.response_len)
    results = []
    for algo in algos:
        results.append(run_algo(args, algo))
        if args.out:  # after each algorithm, so a run cut short keeps what it measured
            with open(args.out, "w") as f:
                json.dump(dict(args=vars(args), **info, results=results), f, indent=1)
    if args.steps:
        print_table(args, results)
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
