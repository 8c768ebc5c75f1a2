"""A training step moves data between host and devices only where the design says so:
prompts and scores in (`Sharder.put_batch`), the step key's counter in, responses and
the step's scalar metrics out (`jax.device_get`). Everything else stays on the devices:
the step runs under `jax.transfer_guard("disallow")`, which rejects implicit transfers."""

import jax
import numpy as np
import pytest

from jrl.data.dataset import BatchIterator
from tests.tiny import tiny_trainer


@pytest.mark.parametrize("overrides", [
    {},  # GRPO
    {"algorithm.adv_estimator": "gae", "algorithm.use_kl_in_reward": True,
     "algorithm.kl_ctrl.type": "adaptive", "actor.use_kl_loss": True,
     "trainer.critic_warmup": 2},  # PPO with a critic, a reference and both KL terms
])
def test_step_runs_under_transfer_guard(tmp_path, overrides):
    trainer = tiny_trainer(tmp_path, overrides)
    try:
        iterator = BatchIterator(trainer.train_rows, trainer.settings.train_batch_size, 0)
        trainer.train_step(iterator)  # compiles (constants may move to the devices here)
        with jax.transfer_guard("disallow"):
            # The guard is on: an implicit transfer in this block is an error.
            with pytest.raises(Exception, match="Disallowed host-to-device transfer"):
                jax.numpy.asarray(np.ones(3)) + 1
            for _ in range(2):  # the second step runs the actor update (critic warm-up)
                m = trainer.train_step(iterator)
        assert trainer.step == 3 and int(trainer.state.step) == 3
        assert np.isfinite(m["actor/pg_loss"])
    finally:
        trainer.close()
