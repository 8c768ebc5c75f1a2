"""Config files take variants after a colon (`configs/grpo_arith.py:n=16`), read by
`config_defaults.parse_arg`; without one they are the configs they always were."""

import importlib
import os

import pytest

from configs import dapo_arith, grpo_arith, grpo_gsm8k, ppo_arith, ppo_gsm8k
from jrl.config import settings
from jrl.config.defaults import parse_arg
from jrl.data.tokenizers import CharTokenizer
from jrl.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_DEFAULTS = dict(n=8, lr=1e-4, shuffle=True, name="tiny")
_CONFIGS = sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "configs"))
                  if f.endswith(".py") and not f.startswith("_"))


def test_parse_arg_defaults():
    for arg in (None, "", " ", ","):
        assert parse_arg(arg, **_DEFAULTS).to_dict() == _DEFAULTS


def test_parse_arg_types_follow_the_defaults():
    a = parse_arg(" n=16, lr=3e-4,shuffle=false,name=qwen2.5-0.5b", **_DEFAULTS)
    assert a.to_dict() == dict(n=16, lr=3e-4, shuffle=False, name="qwen2.5-0.5b")
    assert type(a.n) is int and type(a.lr) is float
    lr = parse_arg("lr=1", **_DEFAULTS).lr
    assert lr == 1.0 and type(lr) is float
    for text, value in [("true", True), ("1", True), ("Yes", True), ("False", False), ("0", False)]:
        assert parse_arg(f"shuffle={text}", **_DEFAULTS).shuffle is value


@pytest.mark.parametrize(("arg", "message"), [
    ("nn=16", "config arg 'nn=16': unknown name 'nn' (did you mean n?); "
              "valid names: n, lr, shuffle, name"),
    ("epochs=2", "config arg 'epochs=2': unknown name 'epochs'; valid names: n, lr, shuffle, name"),
    ("n=abc", "config arg 'n=abc': n must be an integer (default 8), got 'abc'"),
    ("n=1.5", "config arg 'n=1.5': n must be an integer (default 8), got '1.5'"),
    ("lr=fast", "config arg 'lr=fast': lr must be a finite number (default 0.0001), got 'fast'"),
    ("lr=nan", "config arg 'lr=nan': lr must be a finite number (default 0.0001), got 'nan'"),
    ("shuffle=maybe", "config arg 'shuffle=maybe': shuffle must be true or false (default True), "
                      "got 'maybe'"),
    ("n=4,n=8", "config arg 'n=8': n is given twice"),
    ("n16", "config arg 'n16': expected name=value pairs separated by commas, e.g. "
            "'n=16,lr=3e-4'; valid names: n, lr, shuffle, name"),
])
def test_parse_arg_refuses_naming_the_arg(arg, message):
    with pytest.raises(ConfigError) as err:
        parse_arg(arg, **_DEFAULTS)
    assert str(err.value) == message


def test_parse_arg_without_names_refuses_any_arg():
    assert parse_arg(None).to_dict() == parse_arg("").to_dict() == {}
    with pytest.raises(ConfigError, match="this config takes no arg"):
        parse_arg("n=16")
    with pytest.raises(ConfigError, match="this config takes no arg"):
        grpo_gsm8k.get_config("n=16")
    with pytest.raises(ConfigError, match="this config takes no arg"):
        ppo_gsm8k.get_config("n=16")


@pytest.mark.parametrize("name", _CONFIGS)
def test_no_arg_is_the_defaults(name):
    module = importlib.import_module(f"configs.{name}")
    config = module.get_config().to_dict()
    assert module.get_config("").to_dict() == config
    variants = getattr(module, "ARG_DEFAULTS", {})
    every_default = ",".join(f"{k}={v}" for k, v in variants.items())
    assert module.get_config(every_default).to_dict() == config
    if variants:
        with pytest.raises(ConfigError, match="unknown name 'no_such_arg'"):
            module.get_config("no_such_arg=1")


def test_arith_defaults_are_as_before():
    c = grpo_arith.get_config()
    assert (c.rollout.n, c.actor.optim.lr, c.trainer.total_training_steps, c.seed) == (
        8, 1e-4, 100, 0)
    assert c.actor.ppo_micro_batch_size == 128
    c = ppo_arith.get_config()
    assert (c.rollout.n, c.actor.optim.lr, c.critic.optim.lr, c.trainer.total_training_steps,
            c.seed) == (4, 1e-4, 1e-3, 100, 0)
    assert c.actor.ppo_micro_batch_size == c.critic.ppo_micro_batch_size == 128


def test_grpo_arith_variants():
    c = grpo_arith.get_config("n=16,lr=3e-4,steps=20,seed=3")
    assert (c.rollout.n, c.actor.optim.lr, c.trainer.total_training_steps, c.seed) == (
        16, 3e-4, 20, 3)
    assert dapo_arith.get_config("n=16").rollout.n == 16  # passed on to grpo_arith


def test_ppo_arith_variants():
    c = ppo_arith.get_config("n=8,lr=3e-5,critic_lr=3e-4,steps=20,seed=3")
    assert (c.rollout.n, c.actor.optim.lr, c.critic.optim.lr, c.trainer.total_training_steps,
            c.seed, c.algorithm.adv_estimator) == (8, 3e-5, 3e-4, 20, 3, "gae")


@pytest.mark.parametrize("module", [grpo_arith, ppo_arith], ids=["grpo_arith", "ppo_arith"])
@pytest.mark.parametrize("n", [2, 3, 4, 6, 12, 16])
def test_every_n_gives_a_valid_config(module, n):
    """The micro-batch follows n so that it divides the mini-batch."""
    config = module.get_config(f"n={n}")
    tok = CharTokenizer()
    s = settings.from_config(config, stop_token_ids=tok.eos_token_ids,
                             pad_token_id=tok.pad_token_id, num_train_rows=5000)
    assert s.rollout.n == n


def test_configs_that_build_on_others_load_from_any_directory(tmp_path):
    """`ppo_arith.py` builds on `grpo_arith.py`: it loads by path, not as `configs.*`."""
    import subprocess
    import sys

    path = os.path.join(ROOT, "configs", "ppo_arith.py")
    code = ("from jrl import cli; "
            f"print(cli._load_config({os.path.abspath(path)!r}).algorithm.adv_estimator)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "gae"


@pytest.mark.parametrize("unroll, actor_dynamic, critic_dynamic, expected", [
    (None, False, False, False), (None, True, False, True), (None, False, True, True),
    (False, True, True, False), (True, False, False, True)])
def test_scan_unroll_default_follows_token_budget_micro_batches(unroll, actor_dynamic,
                                                                critic_dynamic, expected):
    from jrl.config.defaults import base_config

    c = base_config()
    assert c.model.scan_unroll is None  # the default: decided by the micro-batching
    c.model.scan_unroll = unroll
    c.actor.use_dynamic_bsz, c.critic.use_dynamic_bsz = actor_dynamic, critic_dynamic
    assert settings.experiment_from_config(c).model.scan_unroll is expected
