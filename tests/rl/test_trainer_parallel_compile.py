"""`RLTrainer.compile_programs` (`trainer.parallel_compile`): the first step's programs are
compiled before it, at once; the step then compiles none of them again, and learns what it
learns without them."""

import jax
import numpy as np
import pytest

from jrl.data.dataset import BatchIterator
from tests.eight_devices import run_script
from tests.tiny import tiny_trainer

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


def _programs(names):
    """Jitted functions' names as the events give them ("jit(learn)"), bare ("learn")."""
    return [n.removeprefix("jit(").rstrip(")") for n in names]


def _varied_reward(data_source, solution_str, ground_truth, extra_info=None):
    """Differs between random responses, so DAPO's groups vary and fill the batch."""
    del data_source, ground_truth, extra_info
    return float(sum(map(ord, solution_str)) % 7)


def _trainer(tmp_path, overrides):
    """The tiny trainer and its iterator (DAPO's: rounds of gen_batch_size prompts)."""
    overrides = {"trainer.parallel_compile": True, **overrides}  # (None: off on a CPU)
    trainer = tiny_trainer(tmp_path, overrides,
                           _varied_reward if "algorithm.filter_groups.enable" in overrides
                           else None)
    fg = trainer.settings.filter_groups
    prompts = trainer.settings.train_batch_size if fg is None else fg.gen_batch_size
    return trainer, BatchIterator(trainer.train_rows, prompts, 0)


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
def test_the_first_step_compiles_none_of_its_programs_again(tmp_path, overrides):
    trainer, iterator = _trainer(tmp_path, overrides)
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
        assert {"generate", "forward", "learn"} <= set(_programs(ahead))
        step_programs = {"generate", "forward", "learn", "generate_from"}
        again = [n for n in _programs(COMPILES.names) if n in step_programs]
        assert not again, f"compiled again in the step: {again}"
        assert np.isfinite(m["actor/pg_loss"])
        assert trainer.compile_programs() == []  # once
    finally:
        COMPILES.active = False
        trainer.close()


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_partial_rounds_compile_no_prefix_width_again(tmp_path, cache):
    """Partial rollouts (one token a round, R = 3): the rounds' programs, one for each
    prefix width a running row's tokens take (0, 1, 2), compiled ahead with the passes;
    three steps' rounds, which meet every width, then compile none of them again."""
    trainer, iterator = _trainer(tmp_path, {
        "rollout.partial": True, "rollout.partial_max_tokens": 1,
        "rollout.kv_cache": cache, "trainer.total_training_steps": 3})
    assert trainer.settings.rollout.max_new_tokens == 3
    try:
        COMPILES.names, COMPILES.active = [], True
        compiled = trainer.compile_programs()
        ahead = _programs(COMPILES.names)
        COMPILES.names = []
        widths = set()
        continuer = trainer.programs.continuer

        def watched(*args):  # the prefix widths the rounds take
            program = continuer(*args)
            return lambda *a: widths.add(a[3].responses.shape[1]) or program(*a)

        trainer.programs.continuer = watched
        for _ in range(3):
            m = trainer.train_step(iterator)
        COMPILES.active = False
        assert set(compiled) == {"continue_0", "continue_1", "continue_2", "forward",
                                 "learn"}
        assert {"continue_rows", "forward", "learn"} <= set(ahead), ahead
        assert widths == {0, 1, 2}, widths
        again = [n for n in _programs(COMPILES.names)
                 if n in ("continue_rows", "forward", "learn")]
        assert not again, f"compiled again in the steps: {again}"
        assert np.isfinite(m["actor/pg_loss"])
    finally:
        COMPILES.active = False
        trainer.close()


