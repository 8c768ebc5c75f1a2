"""Entry point: `python -m jrl.train --config=configs/<name>.py [--config.key=value ...]`.

Builds the tokenizer, data, model and (optionally) a supervised warm start, then
runs the RL trainer, resuming from the workdir's latest complete checkpoint when
there is one. At the end it prints held-out accuracy before and after RL and writes
the reward curves to `workdir/curves.png`.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from jrl.app import interrupt

if __name__ == "__main__":  # before the slow imports: a Ctrl-C during them stops cleanly
    interrupt.install()

import jax  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags, logging  # noqa: E402

from jrl import cli, metrics, sft, sharding
from jrl.algos import advantages
from jrl.app import compilation_cache, distributed, experiment, rundir
from jrl.config import batches
from jrl.config import settings as settings_lib
from jrl.data.dataset import ground_truth  # noqa: E402
from jrl.errors import ConfigError, JrlError, RewardError  # noqa: E402
from jrl.models import hf, lora  # noqa: E402
from jrl.rewards import in_graph, overlong, responses, scoring  # noqa: E402
from jrl.rl import checkpoint  # noqa: E402
from jrl.rl.trainer import RLTrainer  # noqa: E402

# Training rows whose demonstrations the reward function is tried on before the warm
# start (`_try_reward_fn`).
REWARD_TRIAL_ROWS = 8


def run(config: ml_collections.ConfigDict, workdir: str, exit_after_steps: int | None = None,
        sharder: sharding.Sharder | None = None, reward_fn=None) -> dict:
    """Runs the experiment; returns a summary (validation before and after, paths).

    Everything that can be checked before training (the config, every data row, the
    reward function, the model files, that the workdir is writable) is checked before
    the workdir is claimed; a start that fails before it wrote any output leaves no
    `config.json` behind (`rundir.claimed`). The workdir holds one run (`jrl.app.rundir`):
    its lock is held while this runs, its `config.json` decides whether this start
    resumes, reports a finished run, or stops because the config changed
    (`trainer.resume_mode`).

    Args:
      config: the experiment config (`jrl.config.defaults.base_config` and overrides).
      workdir: checkpoints, metrics and plots; a run resumes from its latest checkpoint.
      exit_after_steps: stop after this many RL steps of this call (for tests).
      sharder: the mesh to use (default: built from `config.mesh` over all devices).
      reward_fn: a Python reward function with verl's signature (default: the rule
        scorer of each row's data_source).

    Raises:
      jrl.app.interrupt.Stopped: a signal arrived (`jrl.app.interrupt.install`); the run stopped
        at a safe point, with a checkpoint of its last step.
    """
    distributed.maybe_initialize(settings_lib.distributed_from_config(config))
    prepared = _prepare(config, workdir, reward_fn, sharder)
    with rundir.claimed(workdir, enabled=jax.process_index() == 0):
        return _run(config, workdir, prepared, exit_after_steps, reward_fn)


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """What `_prepare` built and checked: the run's inputs.

    Attributes:
      tokenizer: the tokenizer of `tokenizer.*`.
      train_rows, val_rows: the checked rows.
      settings: the run's complete settings (`Settings.with_data` done).
      sharder, rollout_sharder: the training devices' and the sampling group's meshes
        (None: no sampling group).
      config_dict: the config as the metrics loggers record it.
      warm_start_keys: the config keys a warm start depends on
        (`rundir.warm_start_settings`).
    """

    tokenizer: object
    train_rows: list
    val_rows: list
    settings: settings_lib.Settings
    sharder: sharding.Sharder
    rollout_sharder: sharding.Sharder | None
    config_dict: dict
    warm_start_keys: dict


def _prepare(config, workdir: str, reward_fn, sharder) -> _Prepared:
    """Builds and checks the inputs without writing anything; raises on the first problem:
    every key of the config first (`settings_lib.from_config`), then the tokenizer, the
    rows, the batch sizes against the rows and the mesh (all of them in one error,
    `jrl.config.batches`), the files and the reward function."""
    _check_batch_sizes_first(config, sharder, reward_fn)
    settings = settings_lib.from_config(config)
    tokenizer = experiment.build_tokenizer(settings.experiment)
    train_rows, val_rows = experiment.build_data(settings.experiment, tokenizer, reward_fn)
    sharder = sharder or experiment.build_sharder(settings)
    batches.check(batches.from_settings(settings), len(train_rows), sharder)
    settings = settings.with_data(stop_token_ids=tokenizer.eos_token_ids,
                                  pad_token_id=tokenizer.pad_token_id,
                                  num_train_rows=len(train_rows))
    _check_files_and_reward(settings, train_rows, reward_fn)
    if settings.reward.in_graph_fn or settings.trainer.multi_run:
        _check_runs(settings, tokenizer)
    if jax.process_index() == 0:
        rundir.check_writable(workdir)
    rollout_sharder = experiment.build_rollout_sharder(settings)
    interrupt.check(_start_step(workdir, config))
    return _Prepared(tokenizer, train_rows, val_rows, settings, sharder, rollout_sharder,
                     config.to_dict(), rundir.warm_start_settings(config))


def _check_batch_sizes_first(config, sharder, reward_fn) -> None:
    """Where a batch size of the config is what would stop `settings_lib.from_config`
    (it stops at the first), every size that does not fit, with the training rows and
    the mesh, in one error (`jrl.config.batches`); the rows are read for it."""
    try:
        needs_critic = advantages.get_estimator(config.algorithm.adv_estimator).needs_values
        sizes = batches.from_config(config, needs_critic)
        if sizes is not None and sharder is None:
            devices = settings_lib.devices_from_config(config)
            sharder = sharding.training_sharder(devices.mesh, devices.rules,
                                                config.rollout.devices)
    except (JrlError, AttributeError, KeyError, TypeError, ValueError):
        return  # the settings name what is wrong
    if sizes is None or not batches.problems(sizes, None, sharder):
        return
    experiment_settings = settings_lib.experiment_from_config(config)
    tokenizer = experiment.build_tokenizer(experiment_settings)
    train_rows, _ = experiment.build_data(experiment_settings, tokenizer, reward_fn)
    batches.check(sizes, len(train_rows), sharder)


def _check_files_and_reward(settings: settings_lib.Settings, train_rows, reward_fn) -> None:
    """The model's and the reward model's files, and the reward function: it resolves,
    and with a warm start it scores the demonstrations (under
    `reward.on_error='raise'`), where a dynamic-sampling metric is looked for among the
    fields it returns."""
    model_path = settings.experiment.model.path
    if model_path:
        hf.check_files(os.path.expanduser(model_path), "model.path")
    if settings.reward.model_path:  # the reward model scores: no function to try
        hf.check_files(os.path.expanduser(settings.reward.model_path), "reward_model.model.path")
        return
    custom = reward_fn or settings.reward.custom_fn
    fn = None  # the rule rewards by data_source
    if custom:
        try:
            fn = scoring.resolve_fn(custom)
        except (ImportError, TypeError) as err:
            raise ConfigError(f"reward.custom_fn: {err}") from err
    # The demonstrations are the responses a warm start teaches, so what the function
    # does on them it does at the first step; without one they are only the rows' bare
    # answers, which a function may rightly not parse (or return fewer fields for).
    if settings.experiment.sft.steps <= 0:
        return
    raises = bool(custom) and settings.reward.on_error == "raise"
    # Multi-turn rewards can take fields from the tools' rewards, which a trial lacks.
    filtered = settings.filter_groups is not None and settings.experiment.multi_turn is None
    if raises or filtered:
        fields = _try_reward_fn(fn, train_rows, "raise" if raises else "score")
        if filtered and fields is not None and not fields.num_errors:
            # A field the reward does not return would stop the first step, compiled.
            extras = dict(fields.extras)
            if settings.reward.overlong_buffer_len:  # the fields the scorer adds
                extras.update(overlong.overlong_extras(np.zeros_like(fields.scores)))
            responses.filter_metric(settings.filter_groups.metric, fields.scores, extras)


def _check_runs(settings: settings_lib.Settings, tokenizer) -> None:
    """What runs in one device program need beyond their settings' checks: devices for
    `mesh.runs` that divide the runs (`jrl.rl.runs.plan`), and an
    in-graph reward that takes this tokenizer."""
    from jrl.rl import runs as runs_lib

    runs_lib.runs_devices(settings.devices.runs, len(runs_lib.plan(settings)))
    in_graph.resolve(settings.reward.in_graph_fn, tokenizer)


def _try_reward_fn(fn, rows, on_error: str = "raise") -> scoring.ScoreResult | None:
    """Scores the demonstrations of the first training rows (their ground truths, or
    `extra_info.demonstration`) as responses with the reward function (None: the rule
    rewards), before anything is built; None when no row has one. With a warm start
    these are the answers it teaches, and so the first responses RL scores: a function
    that raises on them (`on_error="raise"`) would stop the run at its first step,
    after the warm start and the programs' compilation."""
    # Rows without an answer, and multi-turn demonstrations, are not tried.
    tried = [row for row in rows[:REWARD_TRIAL_ROWS]
             if (row.get("extra_info") or {}).get("demonstration", ground_truth(row)) is not None
             and isinstance(sft.demonstration(row), str)]
    if not tried:
        return None
    try:
        return scoring.RewardScorer(fn, on_error=on_error).score(
            tried, [sft.demonstration(r) for r in tried], n=1)
    except RewardError as err:
        raise RewardError(f"before the warm start, on the demonstrations of the first "
                          f"training rows as responses: {err}") from None


