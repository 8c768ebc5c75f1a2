"""Tiny random transformers checkpoints and a ragged left-padded batch, built once per session.

References come from transformers (PyTorch, CPU), never from jrl itself.
"""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jrl.models import ModelConfig, init_params, save_pretrained

VOCAB = 128
PAD = 0

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    # Larger than HF's 0.02 so that logits are far from uniform and argmax is stable.
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=PAD,
)
_LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)

# name -> (config class, model class, config kwargs on top of _COMMON)
HF_CASES = {
    "llama_tied_llama3_rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(tie_word_embeddings=True, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE),
    ),
    "llama_untied": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(tie_word_embeddings=False),
    ),
    "qwen2_tied": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(tie_word_embeddings=True, rope_theta=1e6),
    ),
    "qwen2_untied": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(tie_word_embeddings=False),
    ),
    # head_dim 32 != hidden 64 / 4 heads, as in the real Qwen3 checkpoints.
    "qwen3_tied": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(tie_word_embeddings=True, head_dim=32),
    ),
    "qwen3_untied": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(tie_word_embeddings=False, head_dim=32),
    ),
    # Mixture-of-experts: 8 experts, 2 a token, renormalised (as Qwen3-30B-A3B) or not
    # (transformers' default); Mixtral always renormalises.
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(tie_word_embeddings=False, head_dim=32, num_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=48, norm_topk_prob=True),
    ),
    "qwen3_moe_unnormalised": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(tie_word_embeddings=True, num_experts=4, num_experts_per_tok=3,
             moe_intermediate_size=32, norm_topk_prob=False),
    ),
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        dict(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
             intermediate_size=40),
    ),
    "qwen2_reward": (
        transformers.Qwen2Config,
        transformers.Qwen2ForSequenceClassification,
        dict(num_labels=1),
    ),
}


def build_hf_model(name: str, seed: int = 0) -> torch.nn.Module:
    config_cls, model_cls, kwargs = HF_CASES[name]
    torch.manual_seed(seed)
    config = config_cls(**{**_COMMON, **kwargs})
    return model_cls(config).eval()


def saved_checkpoints(tmp_path_factory, build):
    """`get(name) -> (directory, torch model)`: `build(name)` saved once per name."""
    built = {}

    def get(name):
        if name not in built:
            model = build(name)
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            built[name] = (path, model)
        return built[name]

    return get


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """`get(name) -> (directory, torch model)`: a saved random checkpoint per case."""
    return saved_checkpoints(tmp_path_factory, build_hf_model)


@pytest.fixture(scope="session")
def ragged_batch():
    """Left-padded prompts of lengths 9, 5, 1 (T = 9): tokens, mask, positions (numpy)."""
    lengths = np.array([9, 5, 1])
    num_tokens = 9
    mask = (np.arange(num_tokens)[None] >= num_tokens - lengths[:, None]).astype(np.int32)
    rng = np.random.default_rng(0)
    # Real tokens avoid pad/bos/eos, so HF's pad-id-based reward readout agrees with the mask.
    tokens = (rng.integers(3, VOCAB, mask.shape) * mask).astype(np.int32)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return dict(tokens=tokens, mask=mask, positions=positions)


@pytest.fixture(scope="session")
def torch_forward():
    """`run(model, batch) -> numpy logits` with left-padding-consistent position_ids."""

    def run(model, batch):
        with torch.no_grad():
            out = model(
                input_ids=torch.as_tensor(batch["tokens"], dtype=torch.long),
                attention_mask=torch.as_tensor(batch["mask"], dtype=torch.long),
                position_ids=torch.as_tensor(batch["positions"], dtype=torch.long),
            )
        return out.logits.float().numpy()

    return run


@pytest.fixture(scope="session")
def random_params():
    """`make(config, seed, head) -> params`: N(0, 0.2) leaves in jrl's layout.

    Cheaper than `init_params` (no XLA compilation of the initialisers), and the
    norm scales are random too, which makes layout mistakes visible.
    """

    def make(config, seed=0, head="lm"):
        shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0), head))
        rng = np.random.default_rng(seed)
        return jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.2, s.shape), s.dtype), shapes)

    return make


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, random_params):
    """A valid tiny untied checkpoint; tests copy it (`broken`) and break the copy."""
    config = ModelConfig.preset("tiny", tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("valid")
    save_pretrained(path, config, random_params(config))
    return path


@pytest.fixture
def broken(checkpoint, tmp_path):
    """A copy of `checkpoint` to break."""
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint, path)
    return path
