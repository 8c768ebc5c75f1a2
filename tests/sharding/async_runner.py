"""Runs tiny GRPO jobs with config overrides in a fresh process and writes their metrics.

Used by `test_async.py` with 8 CPU devices (the count is fixed when JAX starts):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.sharding.async_runner \\
        --jobs '{"split": {"overrides": {"rollout.devices": 4}}}' --out metrics.json

`--jobs` maps a name to a job, run one after another in this process (in the order
given); a job's keys (all optional): `algo` ("grpo" or "multi_turn"), `steps` (4),
`overrides` (config keys), `train_devices` ("a,b": train on devices a..b-1, a
data-parallel mesh, instead of the config's mesh), `workdir` and `exit_after` (stop
after that step). `--out` gets each job's metrics records under its name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile


def run_job(job: dict) -> list[dict]:
    """Runs one job (see the module's docstring); returns its metrics records."""
    import jax

    from jrl import sharding, train
    from tests.sharding.runner import tiny_mesh_config, varied_reward
    from tests.tiny import apply_overrides

    config = apply_overrides(tiny_mesh_config(job.get("algo", "grpo"), job.get("steps", 4)),
                             {"trainer.save_freq": 2, **job.get("overrides", {})})
    sharder = None
    if job.get("train_devices"):
        start, stop = (int(x) for x in job["train_devices"].split(","))
        sharder = sharding.Sharder(sharding.make_mesh(None, jax.devices()[start:stop]))
    workdir = job.get("workdir") or tempfile.mkdtemp(prefix="jrl-async-")
    train.run(config, workdir, exit_after_steps=job.get("exit_after"), sharder=sharder,
              reward_fn=varied_reward)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", required=True, help="JSON: {name: job}")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    results = {name: run_job(job) for name, job in json.loads(args.jobs).items()}
    with open(args.out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    sys.exit(main())
