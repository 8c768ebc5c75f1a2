"""Each choice key is checked against the one list of the module that owns the concept."""

import ast
import dataclasses
import inspect
import itertools
import os

import pytest

from jrl import optim
from jrl.algos import advantages, kl_control, losses, masks
from jrl.config import settings
from jrl.config.defaults import base_config
from jrl.data.tokenizers import CharTokenizer
from jrl.errors import ConfigError
from jrl.models import config as model_config
from jrl.rewards import reward_model, scoring
from jrl.rollout import sampler
from tests.tiny import tiny_config

_GAE = {"algorithm.adv_estimator": "gae"}
_CALCULATOR = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tools",
                           "calculator.yaml")  # critic keys are checked only with a critic

# Config key -> (the owning module's list, overrides under which the key is checked).
_CHOICES = {
    "actor.policy_loss.loss_mode": (losses.POLICY_LOSSES, {}),
    "actor.loss_agg_mode": (masks.LOSS_AGG_MODES, {}),
    "critic.loss_agg_mode": (masks.LOSS_AGG_MODES, _GAE),
    "actor.kl_loss_type": (losses.KL_PENALTIES, {}),
    "algorithm.kl_penalty": (losses.KL_PENALTIES, {}),
    "algorithm.kl_ctrl.type": (kl_control.KL_CONTROLLERS, {}),
    "algorithm.adv_estimator": (advantages.ESTIMATORS, {}),
    "actor.optim.lr_scheduler_type": (optim.LR_SCHEDULERS, {}),
    "critic.optim.lr_scheduler_type": (optim.LR_SCHEDULERS, _GAE),
    "reward.on_error": (scoring.ON_ERROR, {}),
    "reward_model.truncation": (reward_model.TRUNCATION, {}),
    "model.remat": (model_config.REMAT_POLICIES, {}),
    "model.attention_impl": (model_config.ATTENTION_IMPLS, {}),
    "trainer.nan_policy": (settings.NAN_POLICIES, {}),
}

_OWNERS = (advantages, kl_control, losses, masks, optim, sampler, settings, model_config,
           reward_model, scoring)


def _settings(**overrides):
    tok = CharTokenizer()
    return settings.from_config(tiny_config(**overrides), stop_token_ids=tok.eos_token_ids,
                                pad_token_id=tok.pad_token_id, num_train_rows=90)


@pytest.mark.parametrize("key", sorted(_CHOICES))
def test_choice_key_accepts_exactly_the_owners_list(key):
    choices, extra = _CHOICES[key]
    for value in choices:
        _settings(**extra, **{key: value})
    with pytest.raises(ConfigError) as err:
        _settings(**extra, **{key: "no-such-choice"})
    assert str(err.value) == (f"{key}: 'no-such-choice' is not valid; "
                              f"choose one of {list(choices)}")


def test_model_dtype_is_a_model_dtype_but_float16():
    for dtype in model_config.DTYPES:
        if dtype != "float16":
            _settings(**{"model.dtype": dtype})
    with pytest.raises(ConfigError, match=r"^model\.dtype: float16 compute needs loss scaling"):
        _settings(**{"model.dtype": "float16"})
    with pytest.raises(ConfigError, match=r"^model\.dtype: 'float8' is not valid"):
        _settings(**{"model.dtype": "float8"})


def test_model_kernel_keys_reach_the_model():
    """`model.attention_impl`, `decode_attention_impl` and `logprob_impl` set in a config
    are the built `ModelConfig`'s (the fields `ModelSettings.config_fields` hands on)."""
    fields = _settings(**{"model.attention_impl": "xla", "model.decode_attention_impl": "xla",
                          "model.logprob_impl": "xla"}).experiment.model.config_fields()
    built = model_config.ModelConfig.preset("tiny", **fields)
    assert (built.attention_impl, built.decode_attention_impl, built.logprob_impl) == \
        ("xla", "xla", "xla")
    assert _settings().experiment.model.config_fields()["attention_impl"] == "auto"


def test_pallas_names_what_replaced_the_triton_kernels():
    """Checked with the settings, before the run directory is claimed: "pallas" (the
    kernels on Pallas' Triton backend, which Pallas deprecated) is no choice of either
    kernel's key now; the error names the key, the Mosaic GPU port and the choices."""
    _settings(**{"model.decode_attention_impl": "auto"})
    with pytest.raises(ConfigError, match=r"^model\.decode_attention_impl: 'pallas' .* "
                                          r"'mosaic' .*choose one of \['auto', 'xla', 'mosaic'\]"):
        _settings(**{"model.decode_attention_impl": "pallas"})
    with pytest.raises(ConfigError, match=r"^model\.logprob_impl: 'pallas' .* use 'mosaic'"):
        _settings(**{"model.logprob_impl": "pallas"})


