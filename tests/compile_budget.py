"""Counts the XLA programs the test suite builds, and holds the full suite to a budget.

Compiling is most of the suite's time, so the number of distinct programs is what a
new test costs. Every program JAX hands to XLA is counted by its compilation-cache
key, whether it was compiled or read back from the persistent cache, so the count is
the same on a cold and a warm cache. Each pytest-xdist worker writes what it built;
the controller adds them up, prints the figures and, for a full run (no paths given
but the testpaths; no `-k`, `-m`, `--deselect` or `--lf`), fails the session when
the distinct programs pass `PROGRAM_BUDGET`. Programs built by subprocesses the tests
start (`python -m jrl.train`, the notebook) are not counted.

A capability that adds tests adds programs: make them share the session fixtures in
`tests/tiny.py` first; raise the budget only where a new program is what is tested.
"""

import json
import os
import tempfile

import jax
import pytest
from jax import monitoring
from jax._src import compiler as _compiler

# Distinct programs of the full suite on the CPU: 5,239 before the budget was last raised,
# for the fused decode kernel's qkv-bias operand made once a rollout, whose tests run the
# kernel on it in interpret mode and compile the sampler's decode loop with and without
# it (5,250 then); 5,213 when it was raised before that,
# for the sampler's decode head on the log-prob kernel, whose tests run the kernel's masses
# and the draw from them in interpret mode against XLA's draw, alone and in a rollout on
# either cache; 5,209 when it was raised before that,
# for the MoE decode's gate and up joined into one kernel, whose test builds that layout
# (`fuse_projections`) and applies the block in it; 5,129 when it was raised before
# that, for the fused decode kernel over a paged cache, whose tests compile it in interpret
# mode at two head sizes, lower it for CUDA at two, and run a short paged rollout through
# it beside the XLA path's; 5,143 when it was raised before that (5,094
# before multi-turn rollouts on the paged cache, whose cases each compile the start and
# resume programs at their page size and pool, beside the contiguous cache's at their
# stop tokens, and the trainer's on the paged cache); 5,093 before that (5,070
# before partial rollouts on the paged cache, whose continuation programs compile at each
# prefix width, the rounds' programs compiled ahead of the first step on either cache,
# and the paged admission cases of one page a row and of preemption at 2 decode
# buckets; 5,029 before the continued rows' tests handed their cache on past the decode loop's
# compactions, at 4 decode buckets and at 1, and the tests of Gemma's GeGLU and q/k norms
# recomputed in a rolled scan's backward pass); 5,002 before that (4,928
# before the paged cache's decode kernels, the Mosaic GPU one and Pallas' TPU paged
# attention, each run in its interpret mode, alone and in the paged sampler); 4,898
# before that (4,883
# before partial rollouts, whose sampler and trainer tests compile the continuation
# program at each prefix width they pass; 4,722 before Gemma's windowed and soft-capped
# packed attention, whose splash, context and model tests compile both layer variants,
# the sliding layers' ring-buffer cache and the old-log-prob pass that records its
# experts; 4,561 before the mixture-of-experts and Gemma families), and room for a few
# more. Raise it in the change that adds programs, saying why. (The variable is for the
# budget's own test.)
PROGRAM_BUDGET = int(os.environ.get("JRL_TEST_PROGRAM_BUDGET", 5258))

_DIR_VARIABLE = "JRL_TEST_PROGRAM_COUNTS"
TOP_MODULES = 10  # the modules the summary names

_requests = 0
_compile_seconds = 0.0
_keys: set[str] = set()
# Per test module: the programs it built first in its worker, and the seconds spent
# compiling or loading programs while its tests ran (where a new test's cost shows).
_module = "(collection)"
_module_keys: dict[str, set[str]] = {}
_module_seconds: dict[str, float] = {}


def _on_event(event: str, **_):
    global _requests
    if event == "/jax/compilation_cache/compile_requests_use_cache":
        _requests += 1


def _on_duration(event: str, seconds: float, **_):
    global _compile_seconds
    if event == "/jax/core/compile/backend_compile_duration":
        _compile_seconds += seconds
        _module_seconds[_module] = _module_seconds.get(_module, 0.0) + seconds


def _recording(log):
    def record(module_name, cache_key):
        if cache_key not in _keys:
            _module_keys.setdefault(_module, set()).add(cache_key)
        _keys.add(cache_key)
        return log(module_name, cache_key)
    return record


