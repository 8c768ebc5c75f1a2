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
from absl import app, logging

from jrl import cli, distributed, metrics, rewards, rundir, settings, sharding
from jrl.checkpoint import Checkpointer
from jrl.data import files, synthetic
from jrl.data.dataset import prompt_token_ids
from jrl.data.tokenizers import CharTokenizer, HFTokenizer
from jrl.errors import ConfigError, DataError, RunDirError
from jrl.models import hf
from jrl.models.config import ModelConfig
from jrl.models.transformer import init_params, param_logical_axes
from jrl.rewards import scoring
from jrl.sft import train_sft
from jrl.trainer import RLTrainer

_MODEL_OVERRIDES = ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "head_dim")


def build_tokenizer(config):
    name = config.tokenizer.name
    if name == "char":
        return CharTokenizer()
    if name == "hf":
        path = os.path.expanduser(config.tokenizer.path or config.model.path or "")
        if not path:
            raise ConfigError("tokenizer.name='hf' needs tokenizer.path or model.path")
        return HFTokenizer.from_pretrained(path)
    raise ConfigError(f"tokenizer.name: {name!r} is not valid; choose 'char' or 'hf'")


def build_data(config, tokenizer=None, reward_fn=None):
    """(train rows, validation rows): from `data.train_files` / `val_files` when given,
    else the synthetic `data.task`.

    Every row is checked here, before any compilation: its schema, a non-empty prompt,
    its prompt's length against `data.max_prompt_length` (with a tokenizer), and, when
    the built-in rule rewards score it (no `reward_fn`, `reward.custom_fn` or reward
    model), a known `data_source` and a usable `reward_model.ground_truth`. An error
    names the file, the row's index in it and the field.
    """
    rule_reward = (reward_fn is None and not config.reward.custom_fn
                   and not config.reward_model.enable)
    if config.data.train_files:
        return (_file_rows(config, tokenizer, "train", rule_reward),
                _file_rows(config, tokenizer, "val", rule_reward))
    if config.data.val_files:
        raise ConfigError("data.val_files is set without data.train_files; give both, or "
                          "neither for the synthetic data.task")
    if config.data.task != "arithmetic":
        raise ConfigError(f"data.task: {config.data.task!r} is not valid; choose 'arithmetic'")
    train_rows, val_rows = synthetic.arithmetic(
        config.data.digits, config.data.ops, config.data.num_val, config.data.num_train,
        seed=config.data.seed, reverse=config.data.reverse_answer,
        carry_slip_rate=config.data.carry_slip_rate)
    if tokenizer is not None:
        where = f"data.task={config.data.task!r}"
        for split, rows in (("train", train_rows), ("val", val_rows)):
            for index, row in enumerate(rows):
                _check_prompt_length(config, tokenizer, row, f"{where} ({split}): row {index}",
                                     hint="raise data.max_prompt_length")
    return train_rows, val_rows


def _check_prompt_length(config, tokenizer, row, where: str, hint: str) -> None:
    limit = config.data.max_prompt_length
    length = len(prompt_token_ids(tokenizer, row, config.data.apply_chat_template))
    if length > limit:
        prompt = row["prompt"] if isinstance(row["prompt"], str) else row["prompt"][-1]["content"]
        shown = repr(prompt if len(prompt) <= 40 else prompt[:40] + "...")
        raise DataError(f"{where}: the prompt {shown} has {length} tokens, more than "
                        f"data.max_prompt_length={limit}; {hint}")


def param_shardings(sharder: sharding.Sharder, model: ModelConfig, head: str = "lm"):
    """Shardings of a model's parameters on `sharder`'s mesh (from shapes alone)."""
    shapes = jax.eval_shape(functools.partial(init_params, model, head=head), jax.random.key(0))
    return sharder.params(param_logical_axes(model, head), shapes)


