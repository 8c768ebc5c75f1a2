"""Rollout throughput: `jrl.rollout.sampler.generate` against its HBM roofline and HF `generate`.

Random weights of a preset's shape (no downloads), left-padded random prompts,
`ignore_stop=True` so every row generates exactly `--new-tokens` tokens. For each
batch size it reports compile time, steady-state time (median of `--repeats`
runs after a warm-up, `block_until_ready`), tokens/s = B·R / time, and the
decode-step HBM roofline:

    bytes/step = weight bytes + KV bytes read (real tokens only, averaged over the
                 R steps) + KV bytes written (one token per row and layer)

where an MoE layer's weight bytes count only the experts a step reads: with B rows
routed uniformly to k of E experts, E (1 - (1 - k/E)^B) of them (for Qwen3-30B-A3B's E 128,
k 8: all of them at batch 256, 98.4% at batch 64), and an untied model's input embedding
table only the B rows a step gathers (tied, it is read whole as the head).
    roofline tokens/s = B / (bytes/step / bandwidth)

The measured time includes the prefill, so the % of roofline is a lower bound
for the decode loop. "% bound" compares the time with ideal kernels instead
(`bound_seconds`, `--peak-tflops`: by default an H100's or H200's 989): the prefill,
then each decode step's matmuls at the dense peak or at the weights' bytes, whichever
is longer, and its attention at the bandwidth, one after the other. Then the same
model in PyTorch (`Qwen2ForCausalLM` etc. from the preset's HF config, random weights,
same dtype, cuda when available)
runs `transformers` `generate` with the same sampling settings and
`min_new_tokens = max_new_tokens`.

    python experiments/bench_rollout.py --out bench_rollout.json          # one H100
    python experiments/bench_rollout.py --preset tiny --batch-sizes 4 \\
        --prompt-len 8 --new-tokens 8                                     # CPU smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import itertools
import json
import os
import statistics
import time

# JAX would otherwise reserve 75% of the GPU and leave PyTorch too little.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import trace_summary  # noqa: E402  (this folder is on the path when a script here runs)

from jrl import metrics  # noqa: E402
from jrl.kernels import decode_attention as decode_lib  # noqa: E402
from jrl.models import ModelConfig, init_params, moe, transformer  # noqa: E402
from jrl.rl import step  # noqa: E402
from jrl.rollout import paged, sampler  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen2.5-0.5b", help="jrl.models.PRESETS name")
    parser.add_argument("--num_layers", type=int, default=None,
                        help="fewer layers than the preset's (a model that would not fit)")
    parser.add_argument("--dtype", default="bfloat16", help="parameter and compute dtype")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt-len", type=int, default=128, help="P (left-padded)")
    parser.add_argument("--new-tokens", type=int, default=256, help="R, all generated")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1, help="-1 or 0 = off")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after warm-up")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="dense 16-bit matmul peak for the bound (default: the device's "
                             "from jrl.metrics.PEAK_FLOPS; elsewhere no bound is given)")
    parser.add_argument("--hbm-gbps", type=float, default=None,
                        help="HBM bandwidth for the roofline (default: the device's from "
                             "jrl.metrics.PEAK_HBM_GBPS, else H100 SXM's 3350)")
    parser.add_argument("--decode-attention", nargs="+", default=["auto"],
                        choices=("auto", "xla", "mosaic"),
                        help="model decode_attention_impl values to run (one row each)")
    parser.add_argument("--mosaic-tiles", default=None,
                        help="the Mosaic GPU decode kernel's settings for every 'mosaic' row "
                             "(decode_attention.MOSAIC_TILES): BLOCK,STAGES[,compact][,fused], "
                             "e.g. 128,2,compact,fused")
    parser.add_argument("--fuse-projections", nargs="+", default=["on"], choices=("on", "off"),
                        help="model fuse_decode_projections values to run (one row each)")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="LoRA adapters of this rank on every linear layer (0: none)")
    parser.add_argument("--lora-rollout", nargs="+", default=["merged"],
                        choices=("merged", "unmerged"),
                        help="with --lora-rank: model lora_rollout values to run (one row "
                             "each); merged includes forming W + A B in the timed program")
    parser.add_argument("--gemm", nargs="+", default=["cublas"], choices=sampler.GEMMS,
                        help="how the sampler's matmuls compile on a GPU (SamplingConfig.gemm)")
    parser.add_argument("--kv-cache", nargs="+", default=["contiguous"], choices=sampler.KV_CACHES,
                        help="the sampler's KV cache (SamplingConfig.kv_cache); paged: every "
                        "row a decode slot, the whole pool (--page-size slots a page)")
    parser.add_argument("--page-size", type=int, nargs="+", default=[16],
                        help="SamplingConfig.page_size (each a run of the paged cache)")
    parser.add_argument("--paged-fused", nargs="+", default=["auto"],
                        choices=decode_lib.PAGED_FUSED_MODES,
                        help="when the paged cache's decode steps take the fused kernel "
                        "(decode_attention.PAGED_FUSED; each a run of the paged cache)")
    parser.add_argument("--moe-gate-up", nargs="+", default=["joined"],
                        choices=("joined", "separate"),
                        help="an MoE model's decode: the experts' gate and up kernels as one "
                        "grouped matmul or two (moe.JOIN_GATE_UP; each a run)")
    parser.add_argument("--decode-head", nargs="+", default=["auto"],
                        choices=("auto", "xla", "mosaic"),
                        help="model decode_head_impl values to run (one row each): the decode "
                        "step's unembedding and draw, the kernel's masses or XLA's logits")
    parser.add_argument("--kernel-bias", nargs="+", default=["once"], choices=("once", "each-step"),
                        help="the fused decode kernel's qkv-bias operand made once a rollout "
                             "(`transformer.with_kernel_bias`, the default) or none made "
                             "ahead, so every layer of every decode step gathers it")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers generate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace_dir", default=None,
                        help="trace one more run of each row here and summarise its kernels")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    return parser.parse_args()


def make_prompts(batch: int, prompt_len: int, vocab: int, seed: int):
    """Left-padded random prompts whose lengths are uniform in [P/2, P]."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(1, prompt_len // 2), prompt_len + 1, size=batch)
    mask = np.arange(prompt_len)[None, :] >= (prompt_len - lengths)[:, None]
    ids = rng.integers(0, vocab, size=(batch, prompt_len))
    return np.where(mask, ids, 0).astype(np.int32), mask.astype(np.int32)


