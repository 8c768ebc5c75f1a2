"""Writes the warm start that `tests/rl/test_trainer_learning.py` starts RL from.

The main job's supervised warm start (`configs/grpo_arith.py`, seed 0: 800 steps,
about 90 s on a 2-core CPU) is the slow part of that job; the CI learning test
reads it from `tests/data/arith_warm_start/` (a Hugging Face checkpoint, bfloat16)
so that its two GRPO runs fit in CI's time. Rerun after a change to the model's
parameters or to the warm start:

    python experiments/make_learning_fixture.py [--out tests/data/arith_warm_start]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import grpo_arith  # noqa: E402
from jrl import sft  # noqa: E402
from jrl.app import experiment, rundir  # noqa: E402
from jrl.config.settings import experiment_from_config  # noqa: E402
from jrl.models import hf  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tests/data/arith_warm_start")
    args = parser.parse_args()
    config = grpo_arith.get_config()
    experiment_settings = experiment_from_config(config)
    tokenizer = experiment.build_tokenizer(experiment_settings)
    train_rows, _ = experiment.build_data(experiment_settings, tokenizer)
    model, params = experiment.build_model(experiment_settings, tokenizer)
    with tempfile.TemporaryDirectory() as workdir:
        params = sft.warm_start(experiment_settings, workdir, model, params, tokenizer,
                                train_rows, config_keys=rundir.warm_start_settings(config))
    hf.save_pretrained(args.out, model, params, dtype="bfloat16")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
