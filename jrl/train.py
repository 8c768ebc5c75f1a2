"""Entry point: `python -m jrl.train --config=configs/<name>.py [--config.key=value ...]`.

Builds the tokenizer, data, model and (optionally) a supervised warm start, then
runs the RL trainer, resuming from the workdir's latest checkpoint when there is
one. At the end it prints held-out accuracy before and after RL and writes the
reward curves to `workdir/curves.png`.
"""

from __future__ import annotations

import functools
import os

import jax
import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from jrl import distributed, metrics, settings, sharding
from jrl.checkpoint import Checkpointer
from jrl.data import files, synthetic
from jrl.data.dataset import prompt_token_ids
from jrl.data.tokenizers import CharTokenizer, HFTokenizer
from jrl.models import hf
from jrl.models.config import ModelConfig
from jrl.models.transformer import init_params, param_logical_axes
from jrl.rewards import scoring
from jrl.sft import train_sft
from jrl.trainer import RLTrainer

CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                         lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, metrics and plots (default: "
                               "runs/<config name>).")

_MODEL_OVERRIDES = ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "head_dim")


def build_tokenizer(config):
    name = config.tokenizer.name
    if name == "char":
        return CharTokenizer()
    if name == "hf":
        path = os.path.expanduser(config.tokenizer.path or config.model.path or "")
        if not path:
            raise ValueError("tokenizer.name='hf' needs tokenizer.path or model.path")
        return HFTokenizer.from_pretrained(path)
    raise ValueError(f"tokenizer.name: {name!r} is not valid; choose 'char' or 'hf'")


def build_data(config, tokenizer=None):
    """(train rows, validation rows): from `data.train_files` / `val_files` when given,
    else the synthetic `data.task`."""
    if config.data.train_files:
        return _file_rows(config, tokenizer, "train"), _file_rows(config, tokenizer, "val")
    if config.data.val_files:
        raise ValueError("data.val_files is set without data.train_files; give both, or "
                         "neither for the synthetic data.task")
    if config.data.task == "arithmetic":
        return synthetic.arithmetic(config.data.digits, config.data.ops, config.data.num_val,
                                    config.data.num_train, seed=config.data.seed,
                                    reverse=config.data.reverse_answer,
                                    carry_slip_rate=config.data.carry_slip_rate)
    raise ValueError(f"data.task: {config.data.task!r} is not valid; choose 'arithmetic'")


def param_shardings(sharder: sharding.Sharder, model: ModelConfig, head: str = "lm"):
    """Shardings of a model's parameters on `sharder`'s mesh (from shapes alone)."""
    shapes = jax.eval_shape(functools.partial(init_params, model, head=head), jax.random.key(0))
    return sharder.params(param_logical_axes(model, head), shapes)


def _file_rows(config, tokenizer, split: str) -> list:
    """Rows of `data.<split>_files`, with overlong prompts dropped or reported."""
    key = f"data.{split}_files"
    paths = config.data[f"{split}_files"]
    if not paths:
        return []
    rows = files.load_rows(paths, prompt_key=config.data.prompt_key)
    limit, chat = config.data.max_prompt_length, config.data.apply_chat_template
    if tokenizer is None:
        return rows
    if config.data.filter_overlong_prompts:
        rows, dropped = files.filter_overlong_prompts(rows, tokenizer, limit, chat)
        if jax.process_index() == 0:
            print(f"{key}: dropped {dropped} rows with prompts over data.max_prompt_length="
                  f"{limit} tokens; {len(rows)} remain", flush=True)
        if not rows:
            raise ValueError(f"{key}: every prompt is longer than data.max_prompt_length="
                             f"{limit}")
        return rows
    for index, row in enumerate(rows):
        length = len(prompt_token_ids(tokenizer, row, chat))
        if length > limit:
            raise ValueError(
                f"{key}: the prompt of row {index} ({row.get('data_source')}) has {length} "
                f"tokens, more than data.max_prompt_length={limit}; raise the limit or set "
                "data.filter_overlong_prompts=True to drop such rows")
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


def build_model(config, tokenizer, sharder: sharding.Sharder | None = None
                ) -> tuple[ModelConfig, dict]:
    """(architecture, initial actor params) from model.path or a preset.

    With a `sharder`, parameters are created (or read) directly into their shardings;
    no device ever holds a full copy it does not need.
    """
    dtypes = {"dtype": config.model.dtype, "remat": config.model.remat}
    if config.model.path:
        shardings = None
        if sharder is not None:
            shardings = lambda model, head: param_shardings(sharder, model, head)
        return hf.load_pretrained(os.path.expanduser(config.model.path),
                                  dtype=config.model.param_dtype,
                                  config_overrides=dtypes, shardings=shardings)
    overrides = {k: config.model[k] for k in _MODEL_OVERRIDES if config.model[k] is not None}
    # A freshly initialised model gets exactly the tokenizer's vocabulary, so it can
    # never sample an id the tokenizer cannot decode.
    model = ModelConfig.preset(
        config.model.preset, param_dtype=config.model.param_dtype, vocab_size=tokenizer.vocab_size,
        pad_token_id=tokenizer.pad_token_id, eos_token_ids=tuple(tokenizer.eos_token_ids),
        **dtypes, **overrides)
    key = jax.random.key(config.seed)
    if sharder is None:
        return model, init_params(model, key)
    init = jax.jit(functools.partial(init_params, model),
                   out_shardings=param_shardings(sharder, model))
    return model, init(key)


