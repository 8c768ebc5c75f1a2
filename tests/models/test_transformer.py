"""ModelConfig presets and HF configs, parameter layout, remat, dtypes, heads."""

import dataclasses
import functools
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jrl.models import (
    PRESETS,
    ModelConfig,
    RopeScaling,
    forward,
    init_cache,
    init_critic_params,
    init_params,
    param_logical_axes,
    positions_from_mask,
    transformer,
    unembed,
    values,
)
from jrl.models.hf import tensor_specs
from jrl.models.transformer import Transformer, _attention_impl, geglu, swiglu

# Parameter counts published for the released checkpoints (model cards / HF num_parameters).
PUBLISHED_PARAM_COUNTS = {
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-7b": 7_615_616_512,
    "qwen3-0.6b": 596_049_920,
    "llama-3.2-1b": 1_235_814_400,
    # Counted by hand from the released config.json shapes (embeddings and head untied,
    # attention, router, E experts x 3 projections, norms): "30.5B" and "46.7B" published.
    "qwen3-30b-a3b": 30_532_122_624,
    "mixtral-8x7b": 46_702_792_704,
    "gemma-2-2b": 2_614_341_888,
    "gemma-2-9b": 9_241_705_984,
    "gemma-3-1b": 999_885_952,
}
LOGICAL_AXIS_NAMES = {"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers", None}

# The published config.json of meta-llama/Llama-3.2-1B (transformers 4 layout).
LLAMA_3_2_1B_CONFIG_JSON = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 128256,
}
# The published config.json of Qwen/Qwen3-0.6B.
QWEN3_0_6B_CONFIG_JSON = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}

# The published config.json of Qwen/Qwen3-30B-A3B.
QWEN3_30B_A3B_CONFIG_JSON = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
# The published config.json of mistralai/Mixtral-8x7B-v0.1.
MIXTRAL_8X7B_CONFIG_JSON = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1e6, "router_aux_loss_coef": 0.02,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 32000,
}


def _param_count(config, head="lm"):
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0), head))
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(shapes))


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAM_COUNTS))
def test_preset_parameter_count_matches_release(name):
    assert _param_count(PRESETS[name]) == PUBLISHED_PARAM_COUNTS[name]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_tensor_shapes_match_transformers(name):
    config = PRESETS[name]
    hf_config = transformers.AutoConfig.for_model(**config.to_hf())
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    hf_shapes = _as_saved(model.state_dict(), config)
    if config.tie_word_embeddings:
        hf_shapes.pop("lm_head.weight")
    ours = {}
    for spec in tensor_specs(config):
        ours.update({spec.name(index): spec.hf_shape for index in spec.indices(config.num_layers)})
    assert ours == hf_shapes


def _as_saved(state_dict, config) -> dict:
    """The tensors' names and shapes as transformers writes them to files: in memory,
    transformers 5 holds each MoE layer's experts as two fused tensors (`gate_up_proj`
    `[E, 2F, D]`, `down_proj` `[E, D, F]`) and Mixtral's block under `mlp`; its files
    hold one tensor per expert and projection."""
    names = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2")}.get(
        config.family, ("mlp", "gate_proj", "up_proj", "down_proj"))
    block, gate, up, down = names
    shapes = {}
    for key, value in state_dict.items():
        key, shape = key.replace(".mlp.", f".{block}."), tuple(value.shape)
        fused = re.fullmatch(rf"(model\.layers\.\d+\.{block}\.experts)\.(gate_up_proj|down_proj)",
                             key)
        if not fused:
            shapes[key] = shape
            continue
        prefix, which = fused.groups()
        for e in range(shape[0]):
            if which == "down_proj":
                shapes[f"{prefix}.{e}.{down}.weight"] = shape[1:]
            else:
                for name in (gate, up):
                    shapes[f"{prefix}.{e}.{name}.weight"] = (shape[1] // 2, shape[2])
    return shapes


def test_from_hf_reads_published_configs():
    assert ModelConfig.from_hf(LLAMA_3_2_1B_CONFIG_JSON) == PRESETS["llama-3.2-1b"]
    qwen3 = ModelConfig.from_hf(QWEN3_0_6B_CONFIG_JSON)
    assert qwen3 == PRESETS["qwen3-0.6b"]
    assert (qwen3.head_dim, qwen3.qk_norm, qwen3.qkv_bias) == (128, True, False)
    assert ModelConfig.from_hf(QWEN3_30B_A3B_CONFIG_JSON) == PRESETS["qwen3-30b-a3b"]
    assert ModelConfig.from_hf(MIXTRAL_8X7B_CONFIG_JSON) == PRESETS["mixtral-8x7b"]


def test_from_hf_reads_transformers5_rope_parameters():
    config_json = dict(LLAMA_3_2_1B_CONFIG_JSON)
    rope = dict(config_json.pop("rope_scaling"), rope_theta=config_json.pop("rope_theta"))
    config = ModelConfig.from_hf({**config_json, "rope_parameters": rope})
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)


