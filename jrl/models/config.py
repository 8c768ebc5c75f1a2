"""Model configuration: one frozen dataclass for the Llama 3 / Qwen2 / Qwen2.5 / Qwen3 and
Gemma 2 / Gemma 3 (text) families, and the mixture-of-experts Qwen3-MoE and Mixtral.

`ModelConfig` is hashable, so it can be a static argument of `jax.jit`. It is built
from a Hugging Face `config.json` dict (`ModelConfig.from_hf`), from a named preset
(`ModelConfig.preset`), or directly. Run-time options (parameter and compute dtypes,
rematerialisation, attention kernel) live in the same dataclass; change them with
`dataclasses.replace(config, dtype="bfloat16", remat="full")`.

The three families differ only in a few switches:

| family | q/k/v bias | per-head q/k RMSNorm | rope scaling       |
| ------ | ---------- | -------------------- | ------------------ |
| llama  | no         | no                   | optional "llama3"  |
| qwen2  | yes        | no                   | none               |
| qwen3  | no         | yes                  | none               |
| gemma2 | no         | no                   | none               |
| gemma3 | no         | yes                  | optional "linear"  |

Gemma adds more switches (soft-capping, sliding-window layers, sandwich norms, GeGLU,
scaled embeddings): `jrl.models.gemma` describes them. The MoE families are Qwen3's
and Llama's layers with the MLP replaced by `num_experts` SwiGLU experts of width
`moe_intermediate_size`, `num_experts_per_tok` of them per token (`jrl.models.moe`):
`qwen3_moe` has Qwen3's attention, `mixtral` Llama's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jrl.errors import ConfigError
from jrl.kernels import mosaic_backend
from jrl.models import gemma

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", *gemma.FAMILIES)
MOE_FAMILIES = ("qwen3_moe", "mixtral")
DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("none", "full", "dots_saveable")
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "splash")
DECODE_ATTENTION_IMPLS = ("auto", "xla", "mosaic")
LOGPROB_IMPLS = ("auto", "xla", "mosaic")
DECODE_HEAD_IMPLS = ("auto", "xla", "mosaic")
# Projections that can carry a LoRA adapter ("all-linear" is all of them).
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_ROLLOUTS = ("merged", "unmerged")

# HF class name -> (family, head). The head says which output layer the checkpoint has.
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "lm"),
    "Qwen2ForCausalLM": ("qwen2", "lm"),
    "Qwen3ForCausalLM": ("qwen3", "lm"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "lm"),
    "MixtralForCausalLM": ("mixtral", "lm"),
    "LlamaForSequenceClassification": ("llama", "score"),
    "Qwen2ForSequenceClassification": ("qwen2", "score"),
    "Qwen3ForSequenceClassification": ("qwen3", "score"),
    "Gemma2ForCausalLM": ("gemma2", "lm"),
    "Gemma3ForCausalLM": ("gemma3", "lm"),
}
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
                "mixtral": "mixtral", "gemma2": "gemma2", "gemma3_text": "gemma3"}
# model_type -> family above; the family's model_type on save here.
_FAMILY_MODEL_TYPES = {family: model_type for model_type, family in _MODEL_TYPES.items()}
_HF_CLASS_PREFIX = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3",
                    "qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral", "gemma2": "Gemma2",
                    "gemma3": "Gemma3"}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3 frequency-dependent RoPE scaling (`rope_type: "llama3"`).

    Wavelengths longer than `original_max_position_embeddings / low_freq_factor` are
    divided by `factor`, those shorter than `.../high_freq_factor` are kept, and the
    band in between is interpolated smoothly (Llama 3.1 report, section 3.3).
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class LinearRopeScaling:
    """Linear RoPE scaling (`rope_type: "linear"`): every rotation speed divided by
    `factor` (Gemma 3's global layers, factor 8 in the 4B and 12B)."""

    factor: float


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture and run-time options of a decoder-only transformer.

    Attributes:
      family: "llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma2" or "gemma3"
        (picks the HF class names on save; the Gemma families bring the layer of
        `jrl.models.gemma`).
      vocab_size: V, rows of the token embedding.
      hidden_size: D, width of the residual stream.
      intermediate_size: F, width of the SwiGLU (Gemma: GeGLU) MLP (MoE families: the
        checkpoint's dense width, kept for save; the experts' is `moe_intermediate_size`).
      num_layers: L, decoder layers.
      num_heads: N, query heads.
      num_kv_heads: K, key/value heads (grouped-query attention; N % K == 0).
      head_dim: H, per-head width (Qwen3 has H != D / N).
      rope_theta: RoPE base.
      rope_scaling: Llama 3 scaling, linear scaling (Gemma 3's global layers), or None
        for plain RoPE.
      rms_norm_eps: epsilon of every RMSNorm.
      tie_word_embeddings: the LM head is the transposed token embedding.
      qkv_bias: q/k/v projections have a bias (Qwen2).
      qk_norm: per-head RMSNorm on queries and keys before RoPE (Qwen3, Qwen3-MoE).
      num_experts: E, the experts of each MoE layer (0: a dense model).
      num_experts_per_tok: k, the experts each token is routed to.
      moe_intermediate_size: width of each expert's SwiGLU MLP.
      norm_topk_prob: divide the k routing weights by their sum (Mixtral always does).
      router_aux_loss_coef: the checkpoint's load-balancing loss coefficient (the
        default of `actor.router_aux_loss_coef`; written back on save).
      max_position_embeddings: longest context the checkpoint was trained for.
      attn_logit_softcapping: Gemma 2: attention scores become `cap * tanh(s / cap)`
        before the mask (None: not capped).
      final_logit_softcapping: Gemma: the LM logits are capped the same way, before any
        temperature or log-softmax (None: not capped).
      query_pre_attn_scalar: Gemma: scores are scaled by its `** -0.5` instead of
        `head_dim ** -0.5` (None: head_dim).
      sliding_window: Gemma: a sliding layer's query sees the keys fewer than this many
        tokens behind it (and itself).
      layer_types: Gemma: "full_attention" or "sliding_attention" per layer (HF's
        `layer_types`); () for all full.
      rope_local_base_freq: Gemma 3: the RoPE base of the sliding layers, which never
        scale it (None: they use the global layers' RoPE).
      bos_token_id, eos_token_ids, pad_token_id: from config.json, kept for save.
      initializer_range: stddev of the normal init of fresh kernels.
      param_dtype: dtype parameters are stored in.
      dtype: compute dtype of activations and matmuls (logits are always returned
        in float32 by `unembed`).
      remat: "none", "full" (recompute each layer in the backward pass) or
        "dots_saveable" (keep matmul outputs, recompute the rest).
      attention_impl: training attention: "auto" (on GPU cuDNN flash attention when
        dtype and head_dim allow it and there is no attention soft-cap; on TPU Pallas
        splash attention for rows of a multiple of 128 tokens and head_dim a multiple
        of 128; else XLA), "xla", "cudnn" or "splash" (`jrl.kernels.packed_attention`;
        off a TPU it runs in Pallas' interpret mode, for tests).
      decode_attention_impl: cache write and attention of decode steps (one token
        per row over a cache): "auto" (the Pallas kernel of
        `jrl.kernels.decode_attention`, on Pallas' Mosaic GPU backend, on Hopper GPUs
        where it applies; else XLA), "xla" or "mosaic" (the kernel, forced, for Hopper
        GPUs and a bfloat16 or float16 cache; a ConfigError where jax lacks Pallas'
        Mosaic GPU backend).
      logprob_impl: the unembedding and log-softmax of the log-prob passes: "auto"
        (the Pallas kernel of `jrl.kernels.logprob_head`, on Pallas' Mosaic GPU backend,
        on Hopper GPUs for hidden sizes up to 2,048; else XLA), "xla" (chunked float32
        logits) or "mosaic" (the kernel, forced; a ConfigError where jax lacks Mosaic
        GPU).
      decode_head_impl: the sampler's unembedding and draw at each decode step: "auto"
        (the Pallas kernel of `jrl.kernels.logprob_head.block_masses`, which keeps the
        logits on chip, on Hopper GPUs for hidden sizes up to 2,048, where the draw is
        temperature sampling: no top-k, top-p or greedy decoding; else XLA, which writes
        the step's float32 logits and reads them back), "xla" or "mosaic" (the kernel,
        forced, for the temperature draws; a ConfigError where jax lacks Mosaic GPU; the
        other draws take XLA's head, `sampler.head_impl`).
      lora_rank: rank r of the LoRA adapters (0: none). Each targeted projection
        `W` computes `x W + (x A) B * lora_alpha / r` (Hu et al. 2021), with A
        `[in, r]` and B `[r, out]` stored next to it as `<name>_lora/{a, b}`.
      lora_alpha: the LoRA scale's numerator.
      lora_targets: projections that get adapters, from `LORA_MODULES`; a tuple,
        a comma-separated string or "all-linear" (the default when r > 0).
      lora_rollout: how the sampler applies the adapters: "merged" (`W + A B` formed
        once per rollout: faster decoding, but a second copy of the targeted kernels
        while it runs) or "unmerged" (`x W + (x A) B` at every projection of every
        decode step; no extra copy).
      fuse_decode_projections: the sampler runs each layer's q/k/v projections as one
        matmul and gate/up as one (`transformer.fuse_projections`, weights joined once
        per rollout; not under tensor parallelism, which splits the heads).
      scan_unroll: unroll the scan over layers (the forward without a cache) into
        straight-line code: no `[L, ...]` buffers zero-filled per call for what the
        layers save for the backward pass and for their gradients, at the price of
        longer compilation. With remat "dots_saveable", XLA may then share the backward's
        recomputation (the attention) with the forward: faster, more memory held;
        under "full" it may not. (`step.forward`'s passes, which take no gradient,
        keep the scan rolled; the forward with a cache, prefill and decode, applies
        the layers one by one whatever this says.)
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | LinearRopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.0
    max_position_embeddings: int = 32768
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    rope_local_base_freq: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    initializer_range: float = 0.02
    param_dtype: str = "float32"
    dtype: str = "float32"
    remat: str = "none"
    attention_impl: str = "auto"
    decode_attention_impl: str = "auto"
    logprob_impl: str = "auto"
    decode_head_impl: str = "auto"
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ()
    lora_rollout: str = "merged"
    fuse_decode_projections: bool = True
    scan_unroll: bool = False

    def __post_init__(self):
        _check_choice("family", self.family, FAMILIES)
        for name in ("param_dtype", "dtype"):
            # Dtype objects (jnp.bfloat16) become their names, keeping the config hashable
            # and printable.
            value = getattr(self, name)
            object.__setattr__(self, name, getattr(value, "__name__", None) or str(value))
            _check_choice(name, getattr(self, name), DTYPES)
        _check_choice("remat", self.remat, REMAT_POLICIES)
        _check_choice("attention_impl", self.attention_impl, ATTENTION_IMPLS)
        _check_choice("decode_attention_impl", self.decode_attention_impl,
                      DECODE_ATTENTION_IMPLS)
        _check_choice("logprob_impl", self.logprob_impl, LOGPROB_IMPLS)
        _check_choice("decode_head_impl", self.decode_head_impl, DECODE_HEAD_IMPLS)
        for key in ("decode_attention_impl", "logprob_impl", "decode_head_impl"):
            if getattr(self, key) == "mosaic":
                mosaic_backend.require(f"model.{key}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        self._check_experts()
        # Lists from JSON would make the config unhashable.
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ConfigError(f"lora_rank must be an integer >= 0 (0: no adapters), got "
                              f"{self.lora_rank!r}")
        if self.lora_rank and not self.lora_alpha > 0:
            raise ConfigError(f"lora_alpha must be > 0, got {self.lora_alpha!r}")
        _check_choice("lora_rollout", self.lora_rollout, LORA_ROLLOUTS)
        targets = lora_targets(self.lora_targets or "all-linear") if self.lora_rank else ()
        object.__setattr__(self, "lora_targets", targets)
        for name, value in gemma.check(self).items():
            object.__setattr__(self, name, value)

    @property
    def is_moe(self) -> bool:
        return self.family in MOE_FAMILIES

    def _check_experts(self) -> None:
        if not self.is_moe:
            if self.num_experts:
                raise ConfigError(f"num_experts={self.num_experts} needs an MoE family "
                                  f"({', '.join(MOE_FAMILIES)}); family is {self.family!r}")
            return
        e, k = self.num_experts, self.num_experts_per_tok
        if not (isinstance(e, int) and e >= 1 and isinstance(k, int) and 1 <= k <= e):
            raise ConfigError(f"an MoE model needs num_experts >= 1 and 1 <= "
                              f"num_experts_per_tok <= num_experts; got {e} and {k}")
        if self.moe_intermediate_size < 1:
            raise ConfigError("an MoE model needs moe_intermediate_size >= 1, got "
                              f"{self.moe_intermediate_size}")
        if self.family == "mixtral" and not self.norm_topk_prob:
            raise ConfigError("mixtral renormalises its top-k routing weights; "
                              "norm_topk_prob must be true")

    @classmethod
    def from_hf(cls, hf_config: Mapping[str, Any], **overrides) -> ModelConfig:
        """Builds a config from a Hugging Face `config.json` dict.

        Reads both the transformers 4 keys (`rope_theta`, `rope_scaling`) and the
        transformers 5 key (`rope_parameters`).

        Args:
          hf_config: the parsed `config.json`.
          **overrides: fields to set on top (e.g. `dtype="bfloat16"`).

        Raises:
          ValueError: unsupported architecture, model_type, activation, rope type
            or attention variant; the message names it and lists what is supported.
        """
        family, _ = hf_family_and_head(hf_config)
        if family in gemma.FAMILIES:
            return cls._from_hf_gemma(hf_config, **overrides)
        _check_hf_features(hf_config, family)
        heads = hf_config["num_attention_heads"]
        default_head_dim = 128 if family == "qwen3" else hf_config["hidden_size"] // heads
        kwargs = dict(
            family=family,
            vocab_size=hf_config["vocab_size"],
            hidden_size=hf_config["hidden_size"],
            intermediate_size=hf_config["intermediate_size"],
            num_layers=hf_config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf_config.get("num_key_value_heads") or heads,
            head_dim=hf_config.get("head_dim") or default_head_dim,
            rope_theta=float(_rope_theta(hf_config)),
            rope_scaling=_rope_scaling(hf_config),
            rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2",
            qk_norm=family in ("qwen3", "qwen3_moe"),
            max_position_embeddings=hf_config.get("max_position_embeddings", 32768),
            bos_token_id=hf_config.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(hf_config.get("eos_token_id")),
            pad_token_id=hf_config.get("pad_token_id"),
            initializer_range=hf_config.get("initializer_range", 0.02),
        )
        if family in MOE_FAMILIES:
            kwargs.update(_hf_experts(hf_config, family))
        kwargs.update(overrides)
        return cls(**kwargs)

    @classmethod
    def _from_hf_gemma(cls, hf_config: Mapping[str, Any], **overrides) -> ModelConfig:
        for key in ("attention_bias", "mlp_bias"):
            if hf_config.get(key):
                raise ConfigError(f"config.json sets {key}=true, which jrl does not support")
        heads = hf_config["num_attention_heads"]
        fields = gemma.hf_fields(hf_config)
        factor = fields.pop("linear_rope_factor")
        kwargs = dict(
            rope_scaling=None if factor is None else LinearRopeScaling(factor),
            vocab_size=hf_config["vocab_size"],
            hidden_size=hf_config["hidden_size"],
            intermediate_size=hf_config["intermediate_size"],
            num_layers=hf_config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf_config.get("num_key_value_heads") or heads,
            head_dim=hf_config.get("head_dim") or 256,  # HF's default for both families
            rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
            qk_norm=hf_config.get("model_type") != "gemma2",
            # HF's defaults: 8,192 (Gemma 2), 131,072 (Gemma 3).
            max_position_embeddings=hf_config.get("max_position_embeddings", 8192 if
                                                  hf_config.get("model_type") == "gemma2"
                                                  else 131072),
            bos_token_id=hf_config.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(hf_config.get("eos_token_id")),
            pad_token_id=hf_config.get("pad_token_id"),
            initializer_range=hf_config.get("initializer_range", 0.02),
            **fields,
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_hf(self, head: str = "lm") -> dict[str, Any]:
        """The `config.json` dict that transformers (4.45+ and 5.x) loads.

        Args:
          head: "lm" for `*ForCausalLM`, "score" for `*ForSequenceClassification`
            with one label.
        """
        _check_choice("head", head, ("lm", "score"))
        suffix = "ForCausalLM" if head == "lm" else "ForSequenceClassification"
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if isinstance(self.rope_scaling, RopeScaling):
            rope_parameters.update(rope_type="llama3", **dataclasses.asdict(self.rope_scaling))
        eos = self.eos_token_ids
        hf = {
            "architectures": [_HF_CLASS_PREFIX[self.family] + suffix],
            "model_type": _FAMILY_MODEL_TYPES[self.family],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (list(eos) or None),
            "pad_token_id": self.pad_token_id,
            # transformers 5 reads rope_parameters; 4.x reads rope_theta/rope_scaling.
            "rope_parameters": rope_parameters,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else dict(rope_parameters),
            # transformers 5 reads dtype; 4.x reads torch_dtype.
            "dtype": self.param_dtype,
            "torch_dtype": self.param_dtype,
        }
        if self.family != "qwen2":
            hf.update(attention_bias=False)
        if self.family == "llama":
            hf.update(mlp_bias=False)
        elif self.family == "mixtral":
            hf.update(sliding_window=None, intermediate_size=self.moe_intermediate_size,
                      num_local_experts=self.num_experts, router_jitter_noise=0.0)
        else:
            hf.update(use_sliding_window=False)
        if self.is_moe:
            hf.update(num_experts_per_tok=self.num_experts_per_tok,
                      router_aux_loss_coef=self.router_aux_loss_coef)
        if self.family == "qwen3_moe":
            hf.update(num_experts=self.num_experts,
                      moe_intermediate_size=self.moe_intermediate_size,
                      norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=1,
                      mlp_only_layers=[])
        if self.family in gemma.FAMILIES:
            hf.pop("use_sliding_window")  # Gemma's windows are its layer_types
            hf.update(gemma.to_hf(self))
        if head == "score":
            hf.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
        return hf

    @classmethod
    def preset(cls, name: str, **overrides) -> ModelConfig:
        """A named preset (see `PRESETS`), with optional field overrides. A Gemma preset
        given another `num_layers` (and no `layer_types`) keeps its local/global pattern
        over the new depth."""
        if name not in PRESETS:
            raise ConfigError(f"unknown model preset {name!r}; presets are {sorted(PRESETS)}")
        preset = PRESETS[name]
        types = preset.layer_types
        if "num_layers" in overrides and "layer_types" not in overrides and gemma.FULL in types:
            overrides["layer_types"] = gemma.layer_types(overrides["num_layers"],
                                                         types.index(gemma.FULL) + 1)
        return dataclasses.replace(preset, **overrides)


def hf_family_and_head(hf_config: Mapping[str, Any]) -> tuple[str, str]:
    """(family, head) of a HF config dict, from `architectures` or else `model_type`."""
    architectures = hf_config.get("architectures") or []
    if (message := gemma.unsupported_architecture(hf_config)) is not None:
        raise ConfigError(message)
    for arch in architectures:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if architectures:
        raise ConfigError(
            f"unsupported architecture {architectures}; supported architectures are "
            f"{sorted(ARCHITECTURES)}"
        )
    model_type = hf_config.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise ConfigError(
            f"unsupported model_type {model_type!r}; supported model types are "
            f"{sorted(_MODEL_TYPES)}"
        )
    return _MODEL_TYPES[model_type], "lm"


def _check_hf_features(hf_config: Mapping[str, Any], family: str) -> None:
    """Rejects config switches this implementation does not model."""
    if family == "mixtral":
        window = hf_config.get("sliding_window")
        if window is not None and window < hf_config.get("max_position_embeddings", 0):
            raise ConfigError(f"config.json sets sliding_window={window}; jrl's Mixtral attends "
                              "to the whole context (sliding_window null)")
        if hf_config.get("router_jitter_noise"):
            raise ConfigError(f"config.json sets router_jitter_noise="
                              f"{hf_config['router_jitter_noise']}; jrl routes without noise "
                              "(set it to 0.0)")
    if family == "qwen3_moe":
        only_dense = list(hf_config.get("mlp_only_layers") or [])
        step = hf_config.get("decoder_sparse_step", 1)
        if only_dense or step not in (1, None):
            raise ConfigError(
                f"config.json sets mlp_only_layers={only_dense} and decoder_sparse_step={step}: "
                "dense layers between MoE layers; jrl's Qwen3-MoE has an MoE block in every "
                "layer (mlp_only_layers [] and decoder_sparse_step 1, as the released "
                "checkpoints)")
    act = hf_config.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is supported")
    for key in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if hf_config.get(key):
            raise ConfigError(f"config.json sets {key}=true, which jrl does not support")
    partial = hf_config.get("partial_rotary_factor", _rope_dict(hf_config).get(
        "partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ConfigError(f"config.json sets partial_rotary_factor={partial}; jrl rotates "
                          "the whole head (1.0) only")


def _hf_experts(hf_config: Mapping[str, Any], family: str) -> dict[str, Any]:
    """The MoE fields of a Qwen3-MoE or Mixtral `config.json` (transformers 5 writes
    `num_local_experts` for both; 4.x wrote `num_experts` for Qwen3-MoE)."""
    experts = hf_config.get("num_experts") or hf_config.get("num_local_experts")
    width_key = "intermediate_size" if family == "mixtral" else "moe_intermediate_size"
    return dict(
        num_experts=experts,
        num_experts_per_tok=hf_config["num_experts_per_tok"],
        moe_intermediate_size=hf_config[width_key],
        # transformers' defaults where the file has no key: Qwen3-MoE does not
        # renormalise, Mixtral always does.
        norm_topk_prob=(True if family == "mixtral"
                        else bool(hf_config.get("norm_topk_prob", False))),
        router_aux_loss_coef=float(hf_config.get("router_aux_loss_coef", 0.001)),
    )


def _rope_dict(hf_config: Mapping[str, Any]) -> Mapping[str, Any]:
    return hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}


def _rope_theta(hf_config: Mapping[str, Any]) -> float:
    if hf_config.get("rope_theta") is not None:
        return hf_config["rope_theta"]
    return _rope_dict(hf_config).get("rope_theta", 10000.0)


def _rope_scaling(hf_config: Mapping[str, Any]) -> RopeScaling | None:
    rope = _rope_dict(hf_config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ConfigError(
            f"unsupported rope_type {rope_type!r}; supported rope types are ['default', 'llama3']"
        )
    return RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
    )


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(value)


def lora_targets(spec) -> tuple[str, ...]:
    """The projections named by `spec`: "all-linear", "q_proj,v_proj" or a sequence.

    Raises:
      ConfigError: an unknown name (listing the valid ones) or an empty list.
    """
    if isinstance(spec, str):
        spec = LORA_MODULES if spec.strip() == "all-linear" else spec.split(",")
    names = tuple(dict.fromkeys(name.strip() for name in spec if name.strip()))
    unknown = [name for name in names if name not in LORA_MODULES]
    if unknown or not names:
        raise ConfigError(f"lora_targets: {', '.join(unknown) or 'none given'}; choose "
                          f"'all-linear' or names from {', '.join(LORA_MODULES)}")
    return names


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not supported; choose one of {list(choices)}")


# Shapes of the released checkpoints (their config.json files). `tiny` is for tests
# and synthetic tasks: it fits the built-in CharTokenizer's vocabulary; `tiny-gemma` is
# its Gemma 2 counterpart (soft-caps, a window shorter than the arithmetic tasks'
# sequences on every other layer).
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        family="qwen2", vocab_size=128, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
        tie_word_embeddings=True, qkv_bias=True, max_position_embeddings=512,
        bos_token_id=1, eos_token_ids=(2,), pad_token_id=0,
    ),
    "qwen2.5-0.5b": ModelConfig(
        family="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=True,
        max_position_embeddings=32768, bos_token_id=151643, eos_token_ids=(151643,),
    ),
    "qwen2.5-1.5b": ModelConfig(
        family="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
        num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=True,
        max_position_embeddings=131072, bos_token_id=151643, eos_token_ids=(151643,),
    ),
    "qwen2.5-7b": ModelConfig(
        family="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=True,
        max_position_embeddings=131072, bos_token_id=151643, eos_token_ids=(151643,),
    ),
    "qwen2.5-32b": ModelConfig(
        family="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=27648,
        num_layers=64, num_heads=40, num_kv_heads=8, head_dim=128, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=True,
        max_position_embeddings=131072, bos_token_id=151643, eos_token_ids=(151643,),
    ),
    "qwen3-0.6b": ModelConfig(
        family="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=True, qk_norm=True,
        max_position_embeddings=40960, bos_token_id=151643, eos_token_ids=(151645,),
    ),
    # A small Qwen3-MoE for tests and the synthetic tasks (`configs/grpo_arith_moe.py`).
    "tiny-moe": ModelConfig(
        family="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
        tie_word_embeddings=True, qk_norm=True, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=64, norm_topk_prob=True, router_aux_loss_coef=0.001,
        max_position_embeddings=512, bos_token_id=1, eos_token_ids=(2,), pad_token_id=0,
    ),
    "qwen3-30b-a3b": ModelConfig(
        family="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=False, qk_norm=True, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        router_aux_loss_coef=0.001, max_position_embeddings=40960, bos_token_id=151643,
        eos_token_ids=(151645,),
    ),
    "mixtral-8x7b": ModelConfig(
        family="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6,
        rms_norm_eps=1e-5, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=14336, norm_topk_prob=True, router_aux_loss_coef=0.02,
        max_position_embeddings=32768, bos_token_id=1, eos_token_ids=(2,),
    ),
    "llama-3.2-1b": ModelConfig(
        family="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0,
        rope_scaling=RopeScaling(
            factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=131072,
        bos_token_id=128000, eos_token_ids=(128001,),
    ),
    "tiny-gemma": ModelConfig(
        family="gemma2", vocab_size=128, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
        tie_word_embeddings=True, max_position_embeddings=512, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, query_pre_attn_scalar=16, sliding_window=8,
        layer_types=gemma.layer_types(2, 2), bos_token_id=1, eos_token_ids=(2,), pad_token_id=0,
    ),
    # google/gemma-2-2b and -9b: every other layer sliding (HF's default layer_types),
    # query_pre_attn_scalar = head_dim (the 27B alone scales by hidden / heads).
    "gemma-2-2b": ModelConfig(
        family="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216,
        num_layers=26, num_heads=8, num_kv_heads=4, head_dim=256, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=8192,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=256,
        sliding_window=4096, layer_types=gemma.layer_types(26, 2),
        bos_token_id=2, eos_token_ids=(1,), pad_token_id=0,
    ),
    "gemma-2-9b": ModelConfig(
        family="gemma2", vocab_size=256000, hidden_size=3584, intermediate_size=14336,
        num_layers=42, num_heads=16, num_kv_heads=8, head_dim=256, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=8192,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=256,
        sliding_window=4096, layer_types=gemma.layer_types(42, 2),
        bos_token_id=2, eos_token_ids=(1,), pad_token_id=0,
    ),
    # google/gemma-3-1b-pt (Gemma3ForCausalLM): five sliding layers to one global
    # (sliding_window_pattern 6), no soft-caps, no RoPE scaling.
    "gemma-3-1b": ModelConfig(
        family="gemma3", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
        num_layers=26, num_heads=4, num_kv_heads=1, head_dim=256, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=True, qk_norm=True,
        max_position_embeddings=32768, query_pre_attn_scalar=256, sliding_window=512,
        layer_types=gemma.layer_types(26, 6), rope_local_base_freq=10000.0,
        bos_token_id=2, eos_token_ids=(1,), pad_token_id=0,
    ),
    # The text models of google/gemma-3-4b-pt and -12b-pt (their config.json's
    # text_config; the checkpoints themselves are Gemma3ForConditionalGeneration, which
    # load_pretrained refuses). Values their text_config leaves out are
    # Gemma3TextConfig's defaults: vocab_size 262208, head_dim 256,
    # query_pre_attn_scalar 256, rope_theta 1e6, rope_local_base_freq 1e4,
    # max_position_embeddings 131072, the pattern of 6, and for the 4B 8 heads / 4 KV heads.
    "gemma-3-4b": ModelConfig(
        family="gemma3", vocab_size=262208, hidden_size=2560, intermediate_size=10240,
        num_layers=34, num_heads=8, num_kv_heads=4, head_dim=256, rope_theta=1e6,
        rope_scaling=LinearRopeScaling(8.0), rms_norm_eps=1e-6, tie_word_embeddings=True,
        qk_norm=True, max_position_embeddings=131072, query_pre_attn_scalar=256,
        sliding_window=1024, layer_types=gemma.layer_types(34, 6),
        rope_local_base_freq=10000.0, bos_token_id=2, eos_token_ids=(1,), pad_token_id=0,
    ),
    "gemma-3-12b": ModelConfig(
        family="gemma3", vocab_size=262208, hidden_size=3840, intermediate_size=15360,
        num_layers=48, num_heads=16, num_kv_heads=8, head_dim=256, rope_theta=1e6,
        rope_scaling=LinearRopeScaling(8.0), rms_norm_eps=1e-6, tie_word_embeddings=True,
        qk_norm=True, max_position_embeddings=131072, query_pre_attn_scalar=256,
        sliding_window=1024, layer_types=gemma.layer_types(48, 6),
        rope_local_base_freq=10000.0, bos_token_id=2, eos_token_ids=(1,), pad_token_id=0,
    ),
}