def test_a_mosaic_kernel_needs_the_mosaic_backend(monkeypatch):
    """"mosaic" is a choice of both kernels' keys, accepted where jax has Pallas' Mosaic GPU
    backend; without it the settings stop, naming the key."""
    from jrl.kernels import mosaic_backend

    keys = ("model.decode_attention_impl", "model.logprob_impl")
    if mosaic_backend.available():
        for key in keys:
            _settings(**{key: "mosaic"})
    monkeypatch.setattr(mosaic_backend, "plgpu", None)
    for key in keys:
        with pytest.raises(ConfigError, match=rf"^{key}='mosaic' needs Pallas' Mosaic GPU"):
            _settings(**{key: "mosaic"})


def test_loggers(monkeypatch):
    real = settings.importlib.util.find_spec
    monkeypatch.setattr(settings.importlib.util, "find_spec",
                        lambda name: object() if name == "wandb" else real(name))
    _settings(**{"trainer.logger": settings.LOGGERS})


def test_a_logger_whose_package_is_missing_stops(monkeypatch):
    """Asked for by name, a logger without its package is an error, not a warning in the
    progress bar and a run that logs nowhere."""
    real = settings.importlib.util.find_spec
    monkeypatch.setattr(settings.importlib.util, "find_spec",
                        lambda name: None if name == "wandb" else real(name))
    with pytest.raises(ConfigError, match=r"^trainer\.logger: 'wandb' needs the wandb package, "
                                          r"which is not installed: pip install wandb, or "
                                          r"leave 'wandb' out$"):
        _settings(**{"trainer.logger": ("console", "wandb")})


@pytest.mark.parametrize(("overrides", "key", "kind"), [
    ({"data.val_batch_size": 0}, "data.val_batch_size", "positive"),
    ({"data.val_batch_size": -4}, "data.val_batch_size", "positive"),
    ({"data.seed": -1}, "data.seed", "non-negative"),
    ({"seed": -1}, "seed", "non-negative"),
    ({"data.digits": 0}, "data.digits", "positive"),
    ({"data.num_val": -1}, "data.num_val", "non-negative"),
    ({"sft.steps": -3}, "sft.steps", "non-negative"),
    ({"sft.batch_size": 0}, "sft.batch_size", "positive"),
    ({"sft.lr": -1.0}, "sft.lr", "non-negative"),
    ({"sft.lr_warmup_steps": -3}, "sft.lr_warmup_steps", "non-negative"),
])
def test_counts_seeds_and_rates_out_of_range_name_their_key(overrides, key, kind):
    """Each would otherwise run: a validation or warm start skipped without a word, a
    warm start with no batch or climbing the loss, or a numpy error about a seed."""
    with pytest.raises(ConfigError, match="^" + key.replace(".", r"\.") + f": must be a {kind} "
                       "number, got "):
        settings.experiment_from_config(tiny_config(**overrides))


def test_sampling_keys_are_the_rollouts():
    """`rollout.*` and `rollout.val_kwargs.*` are read by the names in sampler.VAL_KWARGS."""
    config = base_config()
    assert set(config.rollout.val_kwargs) == set(sampler.VAL_KWARGS)
    assert set(sampler.VAL_KWARGS) <= set(config.rollout)
    values = {"n": 4, "temperature": 0.5, "top_k": 5, "top_p": 0.9, "do_sample": False}
    assert set(values) == set(sampler.VAL_KWARGS)
    s = _settings(**{f"rollout.{k}": v for k, v in values.items()},
                  **{f"rollout.val_kwargs.{k}": v for k, v in values.items()})
    for key, value in values.items():
        assert getattr(s.rollout, key) == value and getattr(s.validation, key) == value, key


@pytest.mark.parametrize(("overrides", "key"), [
    ({"actor.clip_ratio_c": 1.0}, "actor.clip_ratio_c"),
    ({"actor.policy_loss.tau_pos": 0.0}, "actor.policy_loss.tau_pos"),
    ({"rollout.top_p": 1.5}, "rollout.top_p"),
    ({"rollout.val_kwargs.top_k": -5}, "rollout.val_kwargs.top_k"),
    ({"rollout.decode_buckets": 0}, "rollout.decode_buckets"),
    ({"rollout.gemm": "triton"}, "rollout.gemm"),
    ({"rollout.kv_cache": "ring"}, "rollout.kv_cache"),
    ({"rollout.kv_cache": "paged", "rollout.page_size": 0}, "rollout.page_size"),
    ({"rollout.kv_cache": "paged", "rollout.max_num_seqs": -1}, "rollout.max_num_seqs"),
    ({"actor.response_buckets": 0}, "actor.response_buckets"),
])
def test_library_checks_are_config_errors(overrides, key):
    """What the losses and the sampler check comes out as the one-line CLI kind of error."""
    with pytest.raises(ConfigError, match="^" + key.replace(".", r"\.")):
        _settings(**overrides)


