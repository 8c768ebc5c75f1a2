"""`RLTrainer.compile_programs` (`trainer.parallel_compile`): the first step's programs are
compiled before it, at once; the step then compiles none of them again, and learns what it
learns without them."""

import jax
import numpy as np
import pytest

from jrl import experiment, settings
from jrl.data.dataset import BatchIterator
from jrl.trainer import RLTrainer

from .tiny import tiny_config

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class Compiles:
    """The names of the programs XLA compiles while `active` (jax.monitoring's events)."""

    def __init__(self):
        self.active, self.names = False, []
        jax.monitoring.register_event_duration_secs_listener(self._record)

    def _record(self, event, duration, **kwargs):
        if self.active and event == COMPILE_EVENT:
            self.names.append(str(kwargs.get("fun_name", "?")))


COMPILES = Compiles()


def _varied_reward(data_source, solution_str, ground_truth, extra_info=None):
    """Differs between random responses, so DAPO's groups vary and fill the batch."""
    del data_source, ground_truth, extra_info
    return float(sum(map(ord, solution_str)) % 7)


def _trainer(tmp_path, overrides):
    config = tiny_config(**overrides)
    tokenizer = experiment.build_tokenizer(config)
    rows, val_rows = experiment.build_data(config, tokenizer)
    s = settings.from_config(config, stop_token_ids=tokenizer.eos_token_ids,
                             pad_token_id=tokenizer.pad_token_id, num_train_rows=len(rows))
    model, params = experiment.build_model(config, tokenizer)
    scorer = (_varied_reward if s.filter_groups is not None
              else experiment.build_reward(config, s)[0])
    trainer = RLTrainer(s, model, params, tokenizer, rows, val_rows, scorer, str(tmp_path), 0)
    return trainer, BatchIterator(rows, s.train_batch_size, 0), config


@pytest.mark.parametrize("overrides", [
    {},  # GRPO, on-policy: no old-log-prob pass
    # PPO: a critic, a reference, the KL in the reward, an off-policy second epoch
    {"algorithm.adv_estimator": "gae", "algorithm.use_kl_in_reward": True,
     "actor.use_kl_loss": True, "actor.ppo_epochs": 2},
    {"algorithm.adv_estimator": "remax"},  # a greedy rollout for the baselines
    {"model.lora_rank": 4, "actor.use_kl_loss": True},  # the frozen base, the reference
    # DAPO's dynamic sampling: rounds of 6 prompts fill a batch of 4 on the host
    {"algorithm.filter_groups.enable": True, "data.gen_batch_size": 6},
    # token budgets in the forward and update passes
    {"actor.use_dynamic_bsz": True, "actor.ppo_max_token_len_per_gpu": 16,
     "rollout.log_prob_use_dynamic_bsz": True, "rollout.log_prob_max_token_len_per_gpu": 16,
     "actor.use_kl_loss": True},
])
def test_the_first_step_compiles_nothing_after_compile_programs(tmp_path, overrides):
    trainer, iterator, _ = _trainer(tmp_path, overrides)
    if trainer.s.filter_groups is not None:  # the trainer's rounds draw gen_batch_size prompts
        iterator = BatchIterator(trainer.train_rows, trainer.s.filter_groups.gen_batch_size, 0)
    try:
        COMPILES.names, COMPILES.active = [], True
        compiled = trainer.compile_programs(val_batch_size=8)
        ahead = list(COMPILES.names)
        COMPILES.names = []
        m = trainer.train_step(iterator)
        trainer.validate(8)
        COMPILES.active = False
        assert {"generate", "forward", "learn", "validate"} <= set(compiled)
        assert ("generate_greedy" in compiled) == (overrides.get("algorithm.adv_estimator")
                                                   == "remax")
        # The rollout's, forward's and learn's programs compiled ahead, not in the step.
        assert {"generate", "forward", "learn"} <= {n.removeprefix("jit(").rstrip(")")
                                                    for n in ahead}
        step_programs = {"generate", "forward", "learn", "generate_from"}
        again = [n for n in COMPILES.names
                 if n.removeprefix("jit(").rstrip(")") in step_programs]
        assert not again, f"compiled again in the step: {again}"
        assert np.isfinite(m["actor/pg_loss"])
        assert trainer.compile_programs() == []  # once
    finally:
        COMPILES.active = False
        trainer.close()


def test_the_first_step_is_the_same_with_and_without(tmp_path):
    metrics = []
    for on in (True, False):
        trainer, iterator, _ = _trainer(tmp_path / str(on), {"trainer.parallel_compile": on})
        try:
            metrics.append(trainer.train_step(iterator))
            assert trainer.compile_programs() == []  # on: done by the step; off: never
        finally:
            trainer.close()
    for key in ("actor/pg_loss", "critic/score/mean", "response_length/mean"):
        assert metrics[0][key] == metrics[1][key], key
    # The compile's seconds, reported by the step they were spent for (on only).
    assert metrics[0]["timing_s/compile"] > 0 and "timing_s/compile" not in metrics[1]

