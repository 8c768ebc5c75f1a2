"""LoRA adapters on a parameter tree: split and combine, fresh adapters, merging, PEFT files.

With `ModelConfig.lora_rank = r > 0`, each targeted projection `<name>` of every
layer has an adapter next to its kernel (see `transformer.Lora`):

    layers/attn/q_proj_lora/a   [L, D, r]        layers/attn/q_proj_lora/b   [L, r, N, H]
    layers/attn/o_proj_lora/a   [L, N, H, r]     layers/attn/o_proj_lora/b   [L, r, D]
    layers/mlp/down_proj_lora/a [L, F, r]        layers/mlp/down_proj_lora/b [L, r, D]

and the projection computes `x W + (x a) b * lora_alpha / r`. In an MoE model
(`jrl.models.moe`) each expert's gate, up and down projection has its own adapter:
`layers/mlp/gate_proj_lora/a [L, E, D, r]`, `.../b [L, E, r, F]`. The adapters are
ordinary leaves of the tree, so the model code is the same with or without them;
`split` separates them from the base (what trains from what stays frozen) and
`combine` puts them back.

PEFT's files (`adapter_config.json` + `adapter_model.safetensors`) store
`lora_A.weight [r, in]` and `lora_B.weight [out, r]` per layer and module, under
`base_model.model.model.layers.{i}.{self_attn|mlp}.<name>`; `save_peft` and
`load_peft` convert, so `peft.PeftModel.from_pretrained` loads jrl's adapters onto
the transformers base and jrl continues from a PEFT adapter.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jrl.errors import CheckpointError
from jrl.models.config import ModelConfig, lora_targets

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_SUFFIX = "_lora"
_GROUP = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_HF_GROUP = {"attn": "self_attn", "mlp": "mlp"}


def stacked(config: ModelConfig, name: str) -> tuple[int, ...]:
    """The dims a projection's kernel has per layer before its input dims: `(E,)` for an
    MoE model's experts, else none."""
    return (config.num_experts,) if config.is_moe and _GROUP[name] == "mlp" else ()


