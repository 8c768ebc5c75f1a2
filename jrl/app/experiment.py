"""Building an experiment from its settings: tokenizer, data (every row checked), reward,
model and meshes.

The builders take the checked settings of `jrl.config.settings` (`ExperimentSettings`,
or a run's `Settings`), never the config. `jrl.sft` (the warm start) and `jrl.train`
(RL, after the warm start) build through here: experiment <- sft <- train, no cycles.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

from jrl import rewards, sharding
from jrl.config.settings import DataSettings, ExperimentSettings, ModelSettings, Settings
from jrl.data import files, synthetic
from jrl.data.dataset import prompt_token_ids
from jrl.data.tokenizers import CharTokenizer, HFTokenizer
from jrl.errors import ConfigError, DataError
from jrl.models import hf, lora
from jrl.models.config import ModelConfig
from jrl.models.transformer import init_params, param_logical_axes
from jrl.rewards import scoring


def build_tokenizer(experiment_settings: ExperimentSettings):
    """The tokenizer of `tokenizer.*`, checked against `model.path`'s checkpoint.

    Nothing has been compiled yet: a checkpoint paired with the built-in character
    tokenizer, or a tokenizer whose ids the model cannot embed, stops here, naming the
    keys (the keys themselves were checked with the settings).
    """
    tokenizer_settings = experiment_settings.tokenizer
    model_path = os.path.expanduser(experiment_settings.model.path or "")
    if tokenizer_settings.name == "char":
        tokenizer = CharTokenizer()
    else:
        tokenizer = HFTokenizer.from_pretrained(
            os.path.expanduser(tokenizer_settings.path or model_path))
    if model_path:
        _check_tokenizer_fits_model(experiment_settings, tokenizer, model_path)
    return tokenizer


def _check_tokenizer_fits_model(experiment_settings: ExperimentSettings, tokenizer,
                                model_path: str) -> None:
    """The checkpoint must embed every id the tokenizer makes; the character tokenizer
    goes only with a checkpoint of exactly its vocabulary (one trained with it) that
    carries no tokenizer of its own."""
    vocab = hf.read_hf_config(model_path, "model.path").get("vocab_size")
    where = f"model.path={experiment_settings.model.path!r}"
    if experiment_settings.tokenizer.name == "char":
        own = os.path.isfile(os.path.join(model_path, "tokenizer.json"))
        if own or vocab != tokenizer.vocab_size:
            raise ConfigError(
                f"{where} has a {vocab}-token vocabulary{' and its own tokenizer' * own}, but "
                f"tokenizer.name='char' is the built-in {tokenizer.vocab_size}-token character "
                "tokenizer; add --config.tokenizer.name=hf to use the checkpoint's tokenizer")
    elif not isinstance(vocab, int) or tokenizer.vocab_size > vocab:
        source = experiment_settings.tokenizer.path or experiment_settings.model.path
        raise ConfigError(
            f"tokenizer.path / model.path: the tokenizer of {source!r} has "
            f"{tokenizer.vocab_size} tokens, more than the vocab_size={vocab} in config.json "
            f"of {where}; the model cannot embed the extra ids: use the checkpoint's own "
            "tokenizer")


def build_data(experiment_settings: ExperimentSettings, tokenizer=None, reward_fn=None):
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
    data = experiment_settings.data
    rule_reward = reward_fn is None and experiment_settings.rule_reward
    # Prompts are measured as the rollout renders them: with the tool schemas.
    tools = experiment_settings.prompt_tools if tokenizer is not None else None
    if data.train_files:
        splits, errors = [], []
        for split in ("train", "val"):  # both files' bad rows in one error
            try:
                splits.append(_file_rows(data, tokenizer, split, rule_reward, tools))
            except DataError as err:
                errors.append(str(err))
        if errors:  # the same file as both splits fails the same way: said once
            raise DataError("\n".join(dict.fromkeys(errors)))
        return tuple(splits)
    if data.task == "tool_multiplication":
        train_rows, val_rows = synthetic.tool_multiplication(
            data.digits, data.num_val, data.num_train or 4096, seed=data.seed,
            tool_rate=data.tool_rate)
    else:
        train_rows, val_rows = synthetic.arithmetic(
            data.digits, data.ops, data.num_val, data.num_train, seed=data.seed,
            reverse=data.reverse_answer, carry_slip_rate=data.carry_slip_rate)
    if tokenizer is not None:
        bad = files.BadRows()
        for split, rows in (("train", train_rows), ("val", val_rows)):
            for number, row in enumerate(rows, start=1):
                try:
                    _check_prompt_length(data, tokenizer, row, f"row {number}",
                                         hint="raise data.max_prompt_length", tools=tools)
                except DataError as err:
                    bad.add(f"data.task={data.task!r} ({split})", str(err))
        bad.raise_any()
    return train_rows, val_rows


def _check_prompt_length(data: DataSettings, tokenizer, row, where: str, hint: str,
                         tools=None) -> None:
    limit = data.max_prompt_length
    try:
        length = len(prompt_token_ids(tokenizer, row, data.apply_chat_template, tools))
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


def _file_rows(data: DataSettings, tokenizer, split: str, rule_reward: bool,
               tools=None) -> list:
    """Rows of `data.<split>_files`, checked (see `build_data`), with overlong prompts
    (as rendered with the tool schemas `tools`) dropped or reported."""
    key = f"data.{split}_files"
    paths = getattr(data, f"{split}_files")
    if not paths:
        return []
    limit, chat = data.max_prompt_length, data.apply_chat_template
    filter_overlong = data.filter_overlong_prompts

    def check(row, where):
        if rule_reward:
            rewards.check_row(row, where)
        if tokenizer is not None and not filter_overlong:
            _check_prompt_length(data, tokenizer, row, where,
                                 hint="raise the limit or set data.filter_overlong_prompts="
                                 "True to drop such rows", tools=tools)

    rows = files.load_rows(paths, prompt_key=data.prompt_key, check=check)
    if tokenizer is not None and filter_overlong:
        rows, dropped = files.filter_overlong_prompts(rows, tokenizer, limit, chat, tools)
        if jax.process_index() == 0:
            print(f"{key}: dropped {dropped} rows with prompts over data.max_prompt_length="
                  f"{limit} tokens; {len(rows)} remain", flush=True)
        if not rows:
            raise DataError(f"{key}: every prompt is longer than data.max_prompt_length={limit}")
    return rows


def build_reward(settings: Settings, reward_fn=None):
    """(rule scorer, reward model or None) of the `reward` / `reward_model` sections."""
    reward = settings.reward
    # With a reward model the rule scorer is never called: no worker processes for it.
    scorer = scoring.RewardScorer(reward_fn or reward.custom_fn,
                                  num_workers=0 if reward.model_path else reward.num_workers,
                                  on_error=reward.on_error, error_score=reward.error_score)
    model = None
    if reward.model_path:
        from jrl.rewards.reward_model import RewardModel

        model = RewardModel.from_pretrained(
            reward.model_path, reward.model_max_length, dtype=settings.experiment.model.dtype,
            truncation=reward.model_truncation, micro_batch_size=reward.model_micro_batch_size)
    return scorer, model


def build_sharder(settings: Settings) -> sharding.Sharder:
    """The training devices' `Sharder` (`mesh.*`; all devices without a sampling group)."""
    return sharding.training_sharder(settings.devices.mesh, settings.devices.rules,
                                     settings.sampling_devices)