monitoring.register_event_listener(_on_event)
monitoring.register_event_duration_secs_listener(_on_duration)
# JAX logs each program's cache key on a cache hit or miss; these two functions (looked
# up by name when called) are where the key is in hand.
_HOOKS = ("log_persistent_cache_hit", "log_persistent_cache_miss")
# Another JAX may have moved them: then nothing is counted, and a full run says so.
COUNTING = all(hasattr(_compiler, name) for name in _HOOKS)
if COUNTING:
    for _name in _HOOKS:
        setattr(_compiler, _name, _recording(getattr(_compiler, _name)))


def pytest_configure(config):
    if not hasattr(config, "workerinput"):
        # The controller makes the directory; xdist's workers inherit its environment.
        os.environ[_DIR_VARIABLE] = tempfile.mkdtemp(prefix="jrl-programs-")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    global _module
    _module = item.nodeid.split("::")[0]


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if hasattr(config, "workerinput"):
        _write(config.workerinput["workerid"])
        return
    if not getattr(config.option, "numprocesses", None):
        _write("main")
    totals = _collect()
    config._jrl_program_totals = totals
    if (exitstatus == pytest.ExitCode.OK and _is_full_run(config)
            and (not COUNTING or len(totals["keys"]) > PROGRAM_BUDGET)):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        config._jrl_over_budget = True


def _write(worker: str):
    with open(os.path.join(os.environ[_DIR_VARIABLE], f"{worker}.json"), "w") as f:
        json.dump({"requests": _requests, "compile_seconds": _compile_seconds,
                   "keys": sorted(_keys),
                   "modules": {m: [sorted(k), _module_seconds.get(m, 0.0)]
                               for m, k in _module_keys.items()}}, f)


def _collect():
    directory = os.environ[_DIR_VARIABLE]
    keys, requests, seconds = set(), 0, 0.0
    modules: dict[str, list] = {}  # module: [its programs that no earlier module built, s]
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        with open(path) as f:
            part = json.load(f)
        keys.update(part["keys"])
        requests += part["requests"]
        seconds += part["compile_seconds"]
        for module, (module_keys, module_seconds) in part.get("modules", {}).items():
            entry = modules.setdefault(module, [set(), 0.0])
            entry[0].update(module_keys)
            entry[1] += module_seconds
        os.remove(path)
    os.rmdir(directory)
    return {"keys": keys, "requests": requests, "compile_seconds": seconds,
            "modules": {m: (len(k), s) for m, (k, s) in modules.items()}}


def _is_full_run(config) -> bool:
    option = config.option
    if (getattr(option, "keyword", "") or getattr(option, "markexpr", "")
            or getattr(option, "lf", False) or getattr(option, "deselect", None)):
        return False
    if config.args_source != pytest.Config.ArgsSource.ARGS:  # the testpaths, or the directory
        return True
    testpaths = {os.path.join(str(config.rootpath), p) for p in config.getini("testpaths")}
    return {os.path.abspath(a) for a in config.args} == testpaths


def pytest_terminal_summary(terminalreporter, config):
    totals = getattr(config, "_jrl_program_totals", None)
    if not totals:
        return
    if not COUNTING:
        failed = "FAILED: " if getattr(config, "_jrl_over_budget", False) else ""
        terminalreporter.write_line(
            f"{failed}XLA programs not counted: jax {jax.__version__} has no "
            f"jax._src.compiler.{' or '.join(_HOOKS)} (tests/compile_budget.py)",
            red=bool(failed))
        return
    terminalreporter.write_line(
        f"XLA programs: {len(totals['keys'])} distinct (full-suite budget "
        f"{PROGRAM_BUDGET}), {totals['requests']} built in all workers, "
        f"{totals['compile_seconds']:.0f} s compiling or loading them")
    top = sorted(totals["modules"].items(), key=lambda kv: -kv[1][1])[:TOP_MODULES]
    if top:
        terminalreporter.write_line(
            "  most compile time (programs first built there, s): " + ", ".join(
                f"{module} {n} {s:.0f}" for module, (n, s) in top))
    if getattr(config, "_jrl_over_budget", False):
        terminalreporter.write_line(
            f"FAILED: the suite built {len(totals['keys'])} distinct XLA programs, over "
            f"the budget of {PROGRAM_BUDGET} (tests/compile_budget.py). Share the "
            "session fixtures in tests/tiny.py, or raise the budget where the new "
            "programs are what is tested.", red=True)