def test_the_first_step_is_the_same_with_and_without(tmp_path):
    metrics = []
    for on in (True, False):
        trainer, iterator = _trainer(tmp_path / str(on), {"trainer.parallel_compile": on})
        try:
            metrics.append(trainer.train_step(iterator))
            assert trainer.compile_programs() == []  # on: done by the step; off: never
        finally:
            trainer.close()
    for key in ("actor/pg_loss", "critic/score/mean", "response_length/mean"):
        assert metrics[0][key] == metrics[1][key], key
    # The compile's seconds, reported by the step they were spent for (on only).
    assert metrics[0]["timing_s/compile"] > 0 and "timing_s/compile" not in metrics[1]


def test_remax_greedy_and_validation_rollouts_of_one_shape(tmp_path):
    # ReMax's greedy rollout and the validation's (default val_kwargs: one greedy sample)
    # at the step's 4 prompts: the same sampling and shapes, keys passed differently.
    trainer, iterator = _trainer(tmp_path, {"algorithm.adv_estimator": "remax",
                                            "data.val_batch_size": 4})
    try:
        COMPILES.names, COMPILES.active = [], True
        compiled = trainer.compile_programs(val_batch_size=4)
        COMPILES.names = []
        trainer.train_step(iterator)
        trainer.validate(4)
        COMPILES.active = False
        assert {"generate", "generate_greedy", "validate"} <= set(compiled)
        assert "generate" not in _programs(COMPILES.names), COMPILES.names
    finally:
        COMPILES.active = False
        trainer.close()


def test_fit_compiles_the_validation_before_training_with_the_step(tmp_path):
    trainer, _ = _trainer(tmp_path, {"trainer.val_before_train": True,
                                     "trainer.total_training_steps": 1})
    returned = []
    compile_programs = trainer.compile_programs
    trainer.compile_programs = lambda *a: returned.append(compile_programs(*a)) or returned[-1]
    try:
        COMPILES.names, COMPILES.active = [], True
        trainer.fit(val_batch_size=8)
        COMPILES.active = False
        assert {"generate", "forward", "learn", "validate"} <= set(returned[0]), returned
        # Each program once: the first call compiled them all, later calls none.
        assert all(names == [] for names in returned[1:]), returned
        programs = _programs(COMPILES.names)
        assert programs.count("generate") == 2 and programs.count("learn") == 1, programs
    finally:
        COMPILES.active = False
        trainer.close()


_MESH_SCRIPT = """
import json
import jax
from jrl.data.dataset import BatchIterator
from tests.sharding.runner import packed, tiny_mesh_config
from tests.tiny import trainer_of

names = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: names.append(str(kw.get("fun_name")))
    if event == "/jax/core/compile/backend_compile_duration" else None)
out = {}
for algo, (data, fsdp, tensor), pack in [("grpo", (2, 2, 2), False), ("ppo", (4, 2, 1), True)]:
    config = tiny_mesh_config(algo, 2)
    config = packed(config) if pack else config
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = data, fsdp, tensor
    config.trainer.parallel_compile = True
    trainer = trainer_of(config, "WORKDIR")
    compiled = trainer.compile_programs(8)
    names.clear()
    trainer.train_step(BatchIterator(trainer.train_rows, trainer.settings.train_batch_size, 0))
    trainer.validate(8)
    again = [n for n in names if any(p in n for p in ("generate", "forward", "learn"))]
    out[algo] = dict(compiled=compiled, again=again)
    trainer.close()
print(json.dumps(out))
"""


def test_meshes_compile_none_of_the_step_programs_again(tmp_path):
    # Shardings over data, fsdp and tensor (and token budgets), on 8 CPU devices.
    result = run_script(_MESH_SCRIPT.replace("WORKDIR", str(tmp_path)), timeout=600)
    for algo in ("grpo", "ppo"):
        assert {"generate", "forward", "learn", "validate"} <= set(result[algo]["compiled"])
        assert result[algo]["again"] == [], result


def test_the_default_is_off_on_a_cpu_only(tmp_path):
    trainer, _ = _trainer(tmp_path, {"trainer.parallel_compile": None})
    try:
        assert trainer.settings.trainer.parallel_compile is None
        assert (trainer.compile_programs() != []) == (jax.default_backend() != "cpu")
    finally:
        trainer.close()
