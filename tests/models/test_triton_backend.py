"""A jax without Pallas' Triton backend (deprecated in jax 0.11, to be removed): jrl
still imports and runs on the XLA paths, and forcing a kernel stops with a ConfigError
naming its key."""

import textwrap

import pytest

from jrl.errors import ConfigError
from jrl.models import ModelConfig, triton_backend
from jrl.models import decode_attention as da
from jrl.models import head_kernel as hk
from tests.eight_devices import run_script

_WITHOUT_TRITON = textwrap.dedent("""
    import json, sys
    sys.modules["jax.experimental.pallas.triton"] = None  # any import of it now fails
    import jax, numpy as np
    from jrl import rollout
    from jrl.errors import ConfigError
    from jrl.models import ModelConfig, init_params, triton_backend
    from jrl.models import decode_attention as da, head_kernel as hk
    from jrl.rollout import SamplingConfig

    out = {"available": triton_backend.available()}
    jax.default_backend = lambda: "gpu"  # where the kernels would be chosen
    out["auto"] = [da.choose_impl("auto", 64), hk.choose_impl("auto", 896)]
    jax.default_backend = lambda: "cpu"
    # The kernels called directly (interpret mode) stop with the same error.
    x, s = np.zeros((1, 2, 32), np.float32), np.zeros((1, 1, 64, 32), np.float32)
    calls = {
        "decode": lambda: da.append_and_attend(x, x[:, :1], x[:, :1], x[:, 0, :16],
                                               x[:, 0, :16], s, s, np.zeros(1, np.int32), 3,
                                               impl="pallas", interpret=True),
        "head": lambda: hk.log_softmax_stats(np.zeros((1, 4, 64), np.float32),
                                             np.zeros((128, 64), np.float32),
                                             np.zeros((1, 4), np.int32), vocab=100,
                                             vocab_first=True, interpret=True),
    }
    out["kernels"] = {}
    for name, call in calls.items():
        try:
            call()
            out["kernels"][name] = "ran"
        except ConfigError as e:
            out["kernels"][name] = str(e)
    errors = []
    for key in ("decode_attention_impl", "logprob_impl"):
        try:
            ModelConfig.preset("tiny", **{key: "pallas"})
        except ConfigError as e:
            errors.append(str(e))
    out["errors"] = errors
    config = ModelConfig.preset("tiny")
    params = init_params(config, jax.random.key(0))
    ids = np.ones((2, 4), np.int32)
    sampled = rollout.generate(params, ids, np.ones_like(ids), jax.random.key(1),
                               SamplingConfig(max_new_tokens=3), config=config)
    out["responses"] = list(sampled.responses.shape)
    print(json.dumps(out))
""")


def test_without_the_backend_jrl_runs_on_xla_and_refuses_a_forced_kernel():
    result = run_script(_WITHOUT_TRITON)
    assert result["available"] is False
    assert result["auto"] == ["xla", "xla"]
    assert len(result["errors"]) == 2
    for key, message in zip(("decode_attention_impl", "logprob_impl"), result["errors"],
                            strict=True):
        assert f"model.{key}='pallas' needs Pallas' Triton backend" in message, message
        assert "use 'auto' or 'xla'" in message
    assert result["responses"] == [2, 3]
    assert result["kernels"].keys() == {"decode", "head"}
    for key, message in (("decode_attention_impl", result["kernels"]["decode"]),
                         ("logprob_impl", result["kernels"]["head"])):
        assert f"model.{key}='pallas' needs Pallas' Triton backend" in message, message


def test_choices_without_the_backend(monkeypatch):
    """The same choices in this process, with the backend patched away."""
    monkeypatch.setattr(triton_backend, "plgpu", None)
    monkeypatch.setattr(da.jax, "default_backend", lambda: "gpu")
    assert da.choose_impl("auto", 64) == "xla" and hk.choose_impl("auto", 896) == "xla"
    assert da.choose_impl("xla", 64) == "xla" and hk.choose_impl("xla", 896) == "xla"
    for check, key in ((lambda: da.choose_impl("pallas", 64), "decode_attention_impl"),
                       (lambda: hk.choose_impl("pallas", 896), "logprob_impl"),
                       (lambda: ModelConfig.preset("tiny", logprob_impl="pallas"),
                        "logprob_impl")):
        with pytest.raises(ConfigError, match=rf"model\.{key}='pallas' needs Pallas' Triton"):
            check()