def build_rollout_sharder(settings: Settings) -> sharding.Sharder | None:
    """The sampling group's `Sharder` (`rollout.devices`), or None without one."""
    return sharding.sampling_sharder(settings.devices.rules, settings.sampling_devices,
                                     settings.devices.rollout_tensor)


def build_model(experiment_settings: ExperimentSettings, tokenizer,
                sharder: sharding.Sharder | None = None) -> tuple[ModelConfig, dict]:
    """(architecture, initial actor params) from model.path or a preset.

    With a `sharder`, parameters are created (or read) directly into their shardings;
    no device ever holds a full copy it does not need. With LoRA the base, which stays
    frozen, is created (or read) in the compute dtype, never as float32 (unless an SFT
    warm start will train all of it first); the adapters are float32.
    """
    model_settings = experiment_settings.model
    lora_base = bool(model_settings.lora_rank) and not experiment_settings.sft.steps > 0
    base_dtype = model_settings.dtype if lora_base else model_settings.param_dtype
    if model_settings.path:
        shardings = None
        if sharder is not None:
            shardings = lambda model, head: param_shardings(sharder, model, head)
        model, params = hf.load_pretrained(
            os.path.expanduser(model_settings.path), dtype=base_dtype,
            config_overrides={**model_settings.config_fields(),
                              "param_dtype": model_settings.param_dtype},
            shardings=shardings)
        if model.lora_rank:  # the checkpoint has no adapters: fresh ones (B = 0)
            key = jax.random.fold_in(jax.random.key(experiment_settings.seed), 1)
            params = lora.combine(params, lora.init_adapters(model, key))
        return model, params
    model, init = _fresh_model(model_settings, tokenizer, lora_base, base_dtype)
    shardings = None if sharder is None else param_shardings(sharder, model)
    return model, jax.jit(init, out_shardings=shardings)(jax.random.key(experiment_settings.seed))


def _fresh_model(model_settings: ModelSettings, tokenizer, lora_base: bool, base_dtype):
    """(architecture of a preset, `init(key)` of its parameters)."""
    # A freshly initialised model gets exactly the tokenizer's vocabulary, so it can
    # never sample an id the tokenizer cannot decode.
    try:
        model = ModelConfig.preset(
            model_settings.preset, param_dtype=model_settings.param_dtype,
            vocab_size=tokenizer.vocab_size, pad_token_id=tokenizer.pad_token_id,
            eos_token_ids=tuple(tokenizer.eos_token_ids), **model_settings.config_fields(),
            **model_settings.preset_overrides())
    except ConfigError as e:  # name the keys: the fields are the config's model.* keys
        raise ConfigError(f"model.* (preset {model_settings.preset!r} with the config's "
                          f"model keys): {e}") from e

    def init(key):
        params = init_params(model, key)
        if not lora_base:
            return params
        base, adapters = lora.split(params)
        return lora.combine(jax.tree.map(lambda x: x.astype(base_dtype), base), adapters)

    return model, init


def build_models(experiment_settings: ExperimentSettings, tokenizer,
                 seeds) -> tuple[ModelConfig, dict]:
    """(architecture, the initial actor params of one run per seed, stacked on a leading
    runs axis): a preset initialised from each `key(seed)` as `build_model` would, or
    `model.path`'s weights repeated."""
    if experiment_settings.model.path:
        model, params = build_model(experiment_settings, tokenizer)
        return model, jax.tree.map(lambda x: jnp.stack([x] * len(seeds)), params)
    model_settings = experiment_settings.model
    model, init = _fresh_model(model_settings, tokenizer, False, model_settings.param_dtype)
    keys = jnp.stack([jax.random.key(seed) for seed in seeds])
    return model, jax.jit(jax.vmap(init))(keys)