def _run(config, workdir, p: _Prepared, exit_after_steps, reward_fn) -> dict:
    lead, settings = jax.process_index() == 0, p.settings
    start = rundir.check_config(workdir, config, write=lead)
    if jax.process_count() > 1:  # process 0 has written config.json (or cleared the workdir)
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("jrl: run directory checked")
    if lead:
        for note in start.notes:
            print(note, flush=True)
        for warning in start.warnings:
            print(warning, file=sys.stderr, flush=True)
    if start.kind == "finished":
        return _finished(settings, workdir)
    if settings.reward.in_graph_fn or settings.trainer.multi_run:
        return _run_multi(workdir, p, exit_after_steps, start.resume_from)
    scorer, reward_model = experiment.build_reward(settings, reward_fn)
    experiment_settings, trainer = settings.experiment, None
    try:  # reward workers and the checkpointer are closed however the run ends
        model, params = experiment.build_model(experiment_settings, p.tokenizer, p.sharder)
        interrupt.check(_start_step(workdir, config))
        os.makedirs(workdir, exist_ok=True)
        params = _warm_start(workdir, model, params, p)
        trainer = RLTrainer(settings, model, params, p.tokenizer, p.train_rows, p.val_rows,
                            scorer, workdir, experiment_settings.seed,
                            apply_chat_template=experiment_settings.data.apply_chat_template,
                            data_seed=experiment_settings.data.seed, sharder=p.sharder,
                            reward_model=reward_model, rollout_sharder=p.rollout_sharder)
        resumed, final = _fit(workdir, trainer, start, exit_after_steps, p)
    finally:
        if trainer is not None:
            trainer.close()
        scorer.close()
    summary = {"resumed": resumed, "step": trainer.step, **_results(settings, workdir, final)}
    return _finish(settings, workdir, trainer, model, summary)