def experts_read(config: ModelConfig, batch: int) -> float:
    """The experts an MoE layer's decode step reads on average for `batch` tokens of k
    experts each, routed uniformly: E (1 - (1 - k / E)^B); E for a dense model (its one
    MLP counted whole)."""
    if not config.is_moe:
        return 1.0
    e, k = config.num_experts, config.num_experts_per_tok
    return e * (1.0 - (1.0 - k / e) ** batch)


def step_weight_bytes(params, config: ModelConfig, batch: int) -> float:
    """The weight bytes a decode step of `batch` rows reads: every weight, except that an
    MoE layer reads only the experts its tokens chose (`experts_read`) and an untied
    model's input embedding table only the rows of the step's tokens (tied, the table is
    read whole as the head)."""
    weight_bytes = 0.0
    share = experts_read(config, batch) / config.num_experts if config.is_moe else 1.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = [getattr(p, "key", None) for p in path]
        expert = config.is_moe and "mlp" in keys and "router" not in keys
        if keys[0] == "embed" and not config.tie_word_embeddings:
            weight_bytes += leaf.nbytes * batch / leaf.shape[0]
        else:
            weight_bytes += leaf.nbytes * (share if expert else 1.0)
    return weight_bytes


def kv_token_bytes(config: ModelConfig) -> int:
    """The key and value bytes of one token over all layers."""
    itemsize = np.dtype(config.dtype).itemsize
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize


def roofline(params, config: ModelConfig, mask: np.ndarray, new_tokens: int, gbps: float):
    """(bytes per decode step, roofline tokens/s) from the weights a step reads
    (`step_weight_bytes`) and the real KV tokens."""
    batch = mask.shape[0]
    # Step i reads the cache of each row's prompt plus i generated tokens.
    mean_read_tokens = mask.sum() + batch * (new_tokens - 1) / 2
    step_bytes = (step_weight_bytes(params, config, batch)
                  + kv_token_bytes(config) * (mean_read_tokens + batch))
    return float(step_bytes), float(batch / (step_bytes / (gbps * 1e9)))


