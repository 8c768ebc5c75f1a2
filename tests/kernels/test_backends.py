"""A jax without Pallas' Mosaic GPU backend (missing from older or CPU-only builds), the
one jrl's GPU kernels run on: jrl still imports and runs on the XLA paths, and forcing a
kernel stops with a ConfigError naming its key."""

import textwrap

import pytest

from jrl.errors import ConfigError
from jrl.kernels import decode_attention as da
from jrl.kernels import logprob_head as hk
from jrl.kernels import mosaic_backend
from jrl.models import ModelConfig
from tests.eight_devices import run_script

_WITHOUT_BACKENDS = textwrap.dedent("""
    import json, sys
    sys.modules["jax.experimental.pallas.mosaic_gpu"] = None  # any import of it now fails
    import jax, numpy as np
    from jrl.rollout import sampler
    from jrl.errors import ConfigError
    from jrl.models import ModelConfig, init_params
    from jrl.kernels import mosaic_backend
    from jrl.kernels import decode_attention as da
    from jrl.kernels import logprob_head as hk
    from jrl.rollout.sampler import SamplingConfig

    out = {"available": mosaic_backend.available()}
    jax.default_backend = lambda: "gpu"  # where the kernels would be chosen
    mosaic_backend.on_hopper = lambda: True
    out["auto"] = [da.choose_impl("auto", 64, 384, "bfloat16"), hk.choose_impl("auto", 896)]
    jax.default_backend = lambda: "cpu"
    # The kernels called directly (interpret mode) stop with the same errors.
    x, s = np.zeros((1, 2, 32), np.float32), np.zeros((1, 1, 64, 32), np.float32)
    calls = {
        "decode mosaic": lambda: da.append_and_attend(
            x, x[:, :1], x[:, :1], x[:, 0, :16], x[:, 0, :16], s, s, np.zeros(1, np.int32),
            3, impl="mosaic", interpret=True),
        "head mosaic": lambda: hk.log_softmax_stats(
            np.zeros((1, 4, 64), np.float32), np.zeros((256, 64), np.float32),
            np.zeros((1, 4), np.int32), vocab=200, vocab_first=True, interpret=True),
    }
    out["kernels"] = {}
    for name, call in calls.items():
        try:
            call()
            out["kernels"][name] = "ran"
        except ConfigError as e:
            out["kernels"][name] = str(e)
    out["errors"] = {}
    for key in ("decode_attention_impl", "logprob_impl"):
        try:
            ModelConfig.preset("tiny", **{key: "mosaic"})
        except ConfigError as e:
            out["errors"][key] = str(e)
    config = ModelConfig.preset("tiny")
    params = init_params(config, jax.random.key(0))
    ids = np.ones((2, 4), np.int32)
    sampled = sampler.generate(params, ids, np.ones_like(ids), jax.random.key(1),
                               SamplingConfig(max_new_tokens=3), config=config)
    out["responses"] = list(sampled.responses.shape)
    print(json.dumps(out))
""")

_NEEDS = "needs Pallas' Mosaic GPU backend"


def test_without_the_backend_jrl_runs_on_xla_and_refuses_a_forced_kernel():
    result = run_script(_WITHOUT_BACKENDS)
    assert result["available"] is False
    assert result["auto"] == ["xla", "xla"]
    assert result["errors"].keys() == {"decode_attention_impl", "logprob_impl"}
    for key, message in result["errors"].items():
        assert f"model.{key}='mosaic' {_NEEDS}" in message, message
        assert "use 'auto' or 'xla'" in message
    assert result["responses"] == [2, 3]
    assert result["kernels"] == {
        "decode mosaic": result["errors"]["decode_attention_impl"],
        "head mosaic": result["errors"]["logprob_impl"]}


def test_choices_without_the_backend(monkeypatch):
    """The same choices in this process, with the backend patched away."""
    monkeypatch.setattr(mosaic_backend, "plgpu", None)
    monkeypatch.setattr(mosaic_backend, "on_hopper", lambda: True)
    monkeypatch.setattr(da.jax, "default_backend", lambda: "gpu")
    assert da.choose_impl("auto", 64, 384, "bfloat16") == "xla"
    assert hk.choose_impl("auto", 896) == "xla"
    assert da.choose_impl("xla", 64) == "xla" and hk.choose_impl("xla", 896) == "xla"
    for check, key in (
            (lambda: da.choose_impl("mosaic", 64), "decode_attention_impl"),
            (lambda: hk.choose_impl("mosaic", 896), "logprob_impl"),
            (lambda: ModelConfig.preset("tiny", logprob_impl="mosaic"), "logprob_impl")):
        with pytest.raises(ConfigError, match=rf"model\.{key}='mosaic' {_NEEDS}"):
            check()