def shapes(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """{projection: (input dims, output dims)} of each targeted projection (per layer,
    and per expert in an MoE model: `stacked`)."""
    c = config
    f = c.moe_intermediate_size if c.is_moe else c.intermediate_size
    d, n, k, h = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    table = {"q_proj": ((d,), (n, h)), "k_proj": ((d,), (k, h)), "v_proj": ((d,), (k, h)),
             "o_proj": ((n, h), (d,)), "gate_proj": ((d,), (f,)), "up_proj": ((d,), (f,)),
             "down_proj": ((f,), (d,))}
    return {name: table[name] for name in c.lora_targets}


def without(config: ModelConfig) -> ModelConfig:
    """`config` with no adapters: the base model (the reference, the critic)."""
    if not config.lora_rank:
        return config
    return dataclasses.replace(config, lora_rank=0, lora_targets=())


def is_adapter(key: str) -> bool:
    return key.endswith(_SUFFIX)


def split(params: Mapping[str, Any]) -> tuple[dict, dict]:
    """(base, adapters): the tree without its adapters, and the adapters alone."""
    base, adapters = {}, {}
    for key, value in params.items():
        if is_adapter(key):
            adapters[key] = value
        elif isinstance(value, Mapping):
            base[key], inner = split(value)
            if inner:
                adapters[key] = inner
        else:
            base[key] = value
    return base, adapters


def combine(base: Mapping[str, Any], adapters: Mapping[str, Any]) -> dict:
    """The inverse of `split`."""
    out = dict(base)
    for key, value in adapters.items():
        out[key] = combine(base[key], value) if key in base else value
    return out


def init_adapters(config: ModelConfig, rng: jax.Array, dtype: str | None = None) -> dict:
    """Fresh adapters for `config` (as `init_params` draws them): `a` uniform in
    `±1/sqrt(fan_in)`, `b` zero, so `combine(base, init_adapters(...))` computes what
    the base does. For a loaded checkpoint, whose files have no adapters."""
    dtype = dtype or config.param_dtype
    adapters: dict = {}
    keys = jax.random.split(rng, len(config.lora_targets))
    for key, (name, (in_dims, out_dims)) in zip(keys, shapes(config).items(), strict=True):
        bound = 1.0 / math.sqrt(math.prod(in_dims))
        lead = (config.num_layers, *stacked(config, name))
        a = jax.random.uniform(key, (*lead, *in_dims, config.lora_rank),
                               jnp.float32, -bound, bound).astype(dtype)
        b = jnp.zeros((*lead, config.lora_rank, *out_dims), dtype)
        adapters.setdefault("layers", {}).setdefault(_GROUP[name], {})[name + _SUFFIX] = {
            "a": a, "b": b}
    return adapters


def _delta(config: ModelConfig, a, b, kernel_shape, num_lead: int = 1) -> jax.Array:
    """`a b * alpha / r` as a `[L, in..., out...]` kernel update (`[L, E, ...]`: `num_lead`
    2), in float32."""
    lead, rank = math.prod(a.shape[:num_lead]), a.shape[-1]
    a2 = a.reshape(lead, -1, rank).astype(jnp.float32)
    b2 = b.reshape(lead, rank, -1).astype(jnp.float32)
    return (jnp.einsum("lir,lro->lio", a2, b2) * (config.lora_alpha / config.lora_rank)
            ).reshape(kernel_shape)


def merge(params: Mapping[str, Any], config: ModelConfig) -> tuple[ModelConfig, dict]:
    """(config without LoRA, params with each adapter added into its kernel).

    The result is a plain model (for `hf.save_pretrained`, or serving without
    adapters); it computes what the adapted model does up to rounding.
    """
    base, adapters = split(params)
    if not config.lora_rank:
        return config, base
    merged = jax.tree.map(lambda x: x, base)
    for name in config.lora_targets:
        group = _GROUP[name]
        adapter = adapters["layers"][group][name + _SUFFIX]
        kernel = merged["layers"][group][name]["kernel"]
        update = _delta(config, adapter["a"], adapter["b"], kernel.shape,
                        1 + len(stacked(config, name)))
        merged["layers"][group][name] = {
            **merged["layers"][group][name],
            "kernel": (kernel.astype(jnp.float32) + update).astype(kernel.dtype)}
    return without(config), merged


def restart(params: Mapping[str, Any], config: ModelConfig, rng: jax.Array) -> dict:
    """Adapters folded into the base (`merge`) and fresh ones (`init_adapters`) in their
    place: the same function, with adapters that start from zero again. After a warm
    start that trained the whole model, this makes the frozen base (the reference) the
    warm-started model itself."""
    _, merged = merge(params, config)
    dtype = jax.tree.leaves(split(params)[1])[0].dtype
    return combine(merged, init_adapters(config, rng, dtype))


def _check_peft_layout(config: ModelConfig) -> None:
    """PEFT's files name one adapter per module; an MoE model's experts have none."""
    experts = [name for name in config.lora_targets if stacked(config, name)]
    if experts:
        raise ValueError(
            f"adapters on the experts of an MoE model ({', '.join(experts)}) have no PEFT file "
            "layout; merge them into the weights (jrl.models.lora.merge, then "
            "save_pretrained), or target attention only (model.target_modules="
            "q_proj,k_proj,v_proj,o_proj)")


def _peft_name(layer: int, name: str, which: str) -> str:
    return f"base_model.model.model.layers.{layer}.{_HF_GROUP[_GROUP[name]]}.{name}.{which}.weight"


def save_peft(params: Mapping[str, Any], config: ModelConfig, path: str | os.PathLike,
              base_model_name_or_path: str | None = None) -> Path:
    """Writes the adapters of `params` as a PEFT LoRA adapter directory.

    `lora_A.weight` is `a` flattened to `[r, in]`, `lora_B.weight` is `b` flattened
    to `[out, r]`, for every layer; tensors keep the adapters' dtype.
    """
    from safetensors.numpy import save_file

    if not config.lora_rank:
        raise ValueError("the config has no LoRA adapters (lora_rank = 0)")
    _check_peft_layout(config)
    _, adapters = split(params)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name in config.lora_targets:
        adapter = jax.device_get(adapters["layers"][_GROUP[name]][name + _SUFFIX])
        a, b = np.asarray(adapter["a"]), np.asarray(adapter["b"])
        for layer in range(config.num_layers):
            rank = a.shape[-1]
            tensors[_peft_name(layer, name, "lora_A")] = np.ascontiguousarray(
                a[layer].reshape(-1, rank).T)
            tensors[_peft_name(layer, name, "lora_B")] = np.ascontiguousarray(
                b[layer].reshape(rank, -1).T)
    save_file(tensors, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config.lora_rank,
        "lora_alpha": config.lora_alpha, "target_modules": list(config.lora_targets),
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": False, "inference_mode": True, "modules_to_save": None,
        "init_lora_weights": True, "base_model_name_or_path": base_model_name_or_path,
    }
    (path / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2) + "\n")
    return path