def matmul_params(params, config: ModelConfig) -> tuple[float, float]:
    """(weights a token multiplies in the layers, in the head): every matmul kernel, an MoE
    layer's experts at k of E; the head is the embedding table where tied."""
    layers = head = 0.0
    share = config.num_experts_per_tok / config.num_experts if config.is_moe else 1.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = [getattr(p, "key", None) for p in path]
        if keys[0] == "lm_head" or (keys[0] == "embed" and config.tie_word_embeddings):
            head += leaf.size
        elif keys[-1] == "kernel":
            expert = config.is_moe and "mlp" in keys and "router" not in keys
            layers += leaf.size * (share if expert else 1.0)
    return layers, head


def bound_seconds(params, config: ModelConfig, mask: np.ndarray, new_tokens: int,
                  gbps: float, tflops: float) -> float:
    """The least time a rollout's kernels can take on a chip of `gbps` and `tflops`, its
    matmuls and its attention run one after the other (as a decode step's kernels do),
    each at whichever of the chip's bandwidth and its peak bounds it: the prefill's
    matmuls and causal attention (the head on each row's last token), then for each
    decode step its matmuls (the weights read once, 2 FLOPs per weight a row multiplies)
    and its attention (the cache `roofline` counts, 4 FLOPs per query head, dimension and
    filled slot). The roofline's HBM bound counts the decode steps' bytes alone; at a few
    hundred rows a step's matmuls are at or past the chip's ridge, which this bound sees.
    Sliding-window layers are counted over the whole cache, as in the roofline."""
    layers, head = matmul_params(params, config)
    attn = 4.0 * config.num_layers * config.num_heads * config.head_dim  # FLOPs a query-key pair
    lengths = mask.sum(axis=1).astype(np.float64)
    batch = len(lengths)
    peak, bandwidth = tflops * 1e12, gbps * 1e9
    weight_bytes, kv_bytes = step_weight_bytes(params, config, batch), kv_token_bytes(config)
    seconds = (max(weight_bytes / bandwidth,
                   (2 * layers * lengths.sum() + 2 * head * batch) / peak)
               + attn * (lengths * (lengths + 1) / 2).sum() / peak)
    matmuls = max(weight_bytes / bandwidth, 2 * (layers + head) * batch / peak)
    for i in range(new_tokens - 1):  # the first token comes from the prefill's head
        filled = lengths.sum() + batch * (i + 1)
        seconds += matmuls + max(kv_bytes * (filled + batch) / bandwidth,
                                 attn * filled / peak)
    return seconds


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_jrl(config, params, ids, mask, sampling, repeats, trace_dir=None):
    """(compile s, steady s) of one jitted `generate`."""
    def generate(params, ids, mask, key):
        sampler_config, params = step.sampling_params(params, config)
        generate = paged.generate if sampling.kv_cache == "paged" else sampler.generate
        return generate(params, ids, mask, key, sampling=sampling, config=sampler_config)

    key = jax.random.key(0)
    start = time.perf_counter()
    compiled = jax.jit(generate, compiler_options=sampler.compiler_options(sampling)).lower(
        params, ids, mask, key).compile()
    compile_s = time.perf_counter() - start
    ids, mask = jax.device_put(ids), jax.device_put(mask)
    run = lambda: jax.block_until_ready(compiled(params, ids, mask, key))
    out = run()  # warm-up
    assert int(np.asarray(out.response_lengths).min()) == sampling.max_new_tokens
    seconds = median_seconds(run, repeats)
    if trace_dir:
        with trace_summary.maybe_trace(trace_dir):
            run()
        trace_summary.summarize(trace_dir)
        trace_summary.busy(trace_dir)
    return compile_s, seconds


def build_hf_model(config: ModelConfig, device: str):
    import torch
    import transformers

    hf = config.to_hf()
    hf_config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    model_cls = getattr(transformers, hf["architectures"][0])
    dtype = getattr(torch, config.dtype)
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls(hf_config).to(dtype)
    return model.eval()