def test_no_choice_list_is_defined_twice():
    """Module-level lists of the same names (tuples, or the keys of a registry such as
    losses.POLICY_LOSSES) are one object, imported from the owner."""
    lists = []
    for module in _OWNERS:
        for name, value in vars(module).items():
            names = value if isinstance(value, tuple) else ()
            if isinstance(value, dict) and not any(isinstance(v, str) for v in value.values()):
                names = tuple(value)  # a registry; {str: str} maps names, it lists none
            if name.isupper() and len(names) > 1 and all(isinstance(v, str) for v in names):
                lists.append((f"{module.__name__}.{name}", value))
    for (name_a, a), (name_b, b) in itertools.combinations(lists, 2):
        if set(a) == set(b):
            assert a is b, f"{name_a} and {name_b} are two definitions of one list"


def test_settings_checks_choices_against_named_lists():
    """No copy of a list written inline where settings checks a choice."""
    for node in ast.walk(ast.parse(inspect.getsource(settings))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_choice":
            choices = node.args[2]
            assert not isinstance(choices, (ast.Tuple, ast.List, ast.Set)), ast.unparse(node)


def test_trainer_schedule_is_settings_not_a_config_dict():
    t = _settings(**{"trainer.test_freq": 5, "trainer.save_freq": 10,
                     "trainer.critic_warmup": 2, "trainer.max_actor_ckpt_to_keep": 3}).trainer
    assert t == settings.TrainerSettings(test_freq=5, save_freq=10, val_before_train=False,
                                         critic_warmup=2, max_ckpt_to_keep=3,
                                         total_training_steps=2, logger=("jsonl",))
    for key, value, message in (("trainer.save_freq", -1, "must be a non-negative number"),
                                ("trainer.test_freq", -2, "must be a non-negative number"),
                                ("trainer.critic_warmup", -1, "must be a non-negative number"),
                                ("trainer.max_actor_ckpt_to_keep", 0, "must be >= 1")):
        with pytest.raises(ConfigError, match=f"{key}: .*{message}"):
            _settings(**{key: value})


def test_settings_dataclasses_check_themselves():
    """Built directly (not from a config), each part still names the key it came from."""
    good = _settings(**_GAE)
    optim = good.critic.optim
    with pytest.raises(ConfigError, match=r"^critic\.optim\.lr: must be a non-negative"):
        settings.OptimSettings(**{**dataclasses.asdict(optim), "lr": -1.0, "prefix": "critic"})
    update = good.actor.update
    with pytest.raises(ConfigError, match=r"^actor\.ppo_micro_batch_size: 3 sequences must "
                                          r"divide the mini-batch of 4"):
        dataclasses.replace(update, micro_batch=3)
    with pytest.raises(ConfigError, match=r"^trainer\.critic_warmup: must be a non-negative"):
        dataclasses.replace(good.trainer, critic_warmup=-1)
    with pytest.raises(ConfigError, match=r"^actor\.ppo_mini_batch_size: .* must divide the "
                                          r"batch of"):  # a check across sections
        dataclasses.replace(good, actor=dataclasses.replace(
            good.actor, update=dataclasses.replace(update, mini_batch=good.train_batch_size *
                                                   good.rollout.n * 2)))
    assert dataclasses.replace(good.trainer, test_freq=3.0).test_freq == 3  # normalised


def test_model_path_is_a_directory(tmp_path):
    """model.path given as the checkpoint's config.json, or a path that is not there."""
    config_file = tmp_path / "config.json"
    config_file.write_text("{}")
    with pytest.raises(ConfigError) as err:
        _settings(**{"model.path": str(config_file)})
    assert str(err.value) == (f"model.path: '{config_file}' is a file; model.path is the "
                              "checkpoint's directory (the one holding config.json)")
    with pytest.raises(ConfigError, match=r"^model\.path: .*nowhere' does not exist"):
        _settings(**{"model.path": str(tmp_path / "nowhere")})


def test_a_mini_batch_below_one_micro_batch_is_reported_against_the_mini_batch_key():
    """configs/grpo_arith.py sets actor.ppo_micro_batch_size to 128 sequences; a user who
    sets only actor.ppo_mini_batch_size=7 (7 x rollout.n=8 = 56 sequences) is told about
    the key they set, with the micro-batch key and both sizes."""
    from configs import grpo_arith
    from tests.tiny import apply_overrides

    tok = CharTokenizer()
    config = apply_overrides(grpo_arith.get_config(), {"actor.ppo_mini_batch_size": 7})
    with pytest.raises(ConfigError) as err:
        settings.from_config(config, stop_token_ids=tok.eos_token_ids,
                             pad_token_id=tok.pad_token_id, num_train_rows=4096)
    assert str(err.value) == (
        "actor.ppo_mini_batch_size: its mini-batch of 56 sequences (actor.ppo_mini_batch_size"
        " x rollout.n) is smaller than one micro-batch of actor.ppo_micro_batch_size=128 "
        "sequences; make actor.ppo_mini_batch_size x rollout.n a multiple of 128, or set "
        "actor.ppo_micro_batch_size to a divisor of 56")


@pytest.mark.parametrize(("overrides", "key"), [
    ({"actor.use_dynamic_bsz": True, "actor.ppo_max_token_len_per_gpu": 6},
     "actor.ppo_max_token_len_per_gpu"),
    ({"algorithm.adv_estimator": "gae", "critic.use_dynamic_bsz": True,
      "critic.ppo_max_token_len_per_gpu": 6}, "critic.ppo_max_token_len_per_gpu"),
    ({"rollout.log_prob_use_dynamic_bsz": True, "rollout.log_prob_max_token_len_per_gpu": 6},
     "rollout.log_prob_max_token_len_per_gpu"),
])
def test_token_budgets_must_hold_one_sequence(overrides, key):
    """The tiny config's sequences are up to 4 + 3 tokens: a budget of 6 holds none."""
    with pytest.raises(ConfigError, match="^" + key.replace(".", r"\.")):
        _settings(**overrides)


def test_token_budgets():
    """Budgets apply where their flags are on; the log-prob passes follow the actor's."""
    s = _settings(**{"actor.use_dynamic_bsz": True, "actor.ppo_max_token_len_per_gpu": 7,
                     "rollout.log_prob_max_token_len_per_gpu": 9})
    assert (s.actor.update.max_token_len, s.log_prob_max_token_len) == (7, 9)
    s = _settings(**{"actor.use_dynamic_bsz": True, "rollout.log_prob_use_dynamic_bsz": False})
    assert s.actor.update.max_token_len == 16384 and s.log_prob_max_token_len is None
    s = _settings()
    assert s.actor.update.max_token_len is None and s.log_prob_max_token_len is None


@pytest.mark.parametrize(("response_length", "buckets", "want"), [
    (256, None, 4), (4095, None, 4), (4096, None, 8), (8192, None, 8), (8192, 2, 2),
    (256, 1, 1)])
def test_decode_buckets_default_follows_the_response_length(response_length, buckets, want):
    s = _settings(**{"rollout.response_length": response_length,
                     "rollout.decode_buckets": buckets})
    assert s.rollout.decode_buckets == want and s.validation.decode_buckets == want


def test_sample_dump_directories(tmp_path):
    s = _settings(**{"trainer.rollout_data_dir": "~/dumps/rollouts"})
    assert s.trainer.rollout_data_dir == "~/dumps/rollouts"
    assert s.trainer.validation_data_dir is None  # off by default
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"^trainer\.validation_data_dir: '.*file' is a file; "
                                          r"expected a directory"):
        _settings(**{"trainer.validation_data_dir": str(tmp_path / "file")})
    with pytest.raises(ConfigError, match=r"^trainer\.rollout_data_dir: must be a directory"):
        _settings(**{"trainer.rollout_data_dir": ""})


