"""The suite's program budget (`tests/compile_budget.py`) fails a full run that builds
more distinct XLA programs than it allows, and only a full run."""

import os

import pytest

pytest_plugins = ["pytester"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Three programs of their own (one a shape) and the few that `jnp.ones` builds.
_TESTS = """
import jax, jax.numpy as jnp

def test_three_shapes():
    for n in (1, 2, 3):
        jax.jit(lambda x: x * 2)(jnp.ones(n)).block_until_ready()
"""


@pytest.fixture
def inner(pytester, monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    pytester.makeconftest(f"""
import jax
jax.config.update("jax_compilation_cache_dir", {str(tmp_path / "cache")!r})
pytest_plugins = ["tests.compile_budget"]
""")
    pytester.makepyfile(test_shapes=_TESTS)

    def run(budget: int, *args):
        monkeypatch.setenv("JRL_TEST_PROGRAM_BUDGET", str(budget))
        return pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
    return run


def test_a_full_run_over_the_budget_fails_and_says_so(inner):
    within = inner(1000)
    within.assert_outcomes(passed=1)
    line = next(s for s in within.outlines if s.startswith("XLA programs: "))
    distinct = int(line.split()[2])
    assert 3 <= distinct < 1000, line
    # The module that built them is named, with the programs it built first.
    modules = next(s for s in within.outlines if "most compile time" in s)
    assert f"test_shapes.py {distinct} " in modules, modules

    over = inner(distinct - 1)
    assert over.ret == pytest.ExitCode.TESTS_FAILED
    over.assert_outcomes(passed=1)  # every test passed: the budget failed the run
    over.stdout.fnmatch_lines([f"FAILED: the suite built {distinct} distinct XLA programs, "
                               f"over the budget of {distinct - 1} *"])


def test_a_partial_run_is_not_held_to_the_budget(inner):
    partial = inner(1, "-k", "three")
    assert partial.ret == pytest.ExitCode.OK
    assert not any(s.startswith("FAILED: the suite built") for s in partial.outlines)