def warm_start(config, workdir, model, params, tokenizer, train_rows, sharder=None):
    """Runs (or restores) the supervised warm start of `config.sft`."""
    ckpt = Checkpointer(os.path.join(workdir, "sft"))
    try:
        if ckpt.latest_step() is not None:
            return ckpt.restore(ckpt.latest_step(), params)[0]
        print(f"sft: {config.sft.steps} steps, batch {config.sft.batch_size}", flush=True)
        params = train_sft(params, train_rows, tokenizer, model=model, steps=config.sft.steps,
                           batch_size=config.sft.batch_size, lr=config.sft.lr,
                           max_prompt_length=config.data.max_prompt_length,
                           max_response_length=config.rollout.response_length,
                           seed=config.seed, lr_warmup_steps=config.sft.lr_warmup_steps,
                           apply_chat_template=config.data.apply_chat_template,
                           log_every=max(config.sft.steps // 5, 1), sharder=sharder)
        ckpt.save(config.sft.steps, params, {"steps": config.sft.steps})
        return params
    finally:
        ckpt.close()


def run(config: ml_collections.ConfigDict, workdir: str, exit_after_steps: int | None = None,
        sharder: sharding.Sharder | None = None, reward_fn=None) -> dict:
    """Runs the experiment; returns a summary (validation before and after, paths).

    Args:
      config: the experiment config (`jrl.config_defaults.base_config` and overrides).
      workdir: checkpoints, metrics and plots; a run resumes from its latest checkpoint.
      exit_after_steps: stop after this many RL steps of this call (for tests).
      sharder: the mesh to use (default: built from `config.mesh` over all devices).
      reward_fn: a Python reward function with verl's signature (default: the rule
        scorer of each row's data_source).
    """
    distributed.maybe_initialize(config)
    sharder = sharder or sharding.from_config(config)
    tokenizer = build_tokenizer(config)
    train_rows, val_rows = build_data(config, tokenizer)
    s = settings.from_config(config, stop_token_ids=tokenizer.eos_token_ids,
                             pad_token_id=tokenizer.pad_token_id, num_train_rows=len(train_rows))
    scorer, reward_model = build_reward(config, s, reward_fn)
    trainer = None
    try:  # reward workers and the checkpointer are closed however the run ends
        model, params = build_model(config, tokenizer, sharder)
        os.makedirs(workdir, exist_ok=True)
        if config.sft.steps > 0:
            params = warm_start(config, workdir, model, params, tokenizer, train_rows, sharder)
        trainer = RLTrainer(s, model, params, tokenizer, train_rows, val_rows,
                            scorer, workdir, config.seed, config.trainer,
                            apply_chat_template=config.data.apply_chat_template,
                            data_seed=config.data.seed, sharder=sharder,
                            reward_model=reward_model)
        if jax.process_index() == 0:
            print(trainer.memory_report(), flush=True)
        resumed = trainer.maybe_restore()
        writer = metrics.MetricsWriter(workdir, config.trainer.logger, s.total_steps,
                                       config.to_dict(), start_step=trainer.state.step,
                                       enabled=jax.process_index() == 0)
        try:
            final = trainer.fit(config.data.val_batch_size, writer, exit_after_steps)
        finally:
            writer.close()
    finally:
        if trainer is not None:
            trainer.close()
        scorer.close()
    summary = {"resumed": resumed, "step": trainer.state.step, "final": final}
    jsonl = os.path.join(workdir, "metrics.jsonl")
    if os.path.exists(jsonl):
        records = metrics.read_jsonl(jsonl)
        validations = [{k: v for k, v in r.items() if k.startswith("val-")} for r in records]
        validations = [v for v in validations if v]
        if validations:
            summary["initial"] = validations[0] if config.trainer.val_before_train else {}
            summary["final"] = final or validations[-1]
        summary["curves"] = os.path.join(workdir, "curves.png")
        if jax.process_index() == 0:
            metrics.plot_curves(jsonl, summary["curves"])
    if config.model.path and config.trainer.export_hf and trainer.state.step == s.total_steps:
        export = os.path.join(workdir, "hf_export")
        # Every process takes part in gathering the parameters; process 0 writes.
        params = jax.tree.map(sharding.host_array, trainer.state.actor.params)
        if jax.process_index() == 0:
            hf.save_pretrained(export, model, params)
        summary["hf_export"] = export
    return summary


def print_summary(summary: dict) -> None:
    final, initial = summary.get("final", {}), summary.get("initial", {})
    for key in sorted(k for k in final if k.startswith("val-core/")):
        before, after = initial.get(key), final[key]
        line = f"{key}: {after:.3f} after RL"
        if before is not None:
            line += f", {before:.3f} before RL ({100 * (after - before):+.1f} points)"
        print(line)
    for key in ("curves", "hf_export"):
        if key in summary:
            print(f"{key}: {summary[key]}")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
    config = CONFIG.value
    if config is None:
        raise app.UsageError("--config=configs/<name>.py is required")
    name = os.path.splitext(os.path.basename(flags.FLAGS["config"].config_filename))[0]
    workdir = _WORKDIR.value or os.path.join("runs", name)
    print_summary(run(config, workdir))


if __name__ == "__main__":
    app.run(main)