def _run_multi(workdir, p: _Prepared, exit_after_steps, resume_from: str | None) -> dict:
    """The runs of `trainer.runs` / `trainer.sweep` in one device program (`jrl.rl.runs`);
    `resume_from`: the checkpoint of `resume_mode=resume_path`."""
    from jrl.rl import runs as runs_lib

    settings, lead = p.settings, jax.process_index() == 0
    experiment_settings, steps_per_call = settings.experiment, settings.trainer.steps_per_call
    plan = runs_lib.plan(settings)
    mesh = runs_lib.RunsMesh(runs_lib.runs_devices(settings.devices.runs, len(plan)))
    model, params = experiment.build_models(experiment_settings, p.tokenizer,
                                            [r.seed for r in plan])
    os.makedirs(workdir, exist_ok=True)
    if experiment_settings.sft.steps > 0:
        params = runs_lib.warm_start(experiment_settings, workdir, model, params, p.tokenizer,
                                     p.train_rows, plan, steps_per_call, mesh,
                                     config_keys=p.warm_start_keys)
    trainer = runs_lib.MultiRunTrainer(
        settings, model, params, p.tokenizer, p.train_rows, p.val_rows, plan, workdir,
        apply_chat_template=experiment_settings.data.apply_chat_template,
        data_seed=experiment_settings.data.seed, steps_per_call=steps_per_call, mesh=mesh)
    try:
        resumed = trainer.maybe_restore(resume_from)
        if lead:
            per_call = min(steps_per_call, settings.total_steps)
            print(f"{len(plan)} runs in one program on {mesh.size} device(s), {per_call} "
                  f"step{'' if per_call == 1 else 's'} a call: "
                  + "; ".join(r.label for r in plan), flush=True)
        writer = metrics.MetricsWriter(workdir, settings.trainer.logger, settings.total_steps,
                                       p.config_dict, start_step=trainer.step, enabled=lead)
        try:
            trainer.fit(experiment_settings.data.val_batch_size, writer, exit_after_steps)
        finally:
            writer.close()
    finally:
        trainer.close()
    if trainer.step == settings.total_steps and lead:
        rundir.mark_finished(workdir, trainer.step, settings.total_steps)
    return {"resumed": resumed, "step": trainer.step, **_results(settings, workdir, final={})}