def test_router_replay_needs_an_moe_model_and_a_rollout_that_records():
    moe = {"model.preset": "tiny-moe", "actor.router_replay": "rollout"}
    s = _settings(**moe)
    assert s.actor.router_replay == "rollout"
    assert s.rollout.record_routing and not s.validation.record_routing
    assert not _settings(**{"model.preset": "tiny-moe"}).rollout.record_routing
    with pytest.raises(ConfigError, match="^actor.router_replay: 'rollout' replays the experts "
                       "of a mixture-of-experts model .* the model is 'qwen2'$"):
        _settings(**{"actor.router_replay": "rollout"})
    with pytest.raises(ConfigError, match="^actor.router_replay: 'rollout' is not supported "
                       "with actor.use_dynamic_bsz=True, rollout.log_prob_use_dynamic_bsz"):
        _settings(**moe, **{"actor.use_dynamic_bsz": True})
    with pytest.raises(ConfigError, match="^actor.router_replay: 'R3' is not valid; choose one "
                       "of \\['disabled', 'rollout', 'old_log_prob'\\]"):
        _settings(**{"actor.router_replay": "R3"})


def test_old_log_prob_replay_records_in_training_not_in_the_rollout():
    """verl's R2: the old-log-prob pass records, so the rollout records nothing and
    takes any layout (cache segments); token-budget passes do not record."""
    r2 = {"model.preset": "tiny-moe", "actor.router_replay": "old_log_prob"}
    s = _settings(**r2, **{"rollout.cache_segments": 2})
    assert s.actor.router_replay == "old_log_prob" and not s.rollout.record_routing
    with pytest.raises(ConfigError, match="^actor.router_replay: 'old_log_prob' is not "
                       "supported with actor.use_dynamic_bsz=True.* old-log-prob pass"):
        _settings(**r2, **{"actor.use_dynamic_bsz": True})
    with pytest.raises(ConfigError, match="^actor.router_replay: 'old_log_prob' is not "
                       "supported with algorithm.rollout_correction.bypass_mode=True"):
        _settings(**r2, **{"algorithm.rollout_correction.bypass_mode": True})
    with pytest.raises(ConfigError, match="^actor.router_replay: 'old_log_prob' replays the "
                       "experts of a mixture-of-experts model"):
        _settings(**{"actor.router_replay": "old_log_prob"})


