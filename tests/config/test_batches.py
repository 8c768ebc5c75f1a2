"""The batch sizes checked together (`jrl.config.batches`): every size that does not fit
the rows or the mesh in one error, with sizes that fit, worked out by hand."""

import pytest
from jax.sharding import AbstractMesh

from jrl import sharding
from jrl.config import batches
from jrl.config.batches import BatchSizes
from jrl.errors import ConfigError
from tests.tiny import tiny_config

# The main job's sizes (configs/grpo_arith.py): 32 prompts x 8 samples, mini-batches of
# 16 prompts (128 sequences), micro-batches of 128 sequences, warm start batches of 128.
MAIN = BatchSizes(train=32, n=8, updates=(("actor", 16, 128),), sft=128)


def _mesh(data=1, fsdp=1, context=1, tensor=1):
    return sharding.Sharder(AbstractMesh((data, fsdp, context, tensor, 1), sharding.MESH_AXES))


def test_five_rows_under_the_main_sizes():
    assert batches.problems(MAIN, 5) == [
        "data.train_batch_size=32: more prompts than the 5 training rows",
        "sft.batch_size=128: more than the 5 training rows (the warm start draws a batch "
        "without replacement)"]
    # 5 prompts; the largest mini-batch dividing them is 5 (40 sequences), whose largest
    # micro-batch of at most 128 is 40; the warm start's batch is 5.
    assert batches.fitting(MAIN, 5) == {
        "data.train_batch_size": 5, "actor.ppo_mini_batch_size": 5,
        "actor.ppo_micro_batch_size": 40, "sft.batch_size": 5}
    assert batches.problems(BatchSizes(5, 8, (("actor", 5, 40),), sft=5), 5) == []


def test_a_hundred_rows_keep_what_fits():
    # 100 rows hold the 32 prompts; only the warm start's 128 is cut, to 100.
    assert batches.fitting(MAIN, 100) == {"sft.batch_size": 100}


def test_the_config_alone_rollout_n_4():
    # n=4: mini-batches of 16 x 4 = 64 sequences, under micro-batches of 128.
    sizes = BatchSizes(train=32, n=4, updates=(("actor", 16, 128),))
    assert batches.problems(sizes, None) == [
        "actor.ppo_micro_batch_size=128: 128 sequences must divide the mini-batch of 64 "
        "sequences (actor.ppo_mini_batch_size x rollout.n)"]
    assert batches.fitting(sizes, None) == {"actor.ppo_micro_batch_size": 64}


def test_sizes_on_four_batch_devices():
    # data=4: every batch a multiple of 4. 10 rows: 8 prompts; mini-batch 8 of 2 samples
    # (16 sequences) keeps its micro-batch of 8, a multiple of 4; the critic's micro-batch
    # of 6 is not: 4 (the largest multiple of 4 dividing 16, at most 6).
    sizes = BatchSizes(train=32, n=2, updates=(("actor", 16, 8), ("critic", 16, 6)),
                       log_prob_micro=6)
    mesh = _mesh(data=4)
    assert batches.problems(sizes, 10, mesh) == [
        "data.train_batch_size=32: more prompts than the 10 training rows",
        "critic.ppo_micro_batch_size=6: 6 sequences must divide the mini-batch of 32 "
        "sequences (critic.ppo_mini_batch_size x rollout.n)",
        "critic.ppo_micro_batch_size=6: not a multiple of 4, the devices of the mesh's batch "
        "axes (data x fsdp)",
        "rollout.log_prob_micro_batch_size=6: must divide the batch of 64 sequences "
        "(data.train_batch_size x rollout.n)",
        "rollout.log_prob_micro_batch_size=6: not a multiple of 4, the devices of the mesh's "
        "batch axes (data x fsdp)"]
    assert batches.fitting(sizes, 10, mesh) == {
        "data.train_batch_size": 8, "actor.ppo_mini_batch_size": 8,
        "critic.ppo_mini_batch_size": 8, "critic.ppo_micro_batch_size": 4,
        "rollout.log_prob_micro_batch_size": 4}


