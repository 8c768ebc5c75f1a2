"""The tokenizer must fit `model.path`'s checkpoint: checked before anything compiles,
one line naming both keys and the fix."""

import json

import pytest

from jrl import train
from jrl.app import experiment
from jrl.config.settings import experiment_from_config
from jrl.data.tokenizers import CharTokenizer
from jrl.errors import ConfigError
from tests.tiny import tiny_config, tiny_hf_checkpoint

CHAR_VOCAB = CharTokenizer().vocab_size  # 99


def _checkpoint_config(path, vocab_size: int):
    """A checkpoint directory as far as the check reads it: its config.json."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"vocab_size": vocab_size}))
    return str(path)


@pytest.fixture
def no_compile(monkeypatch):
    import jax

    monkeypatch.setattr(jax, "jit", lambda *a, **k: pytest.fail("compiled before checking"))


@pytest.mark.parametrize("vocab_size", [64, 151936])
def test_a_checkpoint_with_the_char_tokenizer_names_both_keys_and_the_fix(
        tmp_path, no_compile, vocab_size):
    path = _checkpoint_config(tmp_path / "model", vocab_size)
    with pytest.raises(ConfigError) as err:
        train.run(tiny_config(**{"model.path": path}), str(tmp_path / "run"))
    assert str(err.value) == (
        f"model.path={path!r} has a {vocab_size}-token vocabulary, but tokenizer.name='char' "
        f"is the built-in {CHAR_VOCAB}-token character tokenizer; add "
        "--config.tokenizer.name=hf to use the checkpoint's tokenizer")


def test_a_checkpoint_with_its_own_tokenizer_is_never_read_with_the_char_tokenizer(tmp_path):
    path = _checkpoint_config(tmp_path / "model", CHAR_VOCAB)
    (tmp_path / "model" / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"vocabulary and its own tokenizer, but "
                                          r"tokenizer\.name='char'.*--config\.tokenizer\.name=hf"):
        experiment.build_tokenizer(experiment_from_config(tiny_config(**{"model.path": path})))


def test_a_checkpoint_trained_with_the_char_tokenizer_keeps_it(tmp_path):
    """jrl's own export of a char-tokenizer run: exactly that vocabulary, no tokenizer."""
    tiny_hf_checkpoint(tmp_path / "model")
    config = tiny_config(**{"model.path": str(tmp_path / "model")})
    assert isinstance(experiment.build_tokenizer(experiment_from_config(config)), CharTokenizer)


def test_a_tokenizer_larger_than_the_model_vocabulary_names_both_sizes(tmp_path):
    from tests.rl.test_gsm8k_run import _write_tokenizer

    (tmp_path / "tok").mkdir()
    _write_tokenizer(tmp_path / "tok")  # 102 tokens
    path = _checkpoint_config(tmp_path / "model", 99)
    config = tiny_config(**{"model.path": path, "tokenizer.name": "hf",
                            "tokenizer.path": str(tmp_path / "tok")})
    with pytest.raises(ConfigError, match=r"^tokenizer\.path / model\.path: the tokenizer of "
                                          r".*/tok' has 102 tokens, more than the "
                                          r"vocab_size=99 in config\.json of model\.path="):
        experiment.build_tokenizer(experiment_from_config(config))
    (tmp_path / "model" / "config.json").write_text(json.dumps({"vocab_size": 128}))
    assert experiment.build_tokenizer(experiment_from_config(config)).vocab_size == 102


def test_a_missing_model_path_is_named_as_such(tmp_path):
    missing = str(tmp_path / "no-such-model")
    config = tiny_config(**{"model.path": missing, "tokenizer.name": "hf"})
    with pytest.raises(ConfigError) as err:
        experiment.build_tokenizer(experiment_from_config(config))
    assert str(err.value) == (f"model.path: {missing!r} does not exist; expected a checkpoint "
                              "directory with config.json and safetensors weights")
