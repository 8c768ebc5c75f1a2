"""Two RL steps for every advantage estimator and every policy loss on the tiny config."""

import math

import pytest

from jrl.algos import advantages, losses
from jrl.metrics import read_jsonl
from jrl.train import run
from tests.tiny import tiny_config, tiny_hf_checkpoint


def _run(tmp_path, **overrides):
    run(tiny_config(**overrides), str(tmp_path))
    records = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record.get("actor/nan_skipped_updates", 0) == 0
        assert all(math.isfinite(v) for k, v in record.items() if k != "step"), record
    return records


@pytest.mark.parametrize("estimator", sorted(advantages.ESTIMATORS))
def test_every_estimator(tmp_path, estimator):
    records = _run(tmp_path, **{"algorithm.adv_estimator": estimator})
    assert ("critic/vf_loss" in records[0]) == (estimator == "gae")
    assert "actor/pg_loss" in records[0] and "critic/advantages/mean" in records[0]


@pytest.mark.parametrize("loss_mode", sorted(losses.POLICY_LOSSES))
def test_every_policy_loss(tmp_path, loss_mode):
    _run(tmp_path, **{"actor.policy_loss.loss_mode": loss_mode})


def test_kl_terms_and_adaptive_controller(tmp_path):
    records = _run(tmp_path, **{
        "actor.use_kl_loss": True, "actor.kl_loss_type": "k3+", "actor.entropy_coeff": 0.01,
        "algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.type": "adaptive",
        "algorithm.kl_ctrl.kl_coef": 0.1, "algorithm.kl_ctrl.horizon": 100.0})
    assert {"actor/kl_loss", "actor/entropy_loss", "actor/reward_kl_penalty"} <= set(records[0])
    # The adaptive controller moved beta after step 1.
    coeffs = [r["actor/reward_kl_penalty_coeff"] for r in records]
    assert coeffs[1] != coeffs[0]


def test_hf_checkpoint_in_and_out(tmp_path):
    """A run from a HF-format checkpoint exports the trained actor back to HF format."""
    import numpy as np

    from jrl.models import hf

    source = tmp_path / "source"
    _, params = tiny_hf_checkpoint(source)
    summary = run(tiny_config(**{"model.path": str(source)}), str(tmp_path / "run"))
    _, exported = hf.load_pretrained(summary["hf_export"])
    before = params["layers"]["mlp"]["up_proj"]["kernel"]
    after = exported["layers"]["mlp"]["up_proj"]["kernel"]
    assert after.shape == before.shape and not np.allclose(after, before)


def test_critic_warmup_counts_steps_from_one(tmp_path):
    # verl: the actor updates once critic_warmup <= step, with steps counted from 1.
    records = _run(tmp_path, **{"algorithm.adv_estimator": "gae", "trainer.critic_warmup": 2})
    assert "actor/pg_loss" not in records[0] and "critic/vf_loss" in records[0]
    assert "actor/pg_loss" in records[1] and records[1]["actor/lr"] == pytest.approx(1e-3, rel=1e-6)


def test_the_rollout_program_compiles_with_the_samplers_options(tmp_path, monkeypatch):
    """The trainer's rollout program compiles with `rollout.compiler_options` (here an
    option XLA does not know, which stops the run at its first rollout)."""
    import jax

    from jrl.rl import programs

    monkeypatch.setattr(programs, "compiler_options", lambda sampling: {"xla_no_such_option": 1})
    with pytest.raises(jax.errors.JaxRuntimeError, match="xla_no_such_option"):
        run(tiny_config(), str(tmp_path))


@pytest.mark.parametrize("mini_batch,skipped", [(4, True), (2, False)])
def test_on_policy_critic_skips_the_value_pass(tmp_path, monkeypatch, mini_batch, skipped):
    """PPO with the critic's update over the whole batch (4 prompts) runs no separate value
    pass (`step.forward` gives no values); with two mini-batches it does. Either way the
    step reports the batch's values."""
    from jrl.rl import step

    seen = []

    def forward(*args, **kwargs):
        exp = real(*args, **kwargs)
        seen.append(exp.values is None)
        return exp

    real = step.forward
    monkeypatch.setattr(step, "forward", forward)
    records = _run(tmp_path, **{"algorithm.adv_estimator": "gae",
                                "critic.ppo_mini_batch_size": mini_batch})
    assert seen and set(seen) == {skipped}
    assert all(r["critic/values/max"] > r["critic/values/min"] for r in records)
