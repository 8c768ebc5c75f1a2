"""Hugging Face safetensors checkpoints <-> jrl parameter pytrees.

`load_pretrained(dir)` reads `config.json` and `model.safetensors` (or the shards
listed in `model.safetensors.index.json`) of a `LlamaForCausalLM`,
`Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`, `MixtralForCausalLM`,
`Gemma2ForCausalLM`, `Gemma3ForCausalLM` or
`*ForSequenceClassification` checkpoint.
Tensors are read one at a time through `safetensors.safe_open` (memory-mapped),
transposed/reshaped into jrl's layout, cast to the requested dtype and written into
one preallocated host buffer per jrl leaf, which goes to the device as soon as it
is full; the host never holds two copies of the model.

`save_pretrained(dir, config, params)` writes `config.json` and safetensors files
(sharded with an index above `max_shard_bytes`) that
`transformers.AutoModelForCausalLM.from_pretrained(dir)` (or
`AutoModelForSequenceClassification` for a reward model) loads.

HF stores a linear layer as `weight [out, in]`; jrl stores `kernel [in, ...out]`, so
2-D weights are transposed and per-head axes split out (`q_proj.weight [N*H, D]`
<-> `q_proj/kernel [D, N, H]`, `o_proj.weight [D, N*H]` <-> `o_proj/kernel [N, H, D]`).
An MoE checkpoint stores each expert's projections as tensors of their own
(`mlp.experts.{e}.gate_proj.weight`; Mixtral's `block_sparse_moe.experts.{e}.w1.weight`),
which become one `[E, ...]` kernel per layer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jrl import errors
from jrl.models import gemma, lora
from jrl.models.config import ModelConfig, hf_family_and_head

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
_EMBED_NAME = "model.embed_tokens.weight"
_LM_HEAD_NAME = "lm_head.weight"


class CheckpointError(errors.CheckpointError):
    """A checkpoint's tensors do not match its config.json (missing, misshapen, untied)."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """How one HF tensor maps to (one layer of) one jrl leaf.

    Attributes:
      hf_name: tensor name; contains `{i}` for per-layer tensors.
      path: key path of the jrl leaf, e.g. ("layers", "attn", "q_proj", "kernel").
      hf_shape: shape in the HF file.
      jrl_shape: shape of the jrl leaf (per layer, without the leading L).
      transpose: HF `[out, in]` weight vs jrl `[in, ...out]` kernel.
      per_layer: the jrl leaf is stacked over layers.
      experts: E when the jrl leaf (per layer) is stacked over E experts, each one HF
        tensor (`hf_name` contains `{e}`); 0 otherwise.
    """

    hf_name: str
    path: tuple[str, ...]
    hf_shape: tuple[int, ...]
    jrl_shape: tuple[int, ...]
    transpose: bool = False
    per_layer: bool = False
    experts: int = 0

    def indices(self, num_layers: int) -> list[tuple[int, ...]]:
        """The index into the jrl leaf of each of its HF tensors: `()`, `(layer,)` or
        `(layer, expert)`."""
        layers = [(i,) for i in range(num_layers)] if self.per_layer else [()]
        if not self.experts:
            return layers
        return [(*i, e) for i in layers for e in range(self.experts)]

    def name(self, index: tuple[int, ...]) -> str:
        """The HF tensor at `index` (`indices`)."""
        if not index:
            return self.hf_name
        return self.hf_name.format(i=index[0], e=index[1] if self.experts else None)

    def to_jrl(self, tensor: np.ndarray) -> np.ndarray:
        return (tensor.T if self.transpose else tensor).reshape(self.jrl_shape)

    def to_hf(self, leaf: np.ndarray) -> np.ndarray:
        if self.transpose:
            return np.ascontiguousarray(leaf.reshape(self.hf_shape[::-1]).T)
        return np.ascontiguousarray(leaf.reshape(self.hf_shape))


def tensor_specs(config: ModelConfig, head: str = "lm") -> list[TensorSpec]:
    """All tensors of a checkpoint with this config and head ("lm", "score" or "none")."""
    c = config
    d, f, n, k, h = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim

    def layer(hf: str, path: str, hf_shape, jrl_shape, transpose=False) -> TensorSpec:
        return TensorSpec(
            f"model.layers.{{i}}.{hf}", ("layers", *path.split("/")),
            tuple(hf_shape), tuple(jrl_shape), transpose, per_layer=True,
        )

    specs = [
        TensorSpec(_EMBED_NAME, ("embed", "embedding"), (c.vocab_size, d), (c.vocab_size, d)),
        layer("input_layernorm.weight", "attn_norm/scale", (d,), (d,)),
        layer("self_attn.q_proj.weight", "attn/q_proj/kernel", (n * h, d), (d, n, h), True),
        layer("self_attn.k_proj.weight", "attn/k_proj/kernel", (k * h, d), (d, k, h), True),
        layer("self_attn.v_proj.weight", "attn/v_proj/kernel", (k * h, d), (d, k, h), True),
        layer("self_attn.o_proj.weight", "attn/o_proj/kernel", (d, n * h), (n, h, d), True),
        # Gemma's post_attention_layernorm is a post-norm of the attention's output
        # (`gemma`); its MLP's pre-norm is pre_feedforward_layernorm.
        layer("post_attention_layernorm.weight",
              "post_attn_norm/scale" if gemma.is_gemma(c) else "mlp_norm/scale", (d,), (d,)),
        TensorSpec("model.norm.weight", ("final_norm", "scale"), (d,), (d,)),
    ]
    if c.is_moe:
        specs += _expert_specs(c)
    else:
        specs += [
            layer("mlp.gate_proj.weight", "mlp/gate_proj/kernel", (f, d), (d, f), True),
            layer("mlp.up_proj.weight", "mlp/up_proj/kernel", (f, d), (d, f), True),
            layer("mlp.down_proj.weight", "mlp/down_proj/kernel", (d, f), (f, d), True),
        ]
    if c.qkv_bias:
        specs += [
            layer("self_attn.q_proj.bias", "attn/q_proj/bias", (n * h,), (n, h)),
            layer("self_attn.k_proj.bias", "attn/k_proj/bias", (k * h,), (k, h)),
            layer("self_attn.v_proj.bias", "attn/v_proj/bias", (k * h,), (k, h)),
        ]
    if gemma.is_gemma(c):
        specs += [
            layer("pre_feedforward_layernorm.weight", "mlp_norm/scale", (d,), (d,)),
            layer("post_feedforward_layernorm.weight", "post_mlp_norm/scale", (d,), (d,)),
        ]
    if c.qk_norm:
        specs += [
            layer("self_attn.q_norm.weight", "attn/q_norm/scale", (h,), (h,)),
            layer("self_attn.k_norm.weight", "attn/k_norm/scale", (h,), (h,)),
        ]
    if head == "lm" and not c.tie_word_embeddings:
        specs.append(TensorSpec(_LM_HEAD_NAME, ("lm_head", "kernel"), (c.vocab_size, d),
                                (d, c.vocab_size), True))
    elif head == "score":
        specs.append(TensorSpec("score.weight", ("score", "kernel"), (1, d), (d, 1), True))
    return specs


# The HF names of an MoE layer's block and of its experts' gate, up and down projections.
_HF_EXPERTS = {"qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
               "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}


def _expert_specs(config: ModelConfig) -> list[TensorSpec]:
    """The router and the experts' projections of each MoE layer."""
    d, e, f = config.hidden_size, config.num_experts, config.moe_intermediate_size
    block, (gate, up, down) = _HF_EXPERTS[config.family]
    prefix = f"model.layers.{{i}}.{block}"
    expert = lambda hf, path, hf_shape, jrl_shape: TensorSpec(
        f"{prefix}.experts.{{e}}.{hf}.weight", ("layers", "mlp", path, "kernel"), hf_shape,
        jrl_shape, transpose=True, per_layer=True, experts=e)
    return [
        TensorSpec(f"{prefix}.gate.weight", ("layers", "mlp", "router", "kernel"), (e, d),
                   (d, e), transpose=True, per_layer=True),
        expert(gate, "gate_proj", (f, d), (d, f)),
        expert(up, "up_proj", (f, d), (d, f)),
        expert(down, "down_proj", (d, f), (f, d)),
    ]


