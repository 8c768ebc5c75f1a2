"""Bad configs stop before anything is built or compiled, naming the key."""

import pytest

from jrl.config import settings
from jrl.data.tokenizers import CharTokenizer
from tests.tiny import tiny_config

_BAD = [
    ({"data.train_batch_size": 0}, "data.train_batch_size"),
    ({"actor.ppo_mini_batch_size": 3}, "actor.ppo_mini_batch_size"),
    ({"actor.ppo_micro_batch_size": 3}, "actor.ppo_micro_batch_size"),
    ({"algorithm.adv_estimator": "ppo"}, "algorithm.adv_estimator"),
    ({"rollout.n": 1}, "rollout.n"),
    ({"actor.policy_loss.loss_mode": "clipped"}, "actor.policy_loss.loss_mode"),
    ({"actor.loss_agg_mode": "mean"}, "actor.loss_agg_mode"),
    ({"actor.kl_loss_type": "k4"}, "actor.kl_loss_type"),
    ({"algorithm.kl_penalty": "kl2"}, "algorithm.kl_penalty"),
    ({"algorithm.kl_ctrl.type": "pid"}, "algorithm.kl_ctrl.type"),
    ({"algorithm.kl_ctrl.type": "adaptive", "algorithm.kl_ctrl.horizon": 0.0},
     "algorithm.kl_ctrl.horizon"),
    ({"rollout.temperature": 0.0}, "rollout"),
    ({"rollout.top_p": 1.5}, "rollout"),
    ({"rollout.val_kwargs.top_k": -5}, "rollout.val_kwargs"),
    ({"rollout.response_length": 0}, "rollout.response_length"),
    ({"algorithm.gamma": 1.5}, "algorithm.gamma"),
    ({"actor.clip_ratio_c": 1.0}, "actor.clip_ratio_c"),
    ({"actor.optim.lr_scheduler_type": "linear"}, "actor.optim.lr_scheduler_type"),
    ({"actor.grad_clip": -1.0}, "actor.grad_clip"),
    ({"model.param_dtype": "bfloat16"}, "model.param_dtype"),
    ({"actor.optim.betas": (0.9,)}, "actor.optim.betas"),
    ({"trainer.nan_policy": "ignore"}, "trainer.nan_policy"),
    ({"trainer.logger": ("console", "mlflow")}, "trainer.logger"),
    ({"trainer.total_training_steps": 0, "trainer.total_epochs": 0}, "trainer.total_epochs"),
    ({"algorithm.adv_estimator": "gae", "critic.ppo_mini_batch_size": 3},
     "critic.ppo_mini_batch_size"),
    ({"model.path": "/nonexistent/model"}, "model.path"),
    ({"model.remat": "dots"}, "model.remat"),
    ({"reward.on_error": "ignore"}, "reward.on_error"),
    ({"reward.custom_fn": "/nonexistent/reward.py:fn"}, "reward.custom_fn"),
    ({"reward_model.enable": True}, "reward_model.model.path"),
    ({"algorithm.filter_groups.enable": True, "data.gen_batch_size": 1000},
     "data.gen_batch_size"),
    ({"algorithm.filter_groups.enable": True, "algorithm.use_kl_in_reward": True,
      "algorithm.filter_groups.metric": "seq_final_reward"}, "algorithm.filter_groups.metric"),
    ({"rollout.log_prob_micro_batch_size": 3}, "rollout.log_prob_micro_batch_size"),
]


@pytest.mark.parametrize(("overrides", "key"), _BAD, ids=[k for _, k in _BAD])
def test_bad_config_names_the_key(overrides, key, monkeypatch):
    # Anything that would compile fails the test: validation must come first.
    import jax

    monkeypatch.setattr(jax, "jit", lambda *a, **k: pytest.fail("compiled before validating"))
    config = tiny_config(**overrides)
    tok = CharTokenizer()
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        settings.from_config(config, stop_token_ids=tok.eos_token_ids,
                             pad_token_id=tok.pad_token_id, num_train_rows=90)


def test_good_config_passes():
    tok = CharTokenizer()
    s = settings.from_config(tiny_config(), stop_token_ids=tok.eos_token_ids,
                             pad_token_id=tok.pad_token_id, num_train_rows=90)
    assert s.actor.update.mini_batch == 4 and s.critic is None and s.total_steps == 2


def test_custom_fn_spec_expands_home(tmp_path, monkeypatch):
    """A `~/...` spec is checked as the loader reads it (home expanded)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "reward.py").write_text("def fn(*args):\n    return 1.0\n")
    tok = CharTokenizer()
    s = settings.from_config(tiny_config(**{"reward.custom_fn": "~/reward.py:fn"}),
                             stop_token_ids=tok.eos_token_ids, pad_token_id=tok.pad_token_id,
                             num_train_rows=90)
    assert s.reward.custom_fn == "~/reward.py:fn"
    with pytest.raises(ValueError, match=r"reward\.custom_fn.*does not exist"):
        settings.from_config(tiny_config(**{"reward.custom_fn": "~/other.py:fn"}),
                             stop_token_ids=tok.eos_token_ids, pad_token_id=tok.pad_token_id,
                             num_train_rows=90)
