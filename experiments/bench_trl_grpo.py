"""TRL's `GRPOTrainer` (no vLLM: transformers `generate`) on the shapes of bench_rl_step.py.

The reference point for `experiments/bench_rl_step.py --algo grpo`: a Qwen2 model
with the Qwen2.5-0.5B configuration and random weights (built here, no download),
a local word-level tokenizer whose "words" are token ids (`t123`), prompts of
exactly `--prompt_len` tokens, `--batch` prompts x `--n` generations per optimizer
step, completions forced to `--response_len` tokens (`min_new_tokens`, as
`ignore_stop` does in jrl) unless `--natural_stops`, a reference model
(`beta` > 0) and a cheap hash reward.

One optimizer step consumes the whole generation batch: `per_device_train_batch_size
= --micro_batch` and `gradient_accumulation_steps = batch * n / micro_batch`, so
TRL generates once per step (`steps_per_generation = gradient_accumulation_steps`)
and, with `num_iterations = 1`, skips the old-log-prob forward (jrl computes it, as
verl does). TRL's defaults otherwise: gradient checkpointing on, bf16, `loss_type
= "dapo"` (token mean over the generation batch, like jrl's token-mean), `scale_rewards
= "group"`, SDPA attention, fused AdamW. `--model_dtype float32` keeps float32
weights with bf16 autocast (jrl's float32 master parameters); the default
bfloat16 trains bf16 weights, as TRL's examples do.

Steps are timed between `on_step_end` callbacks (CUDA synchronised); generation
(`_generate_single_turn`) and generation + reference + reward + advantages
(`_generate_and_score_completions`) are timed by a subclass; the rest of a step is
the policy forward/backward over the micro-batches and the optimizer step.

    python experiments/bench_trl_grpo.py --out trl_grpo.json                  # one GPU
    python experiments/bench_trl_grpo.py --preset tiny --batch 4 --n 2 \\
        --prompt_len 16 --response_len 16 --steps 1 --warmup 1 --micro_batch 4  # CPU
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import statistics
import tempfile
import time
import zlib

import torch

PHASES = ("gen", "gen_ref_reward", "update", "step")
# Peak dense bf16 FLOP/s per GPU, for MFU (as jrl.metrics.PEAK_FLOPS).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}

# Qwen2.5-0.5B's config.json (random weights) and a tiny one for CPU smoke runs.
PRESETS = {
    "qwen2.5-0.5b": dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
        eos_token_id=151643, pad_token_id=151643),
    "tiny": dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rope_theta=1e4, rms_norm_eps=1e-6, tie_word_embeddings=True,
        eos_token_id=2, pad_token_id=0),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen2.5-0.5b", choices=sorted(PRESETS))
    p.add_argument("--model_dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="weight dtype; compute is bf16 either way (bf16=True)")
    p.add_argument("--batch", type=int, default=64, help="prompts per optimizer step")
    p.add_argument("--n", type=int, default=8, help="num_generations")
    p.add_argument("--prompt_len", type=int, default=128, help="tokens per prompt (exact)")
    p.add_argument("--response_len", type=int, default=256, help="max_completion_length")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps")
    p.add_argument("--steps", type=int, default=2, help="timed steps")
    p.add_argument("--natural_stops", action="store_true",
                   help="let completions end at EOS (default: forced to response_len)")
    p.add_argument("--stop_prob", type=float, default=0.0,
                   help="with --natural_stops: add ceil(stop_prob * vocab) EOS ids")
    p.add_argument("--micro_batch", type=int, default=16,
                   help="per_device_train_batch_size (sequences per forward/backward)")
    p.add_argument("--beta", type=float, default=0.001, help="KL coefficient (> 0: reference)")
    p.add_argument("--no_gradient_checkpointing", action="store_true",
                   help="turn off TRL's default gradient checkpointing")
    p.add_argument("--attn_implementation", default="sdpa")
    p.add_argument("--cpu", action="store_true", help="use_cpu=True (smoke test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- model, data


def special_tokens(preset: dict) -> dict[int, str]:
    if preset["eos_token_id"] == preset["pad_token_id"]:
        return {preset["eos_token_id"]: "<|endoftext|>"}
    return {preset["pad_token_id"]: "<pad>", preset["eos_token_id"]: "<eos>"}


def build_tokenizer(preset: dict):
    """A word-level tokenizer over `t0 ... t{V-1}` plus the specials, built locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = special_tokens(preset)
    vocab = {specials.get(i, f"t{i}"): i for i in range(preset["vocab_size"])}
    eos = specials[preset["eos_token_id"]]
    core = Tokenizer(models.WordLevel(vocab, unk_token=eos))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=eos,
                                   pad_token=specials[preset["pad_token_id"]],
                                   padding_side="left")


def stop_ids(preset: dict, natural: bool, stop_prob: float) -> list[int]:
    eos = preset["eos_token_id"]
    if not natural or stop_prob <= 0:
        return [eos]
    taken = {eos, preset["pad_token_id"]}
    extra = [i for i in range(preset["vocab_size"] - 1, -1, -1) if i not in taken]
    return [eos, *extra[:math.ceil(stop_prob * preset["vocab_size"])]]