def test_config_is_hashable_and_validates():
    config = ModelConfig.preset("tiny", remat="full")
    assert hash(config) == hash(dataclasses.replace(config))
    with pytest.raises(ValueError, match="remat='some'.*'none', 'full', 'dots_saveable'"):
        ModelConfig.preset("tiny", remat="some")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig.preset("tiny", num_kv_heads=3)
    with pytest.raises(ValueError, match="unknown model preset 'gpt2'"):
        ModelConfig.preset("gpt2")


@pytest.mark.parametrize("head", ["lm", "value", "score"])
def test_logical_axes_cover_every_parameter(head):
    config = ModelConfig.preset("tiny", tie_word_embeddings=False, qk_norm=True)
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0), head))
    specs = param_logical_axes(config, head)
    assert jax.tree.structure(shapes) == jax.tree.structure(
        specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
    )
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    for shape, spec in zip(jax.tree.leaves(shapes), flat_specs, strict=True):
        assert len(spec) == len(shape.shape)
        assert set(spec) <= LOGICAL_AXIS_NAMES
    assert specs["layers"]["attn"]["q_proj"]["kernel"] == jax.sharding.PartitionSpec(
        "layers", "embed", "heads", "head_dim"
    )


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig.preset("tiny")
    params = init_params(config, jax.random.key(0))
    mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], jnp.int32)
    tokens = jnp.array([[0, 0, 5, 6, 7], [9, 8, 7, 6, 5]], jnp.int32)
    return config, params, tokens, mask


def _loss(params, tokens, mask, config):
    hidden, _ = forward(params, tokens, positions_from_mask(mask), mask, config=config)
    logits = unembed(params, hidden)
    return jnp.sum(jax.nn.log_softmax(logits)[..., 3] * mask)


# Module-level jits, so each (function, config) pair compiles once for the whole file.
_grad = jax.jit(jax.grad(_loss), static_argnames="config")
_forward = jax.jit(forward, static_argnames="config")


@pytest.mark.parametrize("remat,unroll", [("full", False), ("dots_saveable", False),
                                          ("none", True), ("full", True),
                                          ("dots_saveable", True)])
def test_remat_and_unrolling_give_the_same_gradients(tiny, remat, unroll):
    config, params, tokens, mask = tiny
    expected = _grad(params, tokens, mask, config)
    actual = _grad(params, tokens, mask,
                   dataclasses.replace(config, remat=remat, scan_unroll=unroll))
    # On a GPU the unrolled layers fuse differently and sum in another order: float32
    # roundings of up to ~1.3e-6 on gradients of ~0.02.
    atol = 1e-6 if jax.default_backend() == "cpu" else 3e-6
    chex.assert_trees_all_close(actual, expected, atol=atol, rtol=1e-5)
    chex.assert_tree_all_finite(actual)


def test_unrolled_layers_lower_without_a_loop(tiny):
    config, params, tokens, mask = tiny
    for unroll in (False, True):
        c = dataclasses.replace(config, remat="dots_saveable", scan_unroll=unroll)
        hlo = _grad.lower(params, tokens, mask, c).as_text()
        assert ("stablehlo.while" in hlo) != unroll, f"scan_unroll={unroll}"


def test_swiglu_gradient_is_the_plain_formulas():
    """`swiglu`'s own backward (from `gate_up` alone) against autodiff of silu(g) * u."""
    gate_up = jax.random.normal(jax.random.key(1), (3, 5, 2, 7)) * 3
    d_out = jax.random.normal(jax.random.key(2), (3, 5, 7))
    plain = lambda gu: jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :]  # noqa: E731
    out, vjp = jax.vjp(swiglu, gate_up)
    expected_out, expected_vjp = jax.vjp(plain, gate_up)
    chex.assert_trees_all_close(out, expected_out, rtol=1e-6)
    chex.assert_trees_all_close(vjp(d_out), expected_vjp(d_out), atol=1e-6, rtol=1e-5)