# --------------------------------------------------------------------------- loading


def read_hf_config(path: str | os.PathLike, key: str | None = None) -> dict[str, Any]:
    """Parsed `config.json` of a checkpoint directory, with clear errors if absent or
    unreadable.

    Args:
      path: the checkpoint directory.
      key: the config key that gave `path` (e.g. "model.path"), which starts every
        message when given.

    Raises:
      FileNotFoundError: the directory or its config.json does not exist.
      CheckpointError: config.json is not a JSON object (the file, and the line and
        column of invalid JSON, named).
    """
    prefix = f"{key}: " if key else ""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{prefix}checkpoint directory {str(path)!r} does not exist")
    config_file = path / CONFIG_NAME
    if not config_file.is_file():
        raise FileNotFoundError(
            f"{prefix}{CONFIG_NAME} not found in checkpoint directory {str(path)!r} "
            f"(found: {sorted(p.name for p in path.iterdir())})"
        )
    try:
        config = json.loads(config_file.read_bytes())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{prefix}{str(config_file)!r} is not valid JSON: {err.msg} at "
                              f"line {err.lineno} column {err.colno}") from None
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{prefix}{str(config_file)!r} is not UTF-8 text "
                              f"({err.reason} at byte {err.start})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{prefix}{str(config_file)!r} holds a JSON "
                              f"{type(config).__name__}; expected an object of model settings")
    return config