def load_peft(path: str | os.PathLike, config: ModelConfig, dtype: str = "float32"
              ) -> tuple[ModelConfig, dict]:
    """(config with the adapter's LoRA settings, adapters) from a PEFT LoRA directory.

    Raises:
      FileNotFoundError: no adapter_config.json or adapter_model.safetensors.
      CheckpointError: a PEFT setting jrl does not implement (rsLoRA, DoRA, biases,
        fan_in_fan_out, other modules), or a tensor missing or of the wrong shape.
    """
    from safetensors.numpy import load_file

    path = Path(path)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path / name} does not exist; a PEFT LoRA adapter "
                                    f"directory has {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    spec = json.loads((path / ADAPTER_CONFIG).read_text())
    unsupported = {"peft_type": spec.get("peft_type") != "LORA",
                   "use_rslora": bool(spec.get("use_rslora")),
                   "use_dora": bool(spec.get("use_dora")),
                   "bias": spec.get("bias", "none") != "none",
                   "fan_in_fan_out": bool(spec.get("fan_in_fan_out")),
                   "modules_to_save": bool(spec.get("modules_to_save"))}
    bad = [key for key, is_bad in unsupported.items() if is_bad]
    if bad:
        raise CheckpointError(f"{path / ADAPTER_CONFIG}: {', '.join(bad)} "
                              f"({', '.join(repr(spec.get(k)) for k in bad)}) is not "
                              "supported; jrl loads plain LoRA (peft_type LORA, no rsLoRA, "
                              "DoRA, biases or modules_to_save)")
    targets = spec.get("target_modules")
    try:
        targets = lora_targets(targets if isinstance(targets, str) else list(targets or []))
    except ValueError as err:
        raise CheckpointError(f"{path / ADAPTER_CONFIG}: target_modules {targets!r}: {err}"
                              ) from None
    config = dataclasses.replace(config, lora_rank=int(spec["r"]),
                                 lora_alpha=float(spec["lora_alpha"]), lora_targets=targets)
    try:
        _check_peft_layout(config)
    except ValueError as err:
        raise CheckpointError(f"{path / ADAPTER_CONFIG}: {err}") from None
    tensors = load_file(str(path / ADAPTER_WEIGHTS))
    adapters: dict = {}
    rank = config.lora_rank
    for name, (in_dims, out_dims) in shapes(config).items():
        a_layers, b_layers = [], []
        for layer in range(config.num_layers):
            got = {}
            for which, want in (("lora_A", (rank, math.prod(in_dims))),
                                ("lora_B", (math.prod(out_dims), rank))):
                key = _peft_name(layer, name, which)
                if key not in tensors:
                    raise CheckpointError(f"{path / ADAPTER_WEIGHTS} has no {key}")
                if tuple(tensors[key].shape) != want:
                    raise CheckpointError(f"{path / ADAPTER_WEIGHTS}: {key} has shape "
                                          f"{tuple(tensors[key].shape)}, expected {want}")
                got[which] = tensors[key]
            a_layers.append(got["lora_A"].T.reshape(*in_dims, rank))
            b_layers.append(got["lora_B"].T.reshape(rank, *out_dims))
        adapters.setdefault("layers", {}).setdefault(_GROUP[name], {})[name + _SUFFIX] = {
            "a": jnp.asarray(np.stack(a_layers), dtype),
            "b": jnp.asarray(np.stack(b_layers), dtype)}
    return config, adapters