def test_geglu_gradient_is_the_plain_formulas():
    """`geglu`'s own backward (from `gate_up` alone) against autodiff of gelu_tanh(g) * u."""
    gate_up = jax.random.normal(jax.random.key(1), (3, 5, 2, 7)) * 3
    d_out = jax.random.normal(jax.random.key(2), (3, 5, 7))
    plain = lambda gu: jax.nn.gelu(gu[..., 0, :], approximate=True) * gu[..., 1, :]  # noqa: E731
    out, vjp = jax.vjp(geglu, gate_up)
    expected_out, expected_vjp = jax.vjp(plain, gate_up)
    chex.assert_trees_all_close(out, expected_out, rtol=1e-6)
    # Far below zero, (1 + tanh) cancels in float32: both are ~4e-6 off the float64 values.
    chex.assert_trees_all_close(vjp(d_out), expected_vjp(d_out), atol=1e-5, rtol=1e-5)


def _gemma_with_qk_norm():
    return dataclasses.replace(PRESETS["tiny-gemma"], qk_norm=True)


def test_gemma_rolled_layers_give_the_unrolled_gradients(tiny):
    """Gemma's GeGLU and q/k norms recomputed in the backward pass (a rolled scan, no
    remat) give autodiff's gradients (the unrolled layers, which recompute nothing)."""
    _, _, tokens, mask = tiny
    config = _gemma_with_qk_norm()
    params = init_params(config, jax.random.key(0))
    rolled = _grad(params, tokens, mask, config)
    unrolled = _grad(params, tokens, mask, dataclasses.replace(config, scan_unroll=True))
    # float32 roundings of up to ~5e-6 on gradients of ~0.1 (~4e-6 when both autodiffed).
    chex.assert_trees_all_close(rolled, unrolled, atol=2e-5, rtol=1e-4)
    chex.assert_tree_all_finite(rolled)


def test_gemma_rolled_layers_keep_only_gate_up(tiny, monkeypatch, capsys):
    """In a rolled scan with no remat, Gemma's MLP keeps one stacked `[L, B, T, 2, F]`
    buffer of gate and up for the backward pass, as SwiGLU's does, and its q/k norms no
    float32 copy of q and k; autodiff of the two matmuls and the tanh GELU (forced
    here by turning both paths off) keeps at least six `[L, B, T, F]` stacks."""
    _, _, tokens, mask = tiny
    config = dataclasses.replace(_gemma_with_qk_norm(), dtype="bfloat16")
    params = init_params(config, jax.random.key(0))
    lbt = f"{config.num_layers},{tokens.shape[0]},{tokens.shape[1]}"
    f = config.intermediate_size

    def stacked_residuals():
        jax.ad_checkpoint.print_saved_residuals(
            lambda p: _loss(p, tokens, mask, config), params)
        return [line.split()[0] for line in capsys.readouterr().out.splitlines()
                if line.split()[0].split("[")[-1].startswith(lbt + ",")]

    kept = stacked_residuals()
    assert [s for s in kept if s.endswith(f",{f}]")] == [f"bf16[{lbt},2,{f}]"]
    heads = f"[{lbt},{config.num_heads},{config.head_dim}]"
    assert "f32" + heads not in kept, "q_norm was expected to keep no float32 q"
    monkeypatch.setattr(transformer, "_joins_gate_up", lambda module, config: False)
    monkeypatch.setattr(transformer, "_recomputes_in_backward", lambda config: False)
    kept = stacked_residuals()
    assert len([s for s in kept if s == f"bf16[{lbt},{f}]"]) >= 6
    assert "f32" + heads in kept


def _zero_fill_copies(hlo: str, last_dim: int) -> list[str]:
    """Instructions of an optimized HLO module that copy a broadcast (a zero fill) into a
    buffer of rank 4 whose last dimension is `last_dim`."""
    defs = dict(re.findall(r"^\s*(?:ROOT )?(%[\w.-]+) = (.*)$", hlo, re.MULTILINE))
    return [f"{name} = {rhs[:80]}" for name, rhs in defs.items()
            if re.match(rf"\w+\[\d+,\d+,\d+,{last_dim}\]", rhs)
            and (m := re.search(r" copy\((%[\w.-]+)\)", rhs))
            and "broadcast" in defs.get(m.group(1), "")]