def bench_hf(model, ids, mask, args, pad_id: int, eos_ids) -> float:
    """Steady-state seconds of `model.generate` on the same prompts."""
    import torch

    device = next(model.parameters()).device
    ids_t = torch.as_tensor(ids, dtype=torch.long, device=device)
    mask_t = torch.as_tensor(mask, dtype=torch.long, device=device)
    kwargs = dict(
        do_sample=True, temperature=args.temperature, top_p=args.top_p,
        top_k=max(args.top_k, 0), max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens, pad_token_id=pad_id, eos_token_id=list(eos_ids) or None,
    )

    def run():
        with torch.inference_mode():
            out = model.generate(input_ids=ids_t, attention_mask=mask_t, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize()
        assert out.shape[1] == ids.shape[1] + args.new_tokens, out.shape

    run()  # warm-up
    return median_seconds(run, args.repeats)


def versions() -> dict:
    names = ("jax", "jaxlib", "flax", "torch", "transformers")
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def main() -> None:
    args = parse_args()
    layers = {"num_layers": args.num_layers} if args.num_layers else {}
    config = ModelConfig.preset(args.preset, dtype=args.dtype, param_dtype=args.dtype,
                                lora_rank=args.lora_rank, lora_alpha=2.0 * args.lora_rank,
                                **layers)
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(args.seed))
    eos_ids = config.eos_token_ids
    pad_id = config.pad_token_id if config.pad_token_id is not None else (eos_ids or (0,))[0]
    sampling = sampler.SamplingConfig(
        max_new_tokens=args.new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, stop_token_ids=eos_ids, pad_token_id=pad_id, ignore_stop=True,
    ).validate(config.vocab_size)
    if args.mosaic_tiles:
        decode_lib.MOSAIC_TILES = decode_lib.MosaicTiles.from_spec(args.mosaic_tiles)
    info = dict(versions=versions(), jax_device=jax.devices()[0].device_kind,
                mosaic_tiles=str(decode_lib.MOSAIC_TILES))
    hf_model = None
    if not args.no_hf:
        import torch

        hf_device = "cuda" if torch.cuda.is_available() else "cpu"
        info["torch_device"] = torch.cuda.get_device_name() if hf_device == "cuda" else "cpu"
        hf_model = build_hf_model(config, hf_device)
    print(json.dumps(info, indent=1))

    device_kind = jax.devices()[0].device_kind
    if args.hbm_gbps is None:
        args.hbm_gbps = metrics.peak_hbm_gbps(device_kind) or 3350.0
    if args.peak_tflops is None and (peak := metrics.peak_flops(device_kind)):
        args.peak_tflops = peak / 1e12
    results = []
    lora_rollouts = args.lora_rollout if args.lora_rank else ["unmerged"]
    caches = [(cache, page, fused) for cache in args.kv_cache
              for page in (args.page_size if cache == "paged" else [None])
              for fused in (args.paged_fused if cache == "paged" else [None])]
    gate_ups = args.moe_gate_up if config.is_moe else [None]
    kernel_biases = {"once": transformer.with_kernel_bias,
                     "each-step": lambda layer, config: layer}  # none made ahead
    for (batch, impl, lora_rollout, fuse, gemm, (kv_cache, page, paged_fused), gate_up, head,
         kernel_bias) in itertools.product(args.batch_sizes, args.decode_attention, lora_rollouts,
                                           args.fuse_projections, args.gemm, caches, gate_ups,
                                           args.decode_head, args.kernel_bias):
        made = kernel_biases[kernel_bias]
        if transformer.with_kernel_bias is not made:
            # Read when a program is traced, which no jit cache key holds: trace afresh.
            transformer.with_kernel_bias = made
            jax.clear_caches()
            sampler._jit.cache_clear()
        if paged_fused:  # read when `bench_jrl` traces
            decode_lib.PAGED_FUSED = paged_fused
        if gate_up:
            moe.JOIN_GATE_UP = gate_up == "joined"
            # Nothing is joined without fused projections or with unmerged adapters on
            # gate and up (every projection carries one here).
            if fuse == "off" or (args.lora_rank and lora_rollout == "unmerged"):
                gate_up = None
        ids, mask = make_prompts(batch, args.prompt_len, config.vocab_size, args.seed)
        cfg = dataclasses.replace(config, decode_attention_impl=impl, lora_rollout=lora_rollout,
                                  fuse_decode_projections=fuse == "on", decode_head_impl=head)
        trace_dir = args.trace_dir and os.path.join(
            args.trace_dir, f"b{batch}_{impl}_{lora_rollout}_{fuse}_{gemm}_{kv_cache}{page or ''}"
            + (f"_fused_{paged_fused}" if paged_fused else "")
            + (f"_{gate_up}" if gate_up else "") + f"_head_{head}"
            + ("" if kernel_bias == "once" else "_bias_each_step"))
        compile_s, jrl_s = bench_jrl(cfg, params, ids, mask,
                                     dataclasses.replace(sampling, gemm=gemm, kv_cache=kv_cache,
                                                         page_size=page or 16),
                                     args.repeats, trace_dir)
        step_bytes, roof_tps = roofline(params, config, mask, args.new_tokens, args.hbm_gbps)
        tokens = batch * args.new_tokens
        bound_s = (bound_seconds(params, config, mask, args.new_tokens, args.hbm_gbps,
                                 args.peak_tflops) if args.peak_tflops else None)
        row = dict(
            batch=batch, decode_attention=impl, fuse_projections=fuse, gemm=gemm,
            kv_cache=kv_cache, page_size=page, paged_fused=paged_fused, moe_gate_up=gate_up,
            decode_head=head, kernel_bias=kernel_bias,
            decode_head_taken=sampler.head_impl(cfg, sampling),
            lora_rank=args.lora_rank,
            lora_rollout=lora_rollout if args.lora_rank else None, compile_s=compile_s, jrl_s=jrl_s,
            jrl_tokens_per_s=tokens / jrl_s,
            step_gbytes=step_bytes / 1e9, roofline_tokens_per_s=roof_tps,
            experts_read_per_layer=experts_read(config, batch) if config.is_moe else None,
            pct_roofline=100 * tokens / jrl_s / roof_tps,
            bound_s=bound_s, pct_bound=bound_s and 100 * bound_s / jrl_s,
        )
        first = (impl == args.decode_attention[0] and lora_rollout == lora_rollouts[0]
                 and fuse == args.fuse_projections[0] and gemm == args.gemm[0]
                 and head == args.decode_head[0])
        if hf_model is not None and first:
            hf_s = bench_hf(hf_model, ids, mask, args, pad_id, eos_ids)
            row.update(hf_s=hf_s, hf_tokens_per_s=tokens / hf_s, jrl_over_hf=hf_s / jrl_s)
        results.append(row)
        print(f"batch {batch}: {row}", flush=True)

    print_table(args, results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), **info, results=results), f, indent=1)
        print(f"wrote {args.out}")