def read_supported_config(path: str | os.PathLike, key: str = "model.path") -> dict[str, Any]:
    """`read_hf_config`, and the architecture it names is one jrl loads: checked wherever
    a run first reads a checkpoint's config, so an unsupported model stops before
    anything is written or compiled.

    Raises:
      FileNotFoundError, CheckpointError: as `read_hf_config`; CheckpointError also for
        an unsupported architecture or model_type (`key` and the file named, with the
        supported ones).
    """
    config = read_hf_config(path, key)
    try:
        hf_family_and_head(config)
    except errors.ConfigError as err:
        raise CheckpointError(f"{key}: {str(Path(path) / CONFIG_NAME)!r}: {err}") from None
    return config


def check_files(path: str | os.PathLike, key: str = "model.path") -> None:
    """Checks a checkpoint directory without reading its tensors: config.json parses and
    names a supported architecture, the weight files exist, and each safetensors file
    has a readable header and is as long as the header says (a copy cut short is found
    here, not while loading).

    Raises:
      FileNotFoundError: missing directory, config.json or weight files (named).
      CheckpointError: an unreadable config.json or index, an unsupported architecture,
        or a truncated or corrupt safetensors file (its path named, with `key`, the
        config key that gave it).
    """
    path = Path(path)
    read_supported_config(path, key)
    try:
        names = sorted(set(_CheckpointReader.weight_files(path)))
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{key}: {err}") from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, AttributeError,
            TypeError) as err:
        raise CheckpointError(f"{key}: {str(path / INDEX_NAME)!r} is unreadable "
                              f"({type(err).__name__}: {err})") from None
    for name in names:
        _check_safetensors(path / name, key)