def test_rolled_layers_stack_one_buffer_for_gate_and_up(tiny, monkeypatch):
    """In a rolled scan the MLP's gate and up are one matmul whose output alone is kept
    for the backward pass: no equal-shaped stacks of MLP-wide values that XLA fills
    once and copies into each (as with the two matmuls, which the test also checks),
    and no stack of the hidden values (as where down_proj has an adapter)."""
    config, _, tokens, mask = tiny
    config = dataclasses.replace(config, dtype="bfloat16", intermediate_size=80)
    params = init_params(config, jax.random.key(0))

    def hlo():
        grad = jax.jit(jax.grad(lambda p: _loss(p, tokens, mask, config)))
        return grad.lower(params).compile().as_text()

    def copies():
        return _zero_fill_copies(hlo(), 80)

    assert copies() == []
    # Nor a stack of the hidden values `silu(gate) * up` (`_swiglu_down` recomputes them).
    hidden_stack = rf"\[{config.num_layers},{tokens.shape[0]},{tokens.shape[1]},80\]"
    assert not re.search(hidden_stack, hlo())
    with_hidden = dataclasses.replace(config, lora_rank=2, lora_targets=("down_proj",))
    lora_params = init_params(with_hidden, jax.random.key(0))
    grad = jax.jit(jax.grad(lambda p: _loss(p, tokens, mask, with_hidden)))
    assert re.search(hidden_stack, grad.lower(lora_params).compile().as_text()), \
        "an adapted down_proj was expected to keep its input's stack"
    monkeypatch.setattr(transformer, "_joins_gate_up", lambda module, config: False)
    assert copies(), "the two matmuls' stacks were expected to be filled and copied"


def test_rolled_layers_keep_only_the_norms_input(tiny, monkeypatch, capsys):
    """In a rolled scan with no remat the two norms recompute their values from their
    input in the backward pass: the residuals stacked over layers hold no float32
    `[L, B, T, D]` array (autodiff of the norm keeps its input in float32 otherwise,
    as the test also checks)."""
    config, _, tokens, mask = tiny
    config = dataclasses.replace(config, dtype="bfloat16")
    params = init_params(config, jax.random.key(0))
    shape = f"[{config.num_layers},{tokens.shape[0]},{tokens.shape[1]},{config.hidden_size}]"

    def stacked_residuals():
        jax.ad_checkpoint.print_saved_residuals(
            lambda p: _loss(p, tokens, mask, config), params)
        return [line.split()[0] for line in capsys.readouterr().out.splitlines()
                if line.split()[0].endswith(shape)]

    assert sorted(stacked_residuals()) == ["bf16" + shape] * 4  # x, x2 and the norms' outputs
    monkeypatch.setattr(transformer, "_recomputes_in_backward", lambda config: False)
    assert "f32" + shape in stacked_residuals(), "the norms' float32 input was expected"


@pytest.mark.parametrize("num_tokens", [1, 5])  # a decode step, a prefill
def test_a_forward_with_a_cache_traces_one_layer_for_all(num_tokens):
    """The layers of a forward with a cache are L calls of one jitted layer, traced
    once (the sampler traces a decode step per decode bucket, 24+ layers each)."""
    config = dataclasses.replace(PRESETS["tiny"], num_layers=3)
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    cache = jax.eval_shape(lambda: init_cache(config, 2, 8))
    tokens = jnp.zeros((2, num_tokens), jnp.int32)
    jaxpr = jax.make_jaxpr(functools.partial(forward, config=config))(
        params, tokens, tokens, jnp.ones((2, 8), jnp.int32), cache, 2)
    calls = [e for e in jaxpr.jaxpr.eqns if e.primitive.name in ("jit", "pjit")
             and e.params["name"] == "apply_layer"]
    assert len(calls) == config.num_layers
    assert len({id(e.params["jaxpr"]) for e in calls}) == 1  # one trace


