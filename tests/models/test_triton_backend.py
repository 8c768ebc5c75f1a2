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


def test_choices_without_the_backend(monkeypatch):
    """The same choices in this process, with the backend patched away."""
    assert triton_backend.available()  # the jax the tests run has it
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