def _check_safetensors(file: Path, key: str) -> None:
    """A safetensors file is an 8-byte little-endian header length, a JSON header and the
    tensors' bytes, whose extent the header's `data_offsets` give."""
    size = file.stat().st_size
    problem = None
    with open(file, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 2 or 8 + length > size:
            problem = "its header is cut short or corrupt"
        else:
            try:
                header = json.loads(f.read(length))
                end = max((int(v["data_offsets"][1]) for k, v in header.items()
                           if k != "__metadata__"), default=0)
            except (ValueError, KeyError, TypeError, IndexError, AttributeError):
                problem = "its header is not valid safetensors JSON"
            else:
                if 8 + length + end > size:
                    problem = (f"it has {size} bytes, but its header lists tensors up to byte "
                               f"{8 + length + end}: it is truncated")
    if problem:
        raise CheckpointError(f"{key}: {str(file)!r} is not a complete safetensors file: "
                              f"{problem}; copy or download it again")


class _CheckpointReader:
    """Name -> tensor access over a single or sharded safetensors checkpoint."""

    def __init__(self, path: Path, stack: contextlib.ExitStack):
        self._path = path
        self._stack = stack
        self._files: dict[str, Any] = {}
        self._weight_map = self._find_weight_map(path)

    @staticmethod
    def weight_files(path: Path) -> list[str]:
        """The names of the weight files of a checkpoint directory (checked to exist)."""
        if (path / INDEX_NAME).is_file():
            return sorted(set(_CheckpointReader._find_weight_map(path).values()))
        _CheckpointReader._find_weight_map(path, read=False)
        return [WEIGHTS_NAME]

    @staticmethod
    def _find_weight_map(path: Path, read: bool = True) -> dict[str, str]:
        if (path / INDEX_NAME).is_file():
            weight_map = json.loads((path / INDEX_NAME).read_text())["weight_map"]
            for file_name in sorted(set(weight_map.values())):
                if not (path / file_name).is_file():
                    raise FileNotFoundError(
                        f"{INDEX_NAME} in {str(path)!r} lists weight file {file_name!r}, "
                        "which does not exist"
                    )
            return weight_map
        if (path / WEIGHTS_NAME).is_file():
            if not read:
                return {}
            with safe_open(path / WEIGHTS_NAME, framework="np") as f:
                return {name: WEIGHTS_NAME for name in f.keys()}
        raise FileNotFoundError(
            f"no weight files in {str(path)!r}: expected {WEIGHTS_NAME} or {INDEX_NAME} with "
            f"its shards (found: {sorted(p.name for p in path.iterdir())}); "
            "PyTorch .bin checkpoints must be converted to safetensors first"
        )

    def has(self, name: str) -> bool:
        return name in self._weight_map

    def _file(self, name: str):
        file_name = self._weight_map[name]
        if file_name not in self._files:
            handle = safe_open(self._path / file_name, framework="np")
            self._files[file_name] = self._stack.enter_context(handle)
        return self._files[file_name]

    def get(self, name: str, expected_shape: tuple[int, ...], rows=None) -> np.ndarray:
        """The tensor (or `rows` slice of it), after checking presence and shape."""
        if name not in self._weight_map:
            raise CheckpointError(
                f"checkpoint {str(self._path)!r} is missing tensor {name!r} "
                "(required by its config.json)"
            )
        tensor_slice = self._file(name).get_slice(name)
        shape = tuple(tensor_slice.get_shape())
        if shape != tuple(expected_shape):
            raise CheckpointError(
                f"tensor {name!r} in {self._weight_map[name]!r} has shape {shape}, "
                f"expected {tuple(expected_shape)} from config.json"
            )
        return tensor_slice[rows] if rows is not None else tensor_slice[:]


def _load_leaf(reader: _CheckpointReader, spec: TensorSpec, num_layers: int, dtype) -> np.ndarray:
    """One jrl leaf in `dtype`, filled tensor by tensor (layer by layer, expert by expert)."""
    if not spec.per_layer:
        return spec.to_jrl(reader.get(spec.hf_name, spec.hf_shape)).astype(dtype)
    stacked = (num_layers, spec.experts) if spec.experts else (num_layers,)
    leaf = np.empty((*stacked, *spec.jrl_shape), dtype)
    for index in spec.indices(num_layers):
        leaf[index] = spec.to_jrl(reader.get(spec.name(index), spec.hf_shape))
    return leaf


def _check_tied_head(reader: _CheckpointReader, config: ModelConfig, chunk_rows=4096) -> None:
    """A tied checkpoint may still store lm_head.weight, but only as a copy of the embedding."""
    if not reader.has(_LM_HEAD_NAME):
        return
    shape = (config.vocab_size, config.hidden_size)
    for start in range(0, config.vocab_size, chunk_rows):
        rows = slice(start, min(start + chunk_rows, config.vocab_size))
        if not np.array_equal(reader.get(_EMBED_NAME, shape, rows),
                              reader.get(_LM_HEAD_NAME, shape, rows)):
            raise CheckpointError(
                f"config.json sets tie_word_embeddings=true but {_LM_HEAD_NAME!r} differs from "
                f"{_EMBED_NAME!r}; set tie_word_embeddings=false to load a separate LM head"
            )


def load_pretrained(
    path: str | os.PathLike,
    dtype: str = "float32",
    *,
    config_overrides: Mapping[str, Any] | None = None,
    shardings: Any = None,
) -> tuple[ModelConfig, dict]:
    """Loads a HF checkpoint directory into `(ModelConfig, params)`.

    Args:
      path: directory with `config.json` and `model.safetensors` or sharded
        `model-0000x-of-0000y.safetensors` + `model.safetensors.index.json`.
      dtype: parameter dtype ("float32", "bfloat16", "float16"); tensors are cast as
        they are read. Also the default compute dtype of the returned config.
      config_overrides: `ModelConfig` fields to set, e.g. `{"dtype": "bfloat16",
        "remat": "full"}`.
      shardings: optional pytree of `jax.sharding.Sharding` with the params' structure
        (e.g. from `jrl.sharding`), or a function `(config, head) -> pytree` for when
        the architecture is known only from config.json; each leaf is placed in its
        sharding as soon as it is read (every device receives only its shard).

    Returns:
      The config and the params: `embed`, `layers`, `final_norm`, plus `lm_head`
      (untied causal LM) or `score` (sequence classification).

    Raises:
      FileNotFoundError: missing directory, config.json or weight files.
      CheckpointError: a tensor the config requires is missing (named), has the wrong
        shape (named, with expected and found shapes), or a tied LM head differs
        from the embedding. A subclass of ValueError.
      ValueError: unsupported architecture (named, with the supported ones).
    """
    path = Path(path)
    dtype = jnp.dtype(dtype).name  # accept jnp.bfloat16 as well as "bfloat16"
    hf_config = read_hf_config(path)
    _, head = hf_family_and_head(hf_config)
    if head == "score" and len(hf_config.get("id2label") or {0: 0}) != 1:
        raise ValueError(
            f"{path / CONFIG_NAME} has {len(hf_config['id2label'])} labels; a reward model "
            "must have num_labels=1"
        )
    overrides = {"param_dtype": dtype, "dtype": dtype, **(config_overrides or {})}
    config = ModelConfig.from_hf(hf_config, **overrides)
    if callable(shardings):
        shardings = shardings(config, head)
    params: dict = {}
    with contextlib.ExitStack() as stack:
        reader = _CheckpointReader(path, stack)
        if config.tie_word_embeddings and head == "lm":
            _check_tied_head(reader, config)
        for spec in tensor_specs(config, head):
            leaf = _load_leaf(reader, spec, config.num_layers, jnp.dtype(dtype))
            _set_path(params, spec.path, jax.device_put(leaf, _get_path(shardings, spec.path)))
    return config, params


# --------------------------------------------------------------------------- saving


def _head_of(params: Mapping[str, Any], config: ModelConfig) -> str:
    if lora.split(params)[1]:
        raise ValueError(
            "params have LoRA adapters; merge them first (jrl.models.lora.merge) to save a "
            "plain checkpoint, or write them as a PEFT adapter (jrl.models.lora.save_peft)"
        )
    if "value_head" in params:
        raise ValueError(
            "params have a value_head (PPO critic), which has no transformers class; "
            "save the actor, or drop value_head to save the backbone as a causal LM"
        )
    if "score" in params:
        return "score"
    if not config.tie_word_embeddings and "lm_head" not in params:
        raise ValueError("config.tie_word_embeddings is false but params have no lm_head")
    return "lm"


def _hf_tensors(
    config: ModelConfig, params: Mapping[str, Any], head: str
) -> Iterator[tuple[str, TensorSpec, tuple[int, ...]]]:
    """(HF name, spec, index into the jrl leaf) for every tensor to write."""
    for spec in tensor_specs(config, head):
        for index in spec.indices(config.num_layers):
            yield spec.name(index), spec, index


def _plan_shards(tensors, itemsize: int, max_shard_bytes: int) -> list[list]:
    """Greedy split of the tensor list into files of at most max_shard_bytes each."""
    shards, current, current_bytes = [], [], 0
    for tensor in tensors:
        size = math.prod(tensor[1].hf_shape) * itemsize
        if current and current_bytes + size > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(tensor)
        current_bytes += size
    return shards + [current]


def _remove_old_weights(path: Path) -> None:
    """Drops weight files of an earlier save so that no stale shard or index remains."""
    for old in path.glob("model*.safetensors*"):
        if old.name in (WEIGHTS_NAME, INDEX_NAME) or "-of-" in old.name:
            old.unlink()


def save_pretrained(
    path: str | os.PathLike,
    config: ModelConfig,
    params: Mapping[str, Any],
    *,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Writes a transformers-loadable checkpoint: config.json + safetensors (+ index).

    Args:
      path: output directory (created if needed; earlier `model*.safetensors` files
        and index in it are replaced).
      config: the architecture.
      params: causal-LM params (with `lm_head` when untied) or reward-model params
        (with `score`, saved as `*ForSequenceClassification`).
      dtype: dtype to write; defaults to `config.param_dtype`.
      max_shard_bytes: largest file; larger checkpoints are sharded with an index.
    """
    path = Path(path)
    head = _head_of(params, config)
    np_dtype = jnp.dtype(dtype or config.param_dtype)
    dtype = np_dtype.name
    path.mkdir(parents=True, exist_ok=True)
    _remove_old_weights(path)
    hf_config = {**config.to_hf(head), "dtype": dtype, "torch_dtype": dtype}
    (path / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    shards = _plan_shards(list(_hf_tensors(config, params, head)), np_dtype.itemsize,
                          max_shard_bytes)
    weight_map, total_bytes = {}, 0
    for index, shard in enumerate(shards, start=1):
        file_name = (WEIGHTS_NAME if len(shards) == 1
                     else f"model-{index:05d}-of-{len(shards):05d}.safetensors")
        tensors = {}
        for name, spec, index in shard:
            leaf = _get_path(params, spec.path)[index]
            tensors[name] = spec.to_hf(np.asarray(jax.device_get(leaf)).astype(np_dtype))
            weight_map[name] = file_name
            total_bytes += tensors[name].nbytes
        save_file(tensors, path / file_name, metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (path / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- pytree paths


def _get_path(tree: Any, path: tuple[str, ...]) -> Any:
    """tree[p0][p1]...; None when `tree` is None (no shardings given)."""
    for key in path:
        if tree is None:
            return None
        tree = tree[key]
    return tree


def _set_path(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value