def test_unrolled_config_initialises_the_same_parameters(tiny, xla_default_emitters):
    """`init_params` builds with the scan rolled (the unrolled init only compiles
    slower); the parameters are those of the model's own unrolled init, bit for bit."""
    config = dataclasses.replace(tiny[0], scan_unroll=True)
    key = jax.random.key(7)
    ones = jnp.ones((1, 1), jnp.int32)
    unrolled = nn.meta.unbox(Transformer(config, "lm").init(key, ones * 0, ones * 0, ones))
    chex.assert_trees_all_equal(init_params(config, key), unrolled["params"])


def test_bfloat16_compute_keeps_float32_logits(tiny):
    config, params, tokens, mask = tiny
    bf16 = dataclasses.replace(config, dtype="bfloat16")
    hidden, _ = _forward(params, tokens, positions_from_mask(mask), mask, config=bf16)
    hidden32, _ = _forward(params, tokens, positions_from_mask(mask), mask, config=config)
    chex.assert_type(hidden, jnp.bfloat16)
    logits, logits32 = unembed(params, hidden), unembed(params, hidden32)
    chex.assert_type(logits, jnp.float32)
    chex.assert_shape(logits, (2, 5, config.vocab_size))
    np.testing.assert_allclose(logits, logits32, atol=5e-2)


def test_unembed_tied_equals_explicit_head(tiny):
    config, params, tokens, mask = tiny
    hidden, _ = _forward(params, tokens, positions_from_mask(mask), mask, config=config)
    untied = {**params, "lm_head": {"kernel": params["embed"]["embedding"].T}}
    np.testing.assert_allclose(unembed(untied, hidden), unembed(params, hidden), atol=1e-6)
    expected = np.einsum("btd,vd->btv", hidden, params["embed"]["embedding"])
    np.testing.assert_allclose(unembed(params, hidden), expected, rtol=1e-5, atol=1e-6)


def test_critic_init_copies_backbone_and_adds_value_head(tiny):
    config, params, tokens, mask = tiny
    critic = init_critic_params(params, jax.random.key(3))
    reference = jax.eval_shape(lambda: init_params(config, jax.random.key(0), "value"))
    chex.assert_trees_all_equal_shapes_and_dtypes(critic, reference)
    backbone = {key: params[key] for key in ("embed", "layers", "final_norm")}
    chex.assert_trees_all_equal({k: critic[k] for k in backbone}, backbone)
    # Fresh buffers: donating the actor's params must not delete the critic's.
    actor_leaf = params["embed"]["embedding"]
    critic_leaf = critic["embed"]["embedding"]
    assert actor_leaf.unsafe_buffer_pointer() != critic_leaf.unsafe_buffer_pointer()

    hidden, _ = _forward(critic, tokens, positions_from_mask(mask), mask, config=config)
    critic_values = jax.jit(values)(critic, hidden)
    chex.assert_shape(critic_values, (2, 5))
    expected = hidden @ critic["value_head"]["kernel"][:, 0] + critic["value_head"]["bias"][0]
    np.testing.assert_allclose(critic_values, expected, rtol=1e-5, atol=1e-6)


def test_attention_impl_choice():
    config = ModelConfig.preset("tiny")
    assert _attention_impl(config, jnp.float32, 8, 8) == "xla"
    assert _attention_impl(config, jnp.bfloat16, 7, 8) == "xla"  # odd T: no cuDNN backward
    expected = "cudnn" if jax.default_backend() == "gpu" else "xla"
    assert _attention_impl(config, jnp.bfloat16, 8, 8) == expected
    forced = dataclasses.replace(config, attention_impl="xla")
    assert _attention_impl(forced, jnp.bfloat16, 8, 8) == "xla"


def test_forward_argument_errors(tiny):
    config, params, tokens, mask = tiny
    positions = positions_from_mask(mask)
    run = functools.partial(forward, params, tokens, positions, config=config)
    with pytest.raises(ValueError, match=r"mask must be \[B, T\] over tokens, i.e. \(2, 5\)"):
        run(mask[:, :4])
    with pytest.raises(ValueError, match="write_index is only meaningful with a cache"):
        run(mask, None, 0)


def test_params_are_plain_arrays(tiny):
    _, params, _, _ = tiny
    assert not any(isinstance(leaf, nn.meta.AxisMetadata) for leaf in jax.tree.leaves(
        params, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata)))