def _warm_start(workdir, model, params, p: _Prepared):
    """The parameters RL starts from: after the `sft` settings' warm start, if any."""
    experiment_settings = p.settings.experiment
    if experiment_settings.sft.steps <= 0:
        return params
    params = sft.warm_start(experiment_settings, workdir, model, params, p.tokenizer,
                            p.train_rows, p.sharder, config_keys=p.warm_start_keys)
    if model.lora_rank:  # the warm start trained everything: it becomes the base
        key = jax.random.fold_in(jax.random.key(experiment_settings.seed), 2)
        params = lora.restart(params, model, key)
    return params


def _fit(workdir, trainer: RLTrainer, start: rundir.Start, exit_after_steps, p: _Prepared):
    """Restores the latest checkpoint (if any) and trains; returns (resumed, the last
    validation metrics)."""
    lead, settings = jax.process_index() == 0, p.settings
    if lead:
        print(trainer.memory_report(), flush=True)
        print(trainer.prompt_sharing_report(), flush=True)
        if (line := trainer.packing_report()) is not None:
            print(line, flush=True)
    resumed = trainer.maybe_restore(start.resume_from)
    writer = metrics.MetricsWriter(workdir, settings.trainer.logger, settings.total_steps,
                                   p.config_dict, start_step=trainer.step, enabled=lead)
    try:
        return resumed, trainer.fit(settings.experiment.data.val_batch_size, writer,
                                    exit_after_steps)
    finally:
        writer.close()


def _finish(settings: settings_lib.Settings, workdir, trainer: RLTrainer, model,
            summary: dict):
    """Marks a complete run finished and exports it (`trainer.export_hf`)."""
    lead, step, total_steps = jax.process_index() == 0, trainer.step, settings.total_steps
    if step == total_steps and lead:
        rundir.mark_finished(workdir, step, total_steps)
    model_path = settings.experiment.model.path
    if model_path and settings.trainer.export_hf and step == total_steps:
        export = os.path.join(workdir, "hf_export")
        # Every process takes part in gathering the parameters; process 0 writes.
        params = jax.tree.map(sharding.host_array, trainer.actor_params())
        if model.lora_rank and lead:  # the adapters as PEFT files, then merged
            adapter = os.path.join(workdir, "peft_adapter")
            lora.save_peft(params, model, adapter, base_model_name_or_path=model_path)
            summary["peft_adapter"] = adapter
        export_model, params = lora.merge(params, model)
        if lead:
            hf.save_pretrained(export, export_model, params)
        summary["hf_export"] = export
    return summary


def _finished(settings: settings_lib.Settings, workdir: str) -> dict:
    """The summary of the finished run in `workdir`, which is not run again."""
    done = rundir.read_finished(workdir)
    if jax.process_index() == 0:
        print(f"{workdir} holds a finished run (step {done['step']} of {done['total_steps']}, "
              "same config); its results follow. For a new run pass a new --workdir, or "
              "--config.trainer.resume_mode=disable to start this one over.", flush=True)
    return {"resumed": False, "finished": True, "step": done["step"],
            **_results(settings, workdir, final={})}