def test_paged_cache_settings():
    """The paged cache's keys reach the sampler; a pool too small for one row at full
    length, a multi-turn rollout with fewer decode slots than rows, or partial rollouts
    handing their cache on, stops with the keys to change; partial and multi-turn
    rollouts run on it."""
    keys = {"rollout.kv_cache": "paged", "rollout.page_size": 4, "rollout.num_pages": 30,
            "rollout.max_num_seqs": 8, "rollout.refill_rows": 2}
    s = _settings(**keys)
    assert (s.rollout.kv_cache, s.rollout.page_size, s.rollout.num_pages,
            s.rollout.max_num_seqs, s.rollout.refill_rows) == ("paged", 4, 30, 8, 2)
    # The tiny config's prompt + response slots, in pages of 4, and the trash page.
    pages = -(-(s.max_prompt_length + s.rollout.max_new_tokens) // 4) + 1
    _settings(**{**keys, "rollout.num_pages": pages})
    with pytest.raises(ConfigError, match=rf"^rollout.num_pages={pages - 1} is too few for one "
                                          rf"sequence.*rollout.num_pages >= {pages}"):
        _settings(**{**keys, "rollout.num_pages": pages - 1})
    # Multi-turn rows on it: every row decoded at once, over a pool of any size that
    # holds one row.
    turns = {"rollout.multi_turn.enable": True,
             "rollout.multi_turn.tool_config_path": _CALCULATOR}
    multi = _settings(**{**keys, "rollout.max_num_seqs": 0}, **turns)
    assert multi.rollout.kv_cache == "paged" and multi.rollout.num_pages == 30
    assert multi.multi_turn is not None
    with pytest.raises(ConfigError, match=r"^rollout.max_num_seqs=8 is not supported with "
                                          r"rollout.multi_turn.enable=True.*"
                                          r"set rollout.max_num_seqs=0$"):
        _settings(**keys, **turns)
    with pytest.raises(ConfigError, match=rf"^rollout.num_pages={pages - 1} is too few"):
        _settings(**{**keys, "rollout.num_pages": pages - 1, "rollout.max_num_seqs": 0},
                  **turns)
    partial = {"rollout.partial": True, "rollout.partial_max_tokens": 2}
    assert _settings(**keys, **partial).rollout.kv_cache == "paged"
    with pytest.raises(ConfigError, match=r"^rollout.partial_keep_cache: =True hands a "
                                          r"contiguous cache.*rollout.kv_cache='contiguous'"):
        _settings(**keys, **partial, **{"rollout.partial_keep_cache": True})


def test_a_model_shape_that_cannot_be_built_names_the_model_keys():
    from jrl.app import experiment

    experiment_settings = settings.experiment_from_config(tiny_config(
        **{"model.num_heads": 3, "model.num_kv_heads": 2}))
    with pytest.raises(ConfigError, match=r"^model\.\* \(preset '[^']+' with the config's model "
                                          r"keys\): num_heads \(3\) must be a multiple of "
                                          r"num_kv_heads \(2\)$"):
        experiment.build_model(experiment_settings, CharTokenizer())