def save_random_model(args, preset: dict, path: str, stops: list[int], device: str) -> int:
    """Writes a randomly initialised Qwen2 checkpoint (TRL builds policy and reference
    from the same path); returns the parameter count."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    fields = dict(preset)
    theta = fields.pop("rope_theta")
    config = Qwen2Config(**fields, hidden_act="silu", use_sliding_window=False,
                         rope_parameters={"rope_type": "default", "rope_theta": theta},
                         bos_token_id=preset["eos_token_id"])
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(getattr(torch, args.model_dtype))
    model.generation_config.eos_token_id = stops if len(stops) > 1 else stops[0]
    model.generation_config.pad_token_id = preset["pad_token_id"]
    model.save_pretrained(path)
    count = sum(p.numel() for p in model.parameters())
    del model
    return count


def make_prompts(num: int, prompt_len: int, preset: dict, avoid: set[int], seed: int):
    rng = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([i for i in range(preset["vocab_size"]) if i not in avoid])
    picks = allowed[torch.randint(len(allowed), (num, prompt_len), generator=rng)]
    return [" ".join(f"t{i}" for i in row) for row in picks.tolist()]


def hash_reward(completions, **kwargs) -> list[float]:
    """A cheap score in [0, 1) that differs between samples (as bench_rl_step.py's)."""
    return [(zlib.crc32(c.encode()) % 1000) / 1000.0 for c in completions]


# ----------------------------------------------------------------------------- timing


def make_trainer_class(sync):
    """GRPOTrainer with wall-clock timers around generation and scoring."""
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        bench_times: dict[str, list[float]]

        def _timed(self, name, fn, *args, **kwargs):
            sync()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            self.bench_times.setdefault(name, []).append(time.perf_counter() - start)
            return out

        def _generate_single_turn(self, *args, **kwargs):
            return self._timed("gen", super()._generate_single_turn, *args, **kwargs)

        def _generate_and_score_completions(self, *args, **kwargs):
            return self._timed("gen_ref_reward", super()._generate_and_score_completions,
                               *args, **kwargs)

    for name in ("_generate_single_turn", "_generate_and_score_completions"):
        if not hasattr(GRPOTrainer, name):
            print(f"warning: GRPOTrainer has no {name}; that phase is not timed")
    return TimedGRPOTrainer


def make_clock(sync):
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        """Wall time of every optimizer step, and the logged metrics."""

        def __init__(self):
            self.begin, self.ends, self.logs = None, [], []

        def on_train_begin(self, args, state, control, **kwargs):
            sync()
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            self.ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    return StepClock()


def versions() -> dict:
    found = {}
    for name in ("trl", "transformers", "accelerate", "datasets", "torch", "tokenizers"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def mean(values):
    return statistics.fmean(values) if values else None


# ----------------------------------------------------------------------------- main


def run(args) -> dict:
    import datasets
    from trl import GRPOConfig

    preset = PRESETS[args.preset]
    cuda = torch.cuda.is_available() and not args.cpu
    device = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sequences = args.batch * args.n
    if sequences % args.micro_batch:
        raise ValueError(f"--micro_batch {args.micro_batch} must divide batch x n = {sequences}")
    stops = stop_ids(preset, args.natural_stops, args.stop_prob)
    tokenizer = build_tokenizer(preset)
    prompts = make_prompts(args.batch * 4, args.prompt_len, preset,
                           {preset["pad_token_id"], *stops}, args.seed)
    assert all(len(ids) == args.prompt_len for ids in tokenizer(prompts[:4])["input_ids"])
    generation_kwargs = {} if args.natural_stops else {"min_new_tokens": args.response_len}

    with tempfile.TemporaryDirectory(prefix="bench_trl_") as tmp:
        start = time.perf_counter()
        num_params = save_random_model(args, preset, f"{tmp}/model", stops, device)
        tokenizer.save_pretrained(f"{tmp}/model")
        config = GRPOConfig(
            output_dir=f"{tmp}/out", max_steps=args.warmup + args.steps, seed=args.seed,
            per_device_train_batch_size=args.micro_batch,
            gradient_accumulation_steps=sequences // args.micro_batch,
            num_generations=args.n, max_completion_length=args.response_len,
            temperature=1.0, top_p=1.0, top_k=0, generation_kwargs=generation_kwargs,
            beta=args.beta, learning_rate=1e-6, lr_scheduler_type="constant",
            max_grad_norm=1.0, gradient_checkpointing=not args.no_gradient_checkpointing,
            bf16=True, use_cpu=not cuda, use_vllm=False,
            model_init_kwargs={"dtype": args.model_dtype,
                               "attn_implementation": args.attn_implementation},
            logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        )
        clock = make_clock(sync)
        trainer = make_trainer_class(sync)(
            model=f"{tmp}/model", reward_funcs=hash_reward, args=config,
            train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
            processing_class=tokenizer, callbacks=[clock])
        trainer.bench_times = {}
        setup_s = time.perf_counter() - start
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
        peak = torch.cuda.max_memory_allocated() if cuda else None
        setup = dict(
            steps_per_generation=config.steps_per_generation,
            generation_batch_size=config.generation_batch_size,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            loss_type=config.loss_type, scale_rewards=config.scale_rewards,
            num_iterations=config.num_iterations, optim=str(config.optim),
            gradient_checkpointing=config.gradient_checkpointing,
            ref_model=trainer.ref_model is not None,
            model_dtype=str(next(trainer.model.parameters()).dtype),
            eos_token_ids=list(trainer.eos_token_ids)[:8], num_stop_ids=len(stops),
        )

    marks = [clock.begin, *clock.ends]
    wall = [b - a for a, b in zip(marks[:-1], marks[1:], strict=True)]
    gen = trainer.bench_times.get("gen", [])
    scored = trainer.bench_times.get("gen_ref_reward", [])
    step_logs = [log for log in clock.logs if "completions/mean_length" in log]
    timed = slice(args.warmup, None)
    phases = {"gen": mean(gen[timed]), "gen_ref_reward": mean(scored[timed]),
              "step": mean(wall[timed])}
    if phases["gen_ref_reward"] is not None:
        phases["update"] = phases["step"] - phases["gen_ref_reward"]
    phases = {k: v for k, v in phases.items() if v is not None}
    lengths = [log["completions/mean_length"] for log in step_logs[timed]]
    response_mean = mean(lengths) if lengths else float(args.response_len)
    # TRL's `num_tokens` counts prompt + completion tokens (attention mask), cumulatively.
    seen = [0.0] + [log["num_tokens"] for log in step_logs if "num_tokens" in log]
    counted = [b - a for a, b in zip(seen[:-1], seen[1:], strict=True)][timed]
    tokens = mean(counted) if counted else sequences * (args.prompt_len + response_mean)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak_flops = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
    # jrl's definition (6 * params * tokens / update time): the update also spends the
    # recomputation of gradient checkpointing, which this does not count.
    mfu = (6.0 * num_params * tokens / phases["update"] / peak_flops
           if peak_flops and "update" in phases else None)
    return dict(
        setup_s=setup_s, warmup_wall_s=wall[:args.warmup], timed_wall_s=wall[timed],
        phases_s=phases, gen_per_step_s=gen, gen_ref_reward_per_step_s=scored,
        tokens_per_step=tokens, response_length_mean=response_mean,
        throughput_tokens_per_s=tokens / phases["step"],
        completion_tokens_per_s=sequences * response_mean / phases["step"],
        mfu_update=mfu, peak_memory_bytes=peak, num_params=num_params, device=device,
        device_name=name,
        trl_step_time_s=mean([log["step_time"] for log in step_logs[timed]
                              if "step_time" in log]),
        trl_setup=setup, logs=clock.logs,
    )


def print_table(args, r) -> None:
    stops = "natural stops" if args.natural_stops else "forced full length (min_new_tokens)"
    print(f"\nTRL GRPO, {args.preset} ({r['num_params'] / 1e6:.0f}M params, "
          f"{r['trl_setup']['model_dtype']} weights, bf16), {args.batch} prompts x "
          f"n={args.n}, P={args.prompt_len}, R<={args.response_len}, {stops}; "
          f"micro-batch {args.micro_batch} x {r['trl_setup']['gradient_accumulation_steps']} "
          f"accumulation, gradient checkpointing {r['trl_setup']['gradient_checkpointing']}; "
          f"{args.steps} timed steps after {args.warmup} warm-up; {r['device_name']}\n")
    print("| phase (s) | TRL |")
    print("|---|---|")
    for phase in PHASES:
        print(f"| {phase} | " + (f"{r['phases_s'][phase]:.3f}" if phase in r["phases_s"]
                                 else "-") + " |")
    peak = r["peak_memory_bytes"]
    print(f"| tokens/step (prompt+response) | {r['tokens_per_step']:.0f} |")
    print(f"| response length (mean) | {r['response_length_mean']:.1f} |")
    print(f"| throughput (tok/s/device) | {r['throughput_tokens_per_s']:.0f} |")
    mfu = r["mfu_update"]
    print(f"| MFU update (6·N·T) | {'-' if mfu is None else f'{100 * mfu:.1f}%'} |")
    print(f"| peak memory (GiB, max_memory_allocated) | "
          f"{'-' if peak is None else f'{peak / 2**30:.2f}'} |")
    if r["warmup_wall_s"]:
        print(f"| first step s | {r['warmup_wall_s'][0]:.1f} |")


def main(argv=None) -> None:
    args = parse_args(argv)
    info = dict(versions=versions())
    print(json.dumps(info), flush=True)
    result = run(args)
    print_table(args, result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), **info, result=result), f, indent=1, default=str)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