def _start_step(workdir: str, config) -> int:
    """The step a start stopped before its trainer restored resumes from: the
    `resume_mode=resume_path` checkpoint's, else the workdir's latest complete one (0:
    none; `resume_mode=disable` starts over)."""
    if config.trainer.resume_mode == "disable":
        return 0
    if config.trainer.resume_mode == "resume_path":
        step = os.path.basename(os.path.normpath(config.trainer.resume_from_path or ""))
        return int(step) if step.isdigit() else 0
    return checkpoint.latest_complete(rundir.checkpoints_dir(workdir)) or 0


def _results(settings: settings_lib.Settings, workdir: str, final: dict) -> dict:
    """Validation before and after RL (from metrics.jsonl) and the curves' path."""
    out = {"final": final}
    jsonl = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(jsonl):
        return out
    records = metrics.read_jsonl(jsonl)
    if any("run" in r for r in records):
        return {**out, **_run_results(settings, workdir, records)}
    validations = [{k: v for k, v in r.items() if k.startswith("val-")} for r in records]
    validations = [v for v in validations if v]
    if validations:
        out["initial"] = validations[0] if settings.trainer.val_before_train else {}
        out["final"] = final or validations[-1]
    out["curves"] = os.path.join(workdir, "curves.png")
    if jax.process_index() == 0:
        metrics.plot_curves(jsonl, out["curves"])
    return out


def _run_results(settings: settings_lib.Settings, workdir: str, records: list[dict]) -> dict:
    """Each run's validation before and after RL (`jrl.rl.runs`), and their curves."""
    from jrl.rl import runs as runs_lib

    plan = runs_lib.plan(settings)
    table = []
    for index, run in enumerate(plan):
        validations = [{k: v for k, v in r.items() if k.startswith("val-")}
                       for r in records if r.get("run") == index]
        validations = [v for v in validations if v]
        before = validations[0] if validations and settings.trainer.val_before_train else {}
        table.append({"run": index, "seed": run.seed, "lr": run.lr, "setting": run.setting,
                      "initial": before, "final": validations[-1] if validations else {}})
    curves = os.path.join(workdir, "curves.png")
    if jax.process_index() == 0:
        swept = [r.setting for r in plan]
        groups = swept if len(set(swept)) > 1 else None
        metrics.runs_figure(records, [r.label for r in plan], groups).savefig(curves, dpi=120)
    return {"runs": table, "curves": curves}


def print_summary(summary: dict) -> None:
    if "runs" in summary:
        _print_runs(summary)
        return
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


def _print_runs(summary: dict) -> None:
    """One line per run and validation key (before, after, gain), then their spread."""
    table = summary["runs"]
    keys = sorted({k for row in table for k in row["final"] if k.startswith("val-core/")})
    for key in keys:
        print(f"{key}:")
        gains = []
        for row in table:
            before, after = row["initial"].get(key), row["final"].get(key)
            setting = row.get("setting") or f"lr={row['lr']:g}"
            line = f"  run {row['run']:>3} seed {row['seed']:>4} {setting:<12}"
            if after is not None:
                line += f" {after:.3f} after RL"
            if before is not None and after is not None:
                gains.append(after - before)
                line += f", {before:.3f} before ({100 * (after - before):+.1f} points)"
            print(line)
        finals = [row["final"][key] for row in table if key in row["final"]]
        if finals:
            print(f"  after RL: mean {np.mean(finals):.3f}, min {min(finals):.3f}, "
                  f"max {max(finals):.3f} over {len(finals)} runs"
                  + (f"; gain mean {100 * np.mean(gains):+.1f} points" if gains else ""))
    if "curves" in summary:
        print(f"curves: {summary['curves']}")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
    config = cli.required_config()
    workdir = cli.WORKDIR.value or os.path.join("runs", cli.config_name())
    # Before anything compiles.
    compilation_cache.configure(config.trainer.get("compilation_cache_dir"))
    summary = run(config, workdir)
    interrupt.check(summary["step"])  # a signal after the last step: no summary, same status
    print_summary(summary)


if __name__ == "__main__":
    flags.adopt_module_key_flags(cli)  # --help lists --config, --workdir and --debug
    cli.run(main)