def print_table(args, results) -> None:
    print(f"\n{args.preset} {args.dtype}, P={args.prompt_len}, R={args.new_tokens}, "
          f"T={args.temperature}, top_p={args.top_p}, top_k={args.top_k}, "
          f"HBM {args.hbm_gbps:g} GB/s"
          + (f", {args.peak_tflops:g} TFLOP/s" if args.peak_tflops else "") + "\n")
    print("| B | decode attention | fused | GEMM | KV cache | LoRA | compile s | jrl s "
          "| jrl tok/s | GB/step | roofline tok/s | % roofline | HF tok/s | jrl/HF | % bound |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        hf = (f"{r['hf_tokens_per_s']:.0f} | {r['jrl_over_hf']:.2f}x" if "hf_s" in r
              else "- | -")
        lora_cell = f"r{r['lora_rank']} {r['lora_rollout']}" if r.get("lora_rank") else "-"
        cache = (r["kv_cache"] + (f"/{r['page_size']}" if r.get("page_size") else "")
                 + (f" fused {r['paged_fused']}" if r.get("paged_fused") else "")
                 + (f" gate/up {r['moe_gate_up']}" if r.get("moe_gate_up") else "")
                 + (f" head {r['decode_head']} ({r['decode_head_taken']})"
                    if r.get("decode_head") else "")
                 + (" bias each step" if r.get("kernel_bias") == "each-step" else ""))
        print(f"| {r['batch']} | {r['decode_attention']} | {r['fuse_projections']} | "
              f"{r['gemm']} | {cache} | "
              f"{lora_cell} | {r['compile_s']:.1f} | "
              f"{r['jrl_s']:.3f} | "
              f"{r['jrl_tokens_per_s']:.0f} | {r['step_gbytes']:.4g} | "
              f"{r['roofline_tokens_per_s']:.0f} | {r['pct_roofline']:.1f} | {hf} | "
              + (f"{r['pct_bound']:.1f} |" if r.get("pct_bound") else "- |"))


if __name__ == "__main__":
    main()
