"""JAX's persistent compilation cache for `python -m jrl.train` (`trainer.compilation_cache_dir`).

A second start of the same config reads the compiled programs back from disk instead
of compiling them again. `configure` is called once by the command line, before
anything compiles; importing jrl, or calling `jrl.train.run` from a program of one's
own, leaves jax's global config as it is.

Where the cache goes: the key's path when it is given; unset (None), the directory of
`JAX_COMPILATION_CACHE_DIR` when the environment sets it, else `$XDG_CACHE_HOME/jrl/xla`
(`~/.cache/jrl/xla`); "" turns jrl's cache off and leaves jax's own setting alone. jax
keys each entry on the program, the jax/jaxlib version, XLA flags and the devices, so
one directory serves every config, version and card.
"""

from __future__ import annotations

import os

from jrl.errors import ConfigError

KEY = "trainer.compilation_cache_dir"
ENV_DIR = "JAX_COMPILATION_CACHE_DIR"
# Only programs whose compilation took this long are written: the many small CPU
# programs (a sampling step of a tiny model, a metric) compile in milliseconds and
# would only fill the disk. jax's own default, set explicitly so the cache behaves
# the same whatever jax version changes it to.
MIN_COMPILE_TIME_SECS = 1.0
# No floor on an entry's size: the compile-time floor already keeps the small ones out.
MIN_ENTRY_SIZE_BYTES = 0
# The least recently used entries are removed beyond this total (4 GiB).
MAX_SIZE_BYTES = 4 << 30
# jax options left as they are when the environment sets them.
_SETTINGS = (("jax_persistent_cache_min_compile_time_secs", "MIN_COMPILE_TIME_SECS"),
             ("jax_persistent_cache_min_entry_size_bytes", "MIN_ENTRY_SIZE_BYTES"),
             ("jax_compilation_cache_max_size", "MAX_SIZE_BYTES"))


def default_dir() -> str:
    """`$XDG_CACHE_HOME/jrl/xla`, or `~/.cache/jrl/xla` without XDG_CACHE_HOME."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jrl", "xla")


def resolve(value) -> str | None:
    """The cache directory `value` (the key's value) stands for; None: off ("")."""
    if value is None:
        return os.environ.get(ENV_DIR) or default_dir()
    if not isinstance(value, str):
        raise ConfigError(f"{KEY}={value!r}: must be a directory path, \"\" (off) or None "
                          f"(${ENV_DIR}, else {default_dir()})")
    return os.path.abspath(os.path.expanduser(value)) if value else None


def configure(value) -> str | None:
    """Turns the persistent cache on as `trainer.compilation_cache_dir` (its value:
    `value`) says; returns the directory (None: off, jax's config untouched).

    Raises:
      ConfigError: the path is a file, or the directory cannot be made or written.
    """
    path = resolve(value)
    if path is None:
        return None
    _make_dir(path, KEY if value is not None or not os.environ.get(ENV_DIR)
              else f"{KEY}=None (${ENV_DIR})")
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_compilation_cache_dir", path)
    for option, constant in _SETTINGS:
        if option.upper() not in os.environ:
            jax.config.update(option, globals()[constant])
    compilation_cache.reset_cache()  # a cache jax set up before (without a path) is dropped
    return path


def _make_dir(path: str, key: str) -> None:
    """Makes `path` (and its parents); a ConfigError naming `key` if it cannot."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{key}: {path!r} is a file; give a directory, or \"\" to turn the "
                          "compilation cache off")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{key}: cannot create the directory {path!r} ({err.strerror}); "
                          "give a writable directory, or \"\" to turn the cache off") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: the directory {path!r} is not writable; give a writable "
                          "directory, or \"\" to turn the compilation cache off")
