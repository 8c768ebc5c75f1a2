"""`trainer.compilation_cache_dir`: where `python -m jrl.train` keeps compiled programs."""

import os
import subprocess
import sys

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from jrl.app import compilation_cache
from jrl.errors import ConfigError
from jrl.train import run
from tests.tiny import tiny_config

_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes", "jax_compilation_cache_max_size")
_THRESHOLD_ENV = [option.upper() for option in _OPTIONS[1:]]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def jax_options(monkeypatch):
    """Puts jax's cache options (and its cache) back as the test found them."""
    for name in ("JAX_COMPILATION_CACHE_DIR", "XDG_CACHE_HOME", *_THRESHOLD_ENV):
        monkeypatch.delenv(name, raising=False)
    saved = {option: getattr(jax.config, option) for option in _OPTIONS}
    yield saved
    for option, value in saved.items():
        jax.config.update(option, value)
    jax_cache.reset_cache()


def test_default_directory_honours_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compilation_cache.default_dir() == str(tmp_path / "home/.cache/jrl/xla")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compilation_cache.default_dir() == str(tmp_path / "xdg/jrl/xla")


def test_a_path_wins_over_the_environment_which_wins_over_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compilation_cache.resolve(None) == str(tmp_path / "xdg/jrl/xla")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
    assert compilation_cache.resolve(None) == str(tmp_path / "env")
    assert compilation_cache.resolve(str(tmp_path / "key")) == str(tmp_path / "key")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compilation_cache.resolve("~/c") == str(tmp_path / "home/c")
    assert compilation_cache.resolve("") is None


def test_empty_string_leaves_jax_alone(jax_options):
    assert compilation_cache.configure("") is None
    assert {option: getattr(jax.config, option) for option in _OPTIONS} == jax_options


def test_configure_sets_the_directory_and_the_thresholds(tmp_path):
    path = tmp_path / "a" / "b"
    assert compilation_cache.configure(str(path)) == str(path)
    assert path.is_dir()
    assert jax.config.jax_compilation_cache_dir == str(path)
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 1.0
    assert jax.config.jax_persistent_cache_min_entry_size_bytes == 0
    assert jax.config.jax_compilation_cache_max_size == 4 * 1024 ** 3


def test_thresholds_the_environment_sets_are_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "7")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 7.0)
    compilation_cache.configure(str(tmp_path))
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 7.0
    assert jax.config.jax_compilation_cache_max_size == 4 * 1024 ** 3


def test_bad_values_name_the_key(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    key = "trainer.compilation_cache_dir"
    with pytest.raises(ConfigError, match=rf"^{key}: '.*/file' is a file; give a directory"):
        compilation_cache.configure(str(tmp_path / "file"))
    with pytest.raises(ConfigError, match=rf"^{key}: cannot create the directory '.*/file/sub'"):
        compilation_cache.configure(str(tmp_path / "file" / "sub"))
    with pytest.raises(ConfigError, match=rf"^{key}=3: must be a directory path"):
        compilation_cache.resolve(3)  # (the config's type check stops it first)
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "file"))
    with pytest.raises(ConfigError, match=rf"^{key}=None \(\$JAX_COMPILATION_CACHE_DIR\): "):
        compilation_cache.configure(None)


def test_a_tiny_run_fills_the_cache(tmp_path, monkeypatch):
    # Shapes of this test only: no program of another test is in jax's memory cache.
    config = tiny_config(**{"model.intermediate_size": 40,
                            "trainer.compilation_cache_dir": str(tmp_path / "cache")})
    monkeypatch.setattr(compilation_cache, "MIN_COMPILE_TIME_SECS", 0.0)
    compilation_cache.configure(config.trainer.compilation_cache_dir)
    assert os.listdir(tmp_path / "cache") == []
    run(config, str(tmp_path / "run"), exit_after_steps=1)
    assert len(os.listdir(tmp_path / "cache")) >= 3


def test_cli_reports_a_bad_directory_as_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    done = subprocess.run([sys.executable, "-m", "jrl.train", "--config=configs/grpo_arith.py",
                           f"--workdir={tmp_path / 'run'}",
                           f"--config.trainer.compilation_cache_dir={tmp_path / 'file'}"],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert done.returncode == 2
    assert done.stderr == (f"error: trainer.compilation_cache_dir: '{tmp_path / 'file'}' is a "
                           "file; give a directory, or \"\" to turn the compilation cache off\n")
    assert not (tmp_path / "run").exists()
