"""Runs a few RL steps of a tiny config on one mesh and prints the metrics as JSON.

Used by the sharding tests in a fresh process, so the number of (CPU) devices and
the `jax.distributed` set-up can differ from the test process's:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.sharding.runner \\
        --algo grpo --meshes "1,1,1 8,1,1 2,2,2" --steps 3 --out metrics.json

Each mesh is `data,fsdp,tensor[,context,expert]` over the first devices it needs; the output
maps each mesh to its list of per-step metrics. With `--coordinator`, the process joins a
`jax.distributed` cluster (`--num_processes`, `--process_id`). With `--jobs '{"name":
["--algo", "ppo", ...], ...}'` it runs several such jobs (each its own arguments) one
after another in this process (a process costs seconds to start), and the output maps
each name to its job's output.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile


def varied_reward(data_source, solution_str, ground_truth, extra_info=None):
    """A reward that differs between random responses, so every advantage is non-zero."""
    del data_source, ground_truth, extra_info
    digits = sum(ch.isdigit() for ch in solution_str)
    return {"score": digits / 3.0, "acc": float(digits == 3)}


def _always_call(tools_lib):
    """Reads a turn without tool-call markup as the call `6*7` (a tiny model does not
    write well-formed calls), so every row makes a second turn after a tool block."""
    parse = tools_lib.parse_tool_calls

    def parse_or_call(text, fmt):
        calls, errors = parse(text, fmt)
        if not calls and not errors:
            calls = [tools_lib.ToolCall("calculator", {"expression": "6*7"})]
        return calls, errors

    tools_lib.parse_tool_calls = parse_or_call


def tiny_mesh_config(algo: str, steps: int):
    from tests.tiny import tiny_config

    if algo == "multi_turn":
        from jrl import tools as tools_lib
        from jrl.data.tokenizers import CharTokenizer

        _always_call(tools_lib)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        return tiny_config(**{
            "data.task": "tool_multiplication", "data.digits": 2, "data.num_train": 64,
            "data.apply_chat_template": True, "data.max_prompt_length": 24,
            "data.train_batch_size": 8, "data.val_batch_size": 8,
            "rollout.response_length": 48, "rollout.multi_turn.enable": True,
            "actor.response_buckets": 2,  # 32 and 48 columns: buckets on a mesh
            "rollout.multi_turn.tool_config_path": os.path.join(
                root, "configs", "tools", "calculator.yaml"),
            "rollout.multi_turn.max_assistant_turns": 3,
            "rollout.multi_turn.max_tool_response_tokens": 24,
            # Turns end at frequent characters, so rows take turns of different lengths.
            "rollout.multi_turn.turn_stop_ids": tuple(CharTokenizer().encode("\n0123")),
            "actor.ppo_mini_batch_size": 4, "actor.ppo_micro_batch_size": 8,
            "actor.optim.lr": 1e-2, "trainer.total_training_steps": steps,
            "algorithm.adv_estimator": "grpo"})

    overrides = {
        "data.train_batch_size": 8, "data.val_batch_size": 8,
        "actor.ppo_mini_batch_size": 4, "actor.ppo_micro_batch_size": 8,
        "critic.ppo_mini_batch_size": 4, "critic.ppo_micro_batch_size": 8,
        "actor.optim.lr": 1e-2, "critic.optim.lr": 1e-2,
        "trainer.total_training_steps": steps,
        "algorithm.adv_estimator": "grpo" if algo == "grpo" else "gae",
    }
    if algo == "grpo":
        overrides.update({"actor.use_kl_loss": True, "actor.entropy_coeff": 0.01})
    else:  # the critic's update on-policy (the whole batch): it values the batch itself
        overrides.update({"algorithm.use_kl_in_reward": True, "critic.ppo_mini_batch_size": 8})
    return tiny_config(**overrides)


def packed(config):
    """`config` with token-budget micro-batches in every pass, 2 packed rows of P + R
    slots per device (and a few tokens to spare)."""
    config = config.copy_and_resolve_references()
    budget = 2 * (config.data.max_prompt_length + config.rollout.response_length) + 3
    for role in ("actor", "critic"):
        config[role].use_dynamic_bsz = True
        config[role].ppo_max_token_len_per_gpu = budget
    config.rollout.log_prob_max_token_len_per_gpu = budget
    return config


def paged(config):
    """`config` with the paged KV cache (its default pool: every row at full length)."""
    config = config.copy_and_resolve_references()
    config.rollout.kv_cache = "paged"
    return config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--algo", choices=("grpo", "ppo", "multi_turn"), default="grpo")
    parser.add_argument("--meshes", default="8,1,1", help="'data,fsdp,tensor ...'; a mesh "
                        "written 'data,fsdp,tensor+packed' runs with token-budget micro-batches, "
                        "'+paged' with the paged KV cache")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--coordinator", default=None)
    parser.add_argument("--num_processes", type=int, default=1)
    parser.add_argument("--process_id", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="(one mesh) write here, and save "
                        "a checkpoint at the last step")
    parser.add_argument("--compact", action="store_true", help="decode compaction on "
                        "(rollout.decode_buckets=4, 6-token responses so rows stop apart)")
    parser.add_argument("--value_pass", action="store_true", help="(ppo) the critic's "
                        "update in two mini-batches, after a separate value pass")
    parser.add_argument("--moe", action="store_true", help="the tiny mixture-of-experts "
                        "model (8 experts, 2 a token) with routing replay")
    parser.add_argument("--resume_from", default=None, help="a checkpoint directory to resume "
                        "from (trainer.resume_mode='resume_path')")
    parser.add_argument("--jobs", default=None, help="JSON: {name: [arguments of a job]}, "
                        "run one after another (a multi-turn job patches the tools: last)")
    return parser


def run_job(args) -> dict[str, list[dict]]:
    """Runs `args.meshes` of one job; returns {mesh: per-step metrics} (process 0)."""
    import jax

    from jrl import sharding, train

    config = tiny_mesh_config(args.algo, args.steps)
    if args.compact:
        config.rollout.decode_buckets, config.rollout.response_length = 4, 6
    if args.value_pass:
        config.critic.ppo_mini_batch_size = 4
    if args.moe:
        config.model.preset, config.actor.router_replay = "tiny-moe", "rollout"
    if args.workdir:
        config.trainer.save_freq = args.steps
    if args.resume_from:
        config.trainer.resume_mode = "resume_path"
        config.trainer.resume_from_path = args.resume_from
    if args.coordinator:
        config.distributed.coordinator_address = args.coordinator
        config.distributed.num_processes = args.num_processes
        config.distributed.process_id = args.process_id
        from jrl.app import distributed
        from jrl.config import settings

        distributed.maybe_initialize(settings.distributed_from_config(config))
    results = {}
    for mesh in args.meshes.split():
        axes, _, variant = mesh.partition("+")
        shape = tuple(int(x) for x in axes.split(","))
        run_config = {"": lambda c: c, "packed": packed, "paged": paged}[variant](config)
        devices = jax.devices()[: math.prod(shape)]
        sharder = sharding.Sharder(sharding.make_mesh(sharding.MeshSettings(*shape), devices))
        workdir = args.workdir or tempfile.mkdtemp(prefix="jrl-mesh-")
        train.run(run_config, workdir, sharder=sharder, reward_fn=varied_reward)
        if jax.process_index() == 0:
            with open(os.path.join(workdir, "metrics.jsonl")) as f:
                results[mesh] = [json.loads(line) for line in f]
    return results


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    if args.jobs:
        results = {name: run_job(_parser().parse_args([*job, "--out", args.out]))
                   for name, job in json.loads(args.jobs).items()}
    else:
        results = run_job(args)

    import jax

    if jax.process_index() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    sys.exit(main())