def test_rollout_rows_split_over_context_too():
    # data=2, context=4: training batches split over 2 devices, the rollout's rows over 8.
    sizes = BatchSizes(train=2, n=2, updates=(("actor", 2, 4),))
    assert batches.problems(sizes, 64, _mesh(data=2, context=4)) == [
        "the rollout's 2 prompts x rollout.n=2 = 4 rows: not a multiple of 8, the devices "
        "they are split over (data x fsdp x context)"]
    assert batches.problems(BatchSizes(4, 2, (("actor", 4, 8),)), 64,
                            _mesh(data=2, context=4)) == []


def test_one_error_lists_every_size_and_the_flags_that_fit():
    with pytest.raises(ConfigError) as raised:
        batches.check(MAIN, 5)
    assert str(raised.value).splitlines() == [
        "the batch sizes do not fit this run (5 training rows, each batch split over 1 "
        "device):",
        "  data.train_batch_size=32: more prompts than the 5 training rows",
        "  sft.batch_size=128: more than the 5 training rows (the warm start draws a batch "
        "without replacement)",
        "these fit: --config.data.train_batch_size=5 --config.actor.ppo_mini_batch_size=5 "
        "--config.actor.ppo_micro_batch_size=40 --config.sft.batch_size=5"]
    with pytest.raises(ConfigError, match="no batch fits: the mesh splits each batch over 4 "
                                          "devices and there are 3 training rows"):
        batches.check(MAIN, 3, _mesh(data=4))
    batches.check(BatchSizes(4, 8, (("actor", 4, 32),), sft=4), 5)  # fits: no error


def test_sizes_read_from_a_config_and_from_its_settings():
    from jrl.config import settings

    config = tiny_config(**{"sft.steps": 3, "sft.batch_size": 4})
    sizes = batches.from_config(config, needs_critic=False)
    assert sizes == BatchSizes(train=4, n=2, updates=(("actor", 2, 2),), sft=4)
    assert batches.from_settings(settings.from_config(config)) == sizes
    assert batches.from_settings(settings.from_config(config), warm_start=False).sft is None
    # A size that is not a positive integer is left to the settings, which name its key.
    config.data.train_batch_size = 0
    assert batches.from_config(config, needs_critic=False) is None


def test_generation_rounds_mini_batches_and_the_warm_start_on_two_devices():
    # DAPO's rounds of 7 prompts (data.gen_batch_size) over 9 rows on data=2; steps of 6
    # prompts x 4 whose mini-batches of 4 prompts do not divide them; warm start of 3.
    sizes = BatchSizes(train=6, n=4, updates=(("actor", 4, 4),),
                       gen=("data.gen_batch_size", 11), sft=3)
    mesh = _mesh(data=2)
    assert batches.problems(sizes, 9, mesh) == [
        "data.gen_batch_size=11: more prompts per generation round than the 9 training rows",
        "data.gen_batch_size=11: not a multiple of 2, the devices of the mesh's batch axes "
        "(data x fsdp)",
        "actor.ppo_mini_batch_size=4: 4 prompts x rollout.n=4 = 16 sequences must divide "
        "the batch of 24 sequences (data.train_batch_size x rollout.n)",
        "sft.batch_size=3: not a multiple of 2, the devices of the mesh's batch axes "
        "(data x fsdp)"]
    # Rounds: the largest even count within 9 rows, 8; mini-batches: 3 prompts (12
    # sequences, micro-batch 4); warm start 2.
    assert batches.fitting(sizes, 9, mesh) == {
        "data.gen_batch_size": 8, "actor.ppo_mini_batch_size": 3, "sft.batch_size": 2}
    # An odd step on two devices has no mini-batch to offer: none fits at these sizes.
    odd = BatchSizes(train=3, n=1, updates=(("actor", 3, 1),))
    assert batches.problems(odd, None, mesh)[0].startswith("data.train_batch_size=3: not a "
                                                           "multiple of 2")
    assert batches.fitting(BatchSizes(2, 1, (("actor", 2, 1),)), None, mesh) is None
    # A log-prob micro-batch of at most 1 sequence cannot split over two devices.
    assert batches.fitting(BatchSizes(2, 1, (("actor", 2, 2),), log_prob_micro=1), None,
                           mesh) is None
