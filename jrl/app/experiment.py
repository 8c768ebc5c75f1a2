"""Building an experiment from its config: tokenizer, data (every row checked), reward
and model.

`jrl.sft` (the warm start) and `jrl.train` (RL, after the warm start) build through
here: experiment <- sft <- train, no cycles.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

from jrl import rewards, sharding
from jrl.config import settings
from jrl.data import files, synthetic
from jrl.data.dataset import prompt_token_ids
from jrl.data.tokenizers import CharTokenizer, HFTokenizer
from jrl.errors import ConfigError, DataError
from jrl.models import hf, lora
from jrl.models.config import ModelConfig
from jrl.models.transformer import init_params, param_logical_axes
from jrl.rewards import scoring

_MODEL_OVERRIDES = ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "head_dim")


def scan_unroll(config) -> bool:
    """`model.scan_unroll`, its default (None) resolved: unrolled with token-budget
    micro-batches in the update (`actor.use_dynamic_bsz` / `critic.use_dynamic_bsz`)."""
    unroll = config.model.get("scan_unroll")
    if unroll is not None:
        return bool(unroll)
    return any(config[role].get("use_dynamic_bsz", False) for role in ("actor", "critic"))


def build_tokenizer(config):
    """The tokenizer of `tokenizer.*`, checked against `model.path`'s checkpoint.

    Nothing has been compiled yet: a `model.path` that does not exist, a checkpoint
    paired with the built-in character tokenizer, or a tokenizer whose ids the model
    cannot embed stops here, naming the keys.
    """
    name, model_path = config.tokenizer.name, os.path.expanduser(config.model.path or "")
    if model_path and not os.path.isdir(model_path):
        raise ConfigError(f"model.path: {config.model.path!r} does not exist; expected a "
                          "checkpoint directory with config.json and safetensors weights")
    if name == "char":
        tokenizer = CharTokenizer()
    elif name == "hf":
        path = os.path.expanduser(config.tokenizer.path or model_path)
        if not path:
            raise ConfigError("tokenizer.name='hf' needs tokenizer.path or model.path")
        tokenizer = HFTokenizer.from_pretrained(path)
    else:
        raise ConfigError(f"tokenizer.name: {name!r} is not valid; choose 'char' or 'hf'")
    if model_path:
        _check_tokenizer_fits_model(config, tokenizer, model_path)
    return tokenizer


def _check_tokenizer_fits_model(config, tokenizer, model_path: str) -> None:
    """The checkpoint must embed every id the tokenizer makes; the character tokenizer
    goes only with a checkpoint of exactly its vocabulary (one trained with it) that
    carries no tokenizer of its own."""
    vocab = hf.read_hf_config(model_path).get("vocab_size")
    where = f"model.path={config.model.path!r}"
    if config.tokenizer.name == "char":
        own = os.path.isfile(os.path.join(model_path, "tokenizer.json"))
        if own or vocab != tokenizer.vocab_size:
            raise ConfigError(
                f"{where} has a {vocab}-token vocabulary{' and its own tokenizer' * own}, but "
                f"tokenizer.name='char' is the built-in {tokenizer.vocab_size}-token character "
                "tokenizer; add --config.tokenizer.name=hf to use the checkpoint's tokenizer")
    elif not isinstance(vocab, int) or tokenizer.vocab_size > vocab:
        source = config.tokenizer.path or config.model.path
        raise ConfigError(
            f"tokenizer.path / model.path: the tokenizer of {source!r} has "
            f"{tokenizer.vocab_size} tokens, more than the vocab_size={vocab} in config.json "
            f"of {where}; the model cannot embed the extra ids: use the checkpoint's own "
            "tokenizer")


def build_data(config, tokenizer=None, reward_fn=None):
    """(train rows, validation rows): from `data.train_files` / `val_files` when given,
    else the synthetic `data.task`.

    Every row is checked here, before any compilation: its schema, a non-empty prompt,
    its prompt's length against `data.max_prompt_length` (with a tokenizer), and, when
    the built-in rule rewards score it (no `reward_fn`, `reward.custom_fn`,
    `reward.in_graph_fn` or reward model), a known `data_source` and a usable
    `reward_model.ground_truth`. One error
    lists every bad row (`files.BadRows`): the file, the row (numbered from 1, a .jsonl
    file's line number) and the field.
    """
    rule_reward = (reward_fn is None and not config.reward.custom_fn
                   and not config.reward.in_graph_fn and not config.reward_model.enable)
    # Prompts are measured as the rollout renders them: with the tool schemas.
    tools = settings.prompt_tools(config) if tokenizer is not None else None
    if config.data.train_files:
        splits, errors = [], []
        for split in ("train", "val"):  # both files' bad rows in one error
            try:
                splits.append(_file_rows(config, tokenizer, split, rule_reward, tools))
            except DataError as err:
                errors.append(str(err))
        if errors:
            raise DataError("\n".join(errors))
        return tuple(splits)
    if config.data.val_files:
        raise ConfigError("data.val_files is set without data.train_files; give both, or "
                          "neither for the synthetic data.task")
    if config.data.task not in synthetic.TASKS:
        raise ConfigError(f"data.task: {config.data.task!r} is not valid; choose one of "
                          f"{list(synthetic.TASKS)}")
    if config.data.task == "tool_multiplication":
        train_rows, val_rows = synthetic.tool_multiplication(
            config.data.digits, config.data.num_val, config.data.num_train or 4096,
            seed=config.data.seed, tool_rate=config.data.tool_rate)
    else:
        train_rows, val_rows = synthetic.arithmetic(
            config.data.digits, config.data.ops, config.data.num_val, config.data.num_train,
            seed=config.data.seed, reverse=config.data.reverse_answer,
            carry_slip_rate=config.data.carry_slip_rate)
    if tokenizer is not None:
        bad = files.BadRows()
        for split, rows in (("train", train_rows), ("val", val_rows)):
            for number, row in enumerate(rows, start=1):
                try:
                    _check_prompt_length(config, tokenizer, row, f"row {number}",
                                         hint="raise data.max_prompt_length", tools=tools)
                except DataError as err:
                    bad.add(f"data.task={config.data.task!r} ({split})", str(err))
        bad.raise_any()
    return train_rows, val_rows


def _check_prompt_length(config, tokenizer, row, where: str, hint: str, tools=None) -> None:
    limit = config.data.max_prompt_length
    try:
        length = len(prompt_token_ids(tokenizer, row, config.data.apply_chat_template, tools))
    except ConfigError as err:  # a character the tokenizer cannot encode
        raise DataError(f"{where}: {err}") from err
    if length > limit:
        prompt = row["prompt"] if isinstance(row["prompt"], str) else row["prompt"][-1]["content"]
        shown = repr(prompt if len(prompt) <= 40 else prompt[:40] + "...")
        raise DataError(f"{where}: the prompt {shown} has {length} tokens, more than "
                        f"data.max_prompt_length={limit}; {hint}")


def param_shardings(sharder: sharding.Sharder, model: ModelConfig, head: str = "lm"):
    """Shardings of a model's parameters on `sharder`'s mesh (from shapes alone)."""
    shapes = jax.eval_shape(functools.partial(init_params, model, head=head), jax.random.key(0))
    return sharder.params(param_logical_axes(model, head), shapes)


def _file_rows(config, tokenizer, split: str, rule_reward: bool, tools=None) -> list:
    """Rows of `data.<split>_files`, checked (see `build_data`), with overlong prompts
    (as rendered with the tool schemas `tools`) dropped or reported."""
    key = f"data.{split}_files"
    paths = config.data[f"{split}_files"]
    if not paths:
        return []
    limit, chat = config.data.max_prompt_length, config.data.apply_chat_template
    filter_overlong = config.data.filter_overlong_prompts

    def check(row, where):
        if rule_reward:
            rewards.check_row(row, where)
        if tokenizer is not None and not filter_overlong:
            _check_prompt_length(config, tokenizer, row, where,
                                 hint="raise the limit or set data.filter_overlong_prompts="
                                 "True to drop such rows", tools=tools)

    rows = files.load_rows(paths, prompt_key=config.data.prompt_key, check=check)
    if tokenizer is not None and filter_overlong:
        rows, dropped = files.filter_overlong_prompts(rows, tokenizer, limit, chat, tools)
        if jax.process_index() == 0:
            print(f"{key}: dropped {dropped} rows with prompts over data.max_prompt_length="
                  f"{limit} tokens; {len(rows)} remain", flush=True)
        if not rows:
            raise DataError(f"{key}: every prompt is longer than data.max_prompt_length={limit}")
    return rows


def build_reward(config, s: settings.Settings, reward_fn=None):
    """(rule scorer, reward model or None) of the `reward` / `reward_model` sections."""
    r = s.reward
    # With a reward model the rule scorer is never called: no worker processes for it.
    scorer = scoring.RewardScorer(reward_fn or r.custom_fn,
                                  num_workers=0 if r.model_path else r.num_workers,
                                  on_error=r.on_error, error_score=r.error_score)
    model = None
    if r.model_path:
        from jrl.rewards.reward_model import RewardModel

        model = RewardModel.from_pretrained(
            r.model_path, r.model_max_length, dtype=config.model.dtype,
            truncation=r.model_truncation, micro_batch_size=r.model_micro_batch_size)
    return scorer, model


def _lora_fields(config) -> dict:
    """The `model.lora_*` keys as `ModelConfig` fields (none when the config lacks them)."""
    if "lora_rank" not in config.model:
        return {}
    return {"lora_rank": int(config.model.lora_rank), "lora_alpha": float(config.model.lora_alpha),
            "lora_targets": config.model.target_modules,
            "lora_rollout": config.model.get("lora_rollout", "merged")}


def _model_dtypes(config) -> dict:
    """The `ModelConfig` fields the config sets besides the architecture."""
    return {"dtype": config.model.dtype, "remat": config.model.remat,
            "decode_attention_impl": config.model.get("decode_attention_impl", "auto"),
            "logprob_impl": config.model.get("logprob_impl", "auto"),
            "fuse_decode_projections": bool(config.model.get("fuse_decode_projections", True)),
            "scan_unroll": scan_unroll(config),
            **_lora_fields(config)}


def build_model(config, tokenizer, sharder: sharding.Sharder | None = None
                ) -> tuple[ModelConfig, dict]:
    """(architecture, initial actor params) from model.path or a preset.

    With a `sharder`, parameters are created (or read) directly into their shardings;
    no device ever holds a full copy it does not need. With LoRA the base, which stays
    frozen, is created (or read) in the compute dtype, never as float32 (unless an SFT
    warm start will train all of it first); the adapters are float32.
    """
    lora_base = bool(_lora_fields(config).get("lora_rank")) and not (
        "sft" in config and config.sft.steps > 0)
    base_dtype = config.model.dtype if lora_base else config.model.param_dtype
    dtypes = _model_dtypes(config)
    if config.model.path:
        shardings = None
        if sharder is not None:
            shardings = lambda model, head: param_shardings(sharder, model, head)
        model, params = hf.load_pretrained(
            os.path.expanduser(config.model.path), dtype=base_dtype,
            config_overrides={**dtypes, "param_dtype": config.model.param_dtype},
            shardings=shardings)
        if model.lora_rank:  # the checkpoint has no adapters: fresh ones (B = 0)
            key = jax.random.fold_in(jax.random.key(config.seed), 1)
            params = lora.combine(params, lora.init_adapters(model, key))
        return model, params
    model, init = _fresh_model(config, tokenizer, lora_base, base_dtype, dtypes)
    shardings = None if sharder is None else param_shardings(sharder, model)
    return model, jax.jit(init, out_shardings=shardings)(jax.random.key(config.seed))


def _fresh_model(config, tokenizer, lora_base: bool, base_dtype, dtypes: dict):
    """(architecture of a preset, `init(key)` of its parameters)."""
    overrides = {k: config.model[k] for k in _MODEL_OVERRIDES if config.model[k] is not None}
    # A freshly initialised model gets exactly the tokenizer's vocabulary, so it can
    # never sample an id the tokenizer cannot decode.
    model = ModelConfig.preset(
        config.model.preset, param_dtype=config.model.param_dtype, vocab_size=tokenizer.vocab_size,
        pad_token_id=tokenizer.pad_token_id, eos_token_ids=tuple(tokenizer.eos_token_ids),
        **dtypes, **overrides)

    def init(key):
        params = init_params(model, key)
        if not lora_base:
            return params
        base, adapters = lora.split(params)
        return lora.combine(jax.tree.map(lambda x: x.astype(base_dtype), base), adapters)

    return model, init


def build_models(config, tokenizer, seeds) -> tuple[ModelConfig, dict]:
    """(architecture, the initial actor params of one run per seed, stacked on a leading
    runs axis): a preset initialised from each `key(seed)` as `build_model` would, or
    `model.path`'s weights repeated."""
    if config.model.path:
        model, params = build_model(config, tokenizer)
        return model, jax.tree.map(lambda x: jnp.stack([x] * len(seeds)), params)
    dtypes = _model_dtypes(config)
    model, init = _fresh_model(config, tokenizer, False, config.model.param_dtype, dtypes)
    keys = jnp.stack([jax.random.key(seed) for seed in seeds])
    return model, jax.jit(jax.vmap(init))(keys)
