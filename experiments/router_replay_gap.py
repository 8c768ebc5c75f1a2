"""The rollout/training log-prob gap of an MoE model with and without routing replay.

Samples responses with the sampler (recording each token's experts), then computes the
same tokens' log-probs with the training pass twice: each token routed by the training
router (`actor.router_replay=disabled`) and routed to the rollout's experts
(`actor.router_replay=rollout`). Reports verl's `training/rollout_probs_diff_*` for each,
and the share of (token, layer) pairs whose experts the training forward chose otherwise.
In bfloat16 the sampler's decode steps and the training forward round differently, so
near-tied router logits can pick other experts; replay takes that source of mismatch away.

    python experiments/router_replay_gap.py --preset tiny-moe --dtype bfloat16 --out gap.json

Runs on a CPU in about a minute at the default shapes; on a GPU, `--preset qwen3-30b-a3b
--num_layers 4` measures the real shapes' routing on fewer layers.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jrl.algos import rollout_correction
from jrl.models import ModelConfig, init_cache, init_params, transformer
from jrl.rl import logprobs
from jrl.rollout.sampler import SamplingConfig, generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny-moe")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num_layers", type=int, default=None)
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--moe_intermediate_size", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt_len", type=int, default=16)
    parser.add_argument("--response_len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    overrides = {"dtype": args.dtype}
    if args.preset == "tiny-moe":
        overrides.update(hidden_size=args.hidden_size, num_heads=8, num_kv_heads=4,
                         head_dim=32, moe_intermediate_size=args.moe_intermediate_size)
    if args.num_layers:
        overrides["num_layers"] = args.num_layers
    config = ModelConfig.preset(args.preset, **overrides)
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(args.seed))
    vocab = config.vocab_size
    key = jax.random.key(args.seed + 1)
    prompt_ids = jax.random.randint(key, (args.prompts, args.prompt_len), 3, vocab)
    prompt_mask = jnp.ones_like(prompt_ids)
    sampling = SamplingConfig(n=args.n, max_new_tokens=args.response_len, temperature=1.0,
                              record_routing=True)
    start = time.perf_counter()
    out = generate(params, prompt_ids, prompt_mask, jax.random.key(args.seed + 2), sampling,
                   config=config)
    sequences = (out.prompt_ids, out.prompt_mask, out.responses, out.response_mask)
    log_probs = jax.jit(functools.partial(logprobs.response_log_probs, config=config))
    own = log_probs(params, *sequences)[0]
    replayed = log_probs(params, *sequences, out.prompt_routing, out.response_routing)[0]

    tokens, mask, positions = logprobs.sequence_inputs(*sequences)
    recorded = jnp.concatenate([out.prompt_routing, out.response_routing], axis=1)
    record = jax.jit(transformer.forward_recording, static_argnames="config")
    _, _, chosen = record(params, tokens, positions, mask,
                          init_cache(config, tokens.shape[0], tokens.shape[1]), 0, config=config)
    fed = np.asarray(recorded[..., 0] >= 0)  # [N, T, L]: tokens the rollout routed
    differs = np.any(np.sort(np.asarray(chosen), -1) != np.sort(np.asarray(recorded), -1), -1)
    result = {
        "preset": args.preset, "dtype": args.dtype, "num_layers": config.num_layers,
        "num_experts": config.num_experts, "experts_per_token": config.num_experts_per_tok,
        "rows": int(tokens.shape[0]), "response_tokens": int(np.asarray(out.response_mask).sum()),
        "routing_mismatch_share": float(differs[fed].mean()),
        "without_replay": _diffs(own, out),
        "with_replay": _diffs(replayed, out),
        "device": jax.devices()[0].device_kind, "jax": jax.__version__,
        "seconds": time.perf_counter() - start,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


def _diffs(trained, out) -> dict[str, float]:
    metrics = rollout_correction.probs_diff_metrics(trained, out.rollout_log_probs,
                                                    out.response_mask)
    return {k.removeprefix("training/"): float(v) for k, v in metrics.items()}


if __name__ == "__main__":
    main()
