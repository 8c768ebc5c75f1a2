"""Shared test setup: JAX on the CPU (by default), and a compilation cache shared by the tests.

Many tests compile the same programs (the sampler, log-probs, updates of the tiny
model); the persistent cache lets later tests reuse what earlier ones compiled.
"""

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] == "cpu":
    # Most of the suite's time is XLA compiling small programs. The tests check what the
    # programs compute, which the CPU code's optimisation does not change beyond float
    # rounding: with LLVM at level 0 and fusions emitted straight to LLVM IR (not through
    # XLA's MLIR fusion emitters) a trainer's programs compile in about half the time, and
    # the tiny models here run no slower for it. Subprocesses the tests start inherit the
    # flags (`tests.eight_devices.cpu_env`).
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false").strip()
else:
    # On a GPU the tests compile hundreds of small programs: XLA's autotuning of each
    # matmul and fusion (several seconds a program, no effect on results at the tests'
    # float32 precision) is skipped, and memory is taken as needed so that several
    # pytest workers (`-n`) can share one GPU. Each buffer's memory goes back to the
    # card when the buffer dies (the platform allocator): JAX's pooling allocator keeps
    # each worker's peak, and 8 workers' pools after the kernel checks at real sizes
    # (several GiB each) overflowed an 80 GB H100.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_gpu_autotune_level=0").strip()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")

import jax  # noqa: E402
import pytest  # noqa: E402

# The tests compare float32 results with float64 and PyTorch references at float32
# tolerances. Off the CPU (JAX_PLATFORMS=cuda, tpu), float32 matmuls default to TF32 or
# bf16 operands, in XLA and in Pallas kernels alike; the tests ask for full float32.
if jax.default_backend() != "cpu":
    jax.config.update("jax_default_matmul_precision", "float32")

_CACHE = os.environ.get("JRL_TEST_COMPILATION_CACHE",
                        os.path.join(tempfile.gettempdir(), "jrl-jax-cache"))
jax.config.update("jax_compilation_cache_dir", _CACHE)
# `python -m jrl.train` started by the tests caches there too, not in ~/.cache/jrl/xla.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

pytest_plugins = ["tests.compile_budget"]


def pytest_collection_modifyitems(config, items):
    """Runs the modules with a module-scoped fixture (a subprocess of 8 devices, a warm
    start) first. pytest-xdist sends each module to one worker (`--dist loadscope`), so
    such a fixture is built once; started first, the slowest modules do not finish
    alone at the end."""
    def builds_a_module_fixture(item) -> bool:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info else ()
        return any(d and d[-1].scope in ("module", "package") for d in defs)

    first = {item.path for item in items if builds_a_module_fixture(item)}
    items.sort(key=lambda item: item.path not in first)  # stable: modules stay whole


@pytest.fixture
def xla_default_emitters(monkeypatch):
    """The test's programs compiled with XLA's default CPU fusion emitters, not the
    suite's faster-compiling ones (`XLA_FLAGS` above): for tests that two differently
    built programs give the same bits, which XLA's emitters give and the suite's
    may round apart by an ulp."""
    from jax._src import compiler

    get_options = compiler.get_compile_options

    def with_default_emitters(*args, env_options_overrides=None, **kwargs):
        overrides = {"xla_cpu_use_fusion_emitters": True, **(env_options_overrides or {})}
        return get_options(*args, env_options_overrides=overrides, **kwargs)

    if jax.default_backend() == "cpu":
        monkeypatch.setattr(compiler, "get_compile_options", with_default_emitters)
        jax.clear_caches()  # programs built earlier in this process had the suite's flags
    yield
    jax.clear_caches()