def _file_rows(config, tokenizer, split: str, rule_reward: bool) -> list:
    """Rows of `data.<split>_files`, checked (see `build_data`), with overlong prompts
    dropped or reported."""
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
                                 "True to drop such rows")

    rows = files.load_rows(paths, prompt_key=config.data.prompt_key, check=check)
    if tokenizer is not None and filter_overlong:
        rows, dropped = files.filter_overlong_prompts(rows, tokenizer, limit, chat)
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
    """Runs the supervised warm start of `config.sft`, or restores the workdir's.

    A stored warm start is reused only when the settings it was made with (the
    `rundir.WARM_START_KEYS` of its config: seed, tokenizer, model, sft, data) equal
    this config's; otherwise this stops with the changed keys.
    """
    directory = os.path.join(workdir, "sft")
    ckpt = Checkpointer(directory)
    wanted = rundir.warm_start_settings(config)
    try:
        step = ckpt.latest_step()
        if step is not None:
            meta = ckpt.read_meta(step)
            # Warm starts saved before their settings were recorded carry only `steps`.
            stored = meta.get("settings") or {"sft.steps": meta.get("steps")}
            current = wanted if "settings" in meta else {k: wanted.get(k) for k in stored}
            changes = rundir.changed_keys(stored, current, ignore=())
            if changes:
                raise RunDirError(
                    f"{directory} holds a warm start made with other settings; changed keys, "
                    f"old -> new:\n{rundir.format_changes(changes)}\nPass a new --workdir, or "
                    "--config.trainer.resume_mode=disable to replace it.")
            if jax.process_index() == 0:
                print(f"sft: reusing the warm start in {directory} ({meta.get('steps')} steps)",
                      flush=True)
            return ckpt.restore(step, params)[0]
        if jax.process_index() == 0:
            print(f"sft: {config.sft.steps} steps, batch {config.sft.batch_size}", flush=True)
        params = train_sft(params, train_rows, tokenizer, model=model, steps=config.sft.steps,
                           batch_size=config.sft.batch_size, lr=config.sft.lr,
                           max_prompt_length=config.data.max_prompt_length,
                           max_response_length=config.rollout.response_length,
                           seed=config.seed, lr_warmup_steps=config.sft.lr_warmup_steps,
                           apply_chat_template=config.data.apply_chat_template,
                           log_every=max(config.sft.steps // 5, 1), sharder=sharder)
        ckpt.save(config.sft.steps, params, {"steps": config.sft.steps, "settings": wanted})
        return params
    finally:
        ckpt.close()


def run(config: ml_collections.ConfigDict, workdir: str, exit_after_steps: int | None = None,
        sharder: sharding.Sharder | None = None, reward_fn=None) -> dict:
    """Runs the experiment; returns a summary (validation before and after, paths).

    The workdir holds one run (`jrl.rundir`): its lock is held while this runs, its
    `config.json` decides whether this start resumes, reports a finished run, or stops
    because the config changed (`trainer.resume_mode`).

    Args:
      config: the experiment config (`jrl.config_defaults.base_config` and overrides).
      workdir: checkpoints, metrics and plots; a run resumes from its latest checkpoint.
      exit_after_steps: stop after this many RL steps of this call (for tests).
      sharder: the mesh to use (default: built from `config.mesh` over all devices).
      reward_fn: a Python reward function with verl's signature (default: the rule
        scorer of each row's data_source).
    """
    distributed.maybe_initialize(config)
    with rundir.locked(workdir, enabled=jax.process_index() == 0):
        return _run(config, workdir, exit_after_steps, sharder, reward_fn)


def _run(config, workdir, exit_after_steps, sharder, reward_fn) -> dict:
    lead = jax.process_index() == 0
    tokenizer = build_tokenizer(config)
    train_rows, val_rows = build_data(config, tokenizer, reward_fn)
    s = settings.from_config(config, stop_token_ids=tokenizer.eos_token_ids,
                             pad_token_id=tokenizer.pad_token_id, num_train_rows=len(train_rows))
    start = rundir.check_config(workdir, config, has_checkpoint=_has_checkpoint(workdir),
                                write=lead)
    if jax.process_count() > 1:  # process 0 has written config.json (or cleared the workdir)
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("jrl: run directory checked")
    if lead:
        for note in start.notes:
            print(note, flush=True)
    if start.kind == "finished":
        done = rundir.read_finished(workdir)
        if lead:
            print(f"{workdir} holds a finished run (step {done['step']} of "
                  f"{done['total_steps']}, same config); its results follow. For a new run "
                  "pass a new --workdir, or --config.trainer.resume_mode=disable to start this "
                  "one over.", flush=True)
        return {"resumed": False, "finished": True, "step": done["step"],
                **_results(config, workdir, final={})}
    sharder = sharder or sharding.from_config(config)
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
        if lead:
            print(trainer.memory_report(), flush=True)
        resumed = trainer.maybe_restore(start.resume_from)
        writer = metrics.MetricsWriter(workdir, config.trainer.logger, s.total_steps,
                                       config.to_dict(), start_step=trainer.state.step,
                                       enabled=lead)
        try:
            final = trainer.fit(config.data.val_batch_size, writer, exit_after_steps)
        finally:
            writer.close()
    finally:
        if trainer is not None:
            trainer.close()
        scorer.close()
    step = trainer.state.step
    if step == s.total_steps and lead:
        rundir.mark_finished(workdir, step, s.total_steps)
    summary = {"resumed": resumed, "step": step, **_results(config, workdir, final)}
    if config.model.path and config.trainer.export_hf and step == s.total_steps:
        export = os.path.join(workdir, "hf_export")
        # Every process takes part in gathering the parameters; process 0 writes.
        params = jax.tree.map(sharding.host_array, trainer.state.actor.params)
        if lead:
            hf.save_pretrained(export, model, params)
        summary["hf_export"] = export
    return summary


def _has_checkpoint(workdir: str) -> bool:
    directory = os.path.join(workdir, "checkpoints")
    return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


def _results(config, workdir: str, final: dict) -> dict:
    """Validation before and after RL (from metrics.jsonl) and the curves' path."""
    out = {"final": final}
    jsonl = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(jsonl):
        return out
    records = metrics.read_jsonl(jsonl)
    validations = [{k: v for k, v in r.items() if k.startswith("val-")} for r in records]
    validations = [v for v in validations if v]
    if validations:
        out["initial"] = validations[0] if config.trainer.val_before_train else {}
        out["final"] = final or validations[-1]
    out["curves"] = os.path.join(workdir, "curves.png")
    if jax.process_index() == 0:
        metrics.plot_curves(jsonl, out["curves"])
    return out


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
    config = cli.CONFIG.value
    if config is None:
        raise app.UsageError("--config=configs/<name>.py is required")
    workdir = cli.WORKDIR.value or os.path.join("runs", cli.config_name())
    print_summary(run(config, workdir))


if __name__ == "__main__":
    cli.run(main)
