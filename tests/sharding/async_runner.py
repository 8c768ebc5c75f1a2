"""Runs a tiny GRPO job with config overrides in a fresh process and prints its metrics.

Used by `test_async.py` with 8 CPU devices (the count is fixed when JAX starts):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.sharding.async_runner \\
        --overrides '{"rollout.devices": 4}' --out metrics.json [--train_devices 4,8] \\
        [--workdir DIR] [--exit_after N]

`--train_devices a,b`: train on devices a..b-1 (a data-parallel mesh) instead of the
config's mesh; the metrics and the final checkpoint's step go to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--algo", default="grpo", choices=("grpo", "multi_turn"))
    parser.add_argument("--overrides", default="{}")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--train_devices", default=None)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--exit_after", type=int, default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import jax

    from jrl import sharding, train
    from tests.sharding.runner import tiny_mesh_config, varied_reward
    from tests.trainer.tiny import apply_overrides

    config = apply_overrides(tiny_mesh_config(args.algo, args.steps),
                             {"trainer.save_freq": 2, **json.loads(args.overrides)})
    sharder = None
    if args.train_devices:
        start, stop = (int(x) for x in args.train_devices.split(","))
        sharder = sharding.Sharder(sharding.make_mesh(None, jax.devices()[start:stop]))
    workdir = args.workdir or tempfile.mkdtemp(prefix="jrl-async-")
    train.run(config, workdir, exit_after_steps=args.exit_after, sharder=sharder,
              reward_fn=varied_reward)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    with open(args.out, "w") as f:
        json.dump(records, f)


if __name__ == "__main__":
    sys.exit(main())
