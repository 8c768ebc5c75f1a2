"""Entry point: `python -m jrl.train --config=configs/<name>.py [--config.key=value ...]`.

Builds the tokenizer, data, model and (optionally) a supervised warm start, then
runs the RL trainer, resuming from the workdir's latest checkpoint when there is
one. At the end it prints held-out accuracy before and after RL and writes the
reward curves to `workdir/curves.png`.
"""

from __future__ import annotations

import dataclasses
import os

from jrl.app import interrupt

if __name__ == "__main__":  # before the slow imports: a Ctrl-C during them stops cleanly
    interrupt.install()

import jax  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, logging  # noqa: E402

from jrl import cli, metrics, sft, sharding
from jrl.app import compilation_cache, distributed, experiment, rundir
from jrl.config import settings
from jrl.data.dataset import ground_truth  # noqa: E402
from jrl.errors import ConfigError, RewardError  # noqa: E402
from jrl.models import hf, lora  # noqa: E402
from jrl.rewards import in_graph, scoring  # noqa: E402
from jrl.rl.trainer import RLTrainer, check_batch_sizes  # noqa: E402

# Training rows whose demonstrations a custom reward function is tried on before the
# warm start (`_try_reward_fn`).
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
    distributed.maybe_initialize(config)
    prepared = _prepare(config, workdir, reward_fn, sharder)
    with rundir.claimed(workdir, enabled=jax.process_index() == 0):
        return _run(config, workdir, prepared, exit_after_steps, reward_fn)


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """What `_prepare` built and checked: the run's inputs."""

    tokenizer: object
    train_rows: list
    val_rows: list
    settings: settings.Settings
    sharder: sharding.Sharder
    rollout_sharder: sharding.Sharder | None


def _prepare(config, workdir: str, reward_fn, sharder) -> _Prepared:
    """Builds and checks the inputs without writing anything; raises on the first problem."""
    tokenizer = experiment.build_tokenizer(config)
    train_rows, val_rows = experiment.build_data(config, tokenizer, reward_fn)
    s = settings.from_config(config, stop_token_ids=tokenizer.eos_token_ids,
                             pad_token_id=tokenizer.pad_token_id, num_train_rows=len(train_rows))
    if config.model.path:
        hf.check_files(os.path.expanduser(config.model.path), "model.path")
    if s.reward.model_path:
        hf.check_files(os.path.expanduser(s.reward.model_path), "reward_model.model.path")
    custom = reward_fn or s.reward.custom_fn
    if custom and not s.reward.model_path:
        try:
            fn = scoring.resolve_fn(custom)
        except (ImportError, TypeError) as err:
            raise ConfigError(f"reward.custom_fn: {err}") from err
        if s.reward.on_error == "raise" and config.sft.steps > 0:
            _try_reward_fn(fn, train_rows)
    if s.reward.in_graph_fn or s.trainer.multi_run:
        _check_multi_run(config, s, tokenizer)
    elif config.mesh.get("runs", 1) != 1:
        raise ConfigError(f"mesh.runs={config.mesh.runs}: splits runs in one program "
                          "(trainer.runs with reward.in_graph_fn) over devices; a single "
                          "run with host rewards uses mesh.data/fsdp/context/tensor, leave "
                          "it 1")
    if jax.process_index() == 0:
        rundir.check_writable(workdir)
    sharder = sharder or sharding.from_config(config)
    rollout_sharder = sharding.rollout_from_config(config)
    check_batch_sizes(s, sharder)
    interrupt.check(_checkpoint_step(workdir))
    return _Prepared(tokenizer, train_rows, val_rows, s, sharder, rollout_sharder)


def _check_multi_run(config, s: settings.Settings, tokenizer) -> None:
    """What the device program of `jrl.rl.runs` does not do (yet) stops before the run."""
    from jrl.rl import runs as runs_lib

    runs_lib.runs_devices(config, len(runs_lib.plan(config)))
    if config.mesh.get("context", 1) != 1:
        raise ConfigError(f"mesh.context={config.mesh.context}: runs in one program "
                          "(trainer.runs, reward.in_graph_fn) split over mesh.runs, not "
                          "over the sequence; use mesh.context=1, or rewards on the host")
    if config.model.get("attention_impl") == "cudnn":
        raise ConfigError("model.attention_impl='cudnn': runs in one program "
                          "(trainer.runs, reward.in_graph_fn) are vmapped, and JAX's cuDNN "
                          "attention cannot be; use 'auto' (XLA there) or 'xla'")
    critic = config.get("critic", {}).get("model", {})
    for key, rank in (("model.lora_rank", config.model.get("lora_rank", 0)),
                      ("critic.model.lora_rank", critic.get("lora_rank", 0))):
        if rank:
            raise ConfigError(f"{key}={rank}: LoRA is not supported with "
                              "reward.in_graph_fn (runs in one device program); use "
                              f"{key}=0, or rewards on the host")
    for key in ("rollout_data_dir", "validation_data_dir"):
        if getattr(s.trainer, key):
            raise ConfigError(f"trainer.{key}={getattr(s.trainer, key)!r}: runs in one "
                              "program (reward.in_graph_fn) do not write samples; unset it, "
                              "or use rewards on the host")
    in_graph.resolve(s.reward.in_graph_fn, tokenizer)


def _try_reward_fn(fn, rows) -> None:
    """Scores the demonstrations of the first training rows, the answers the warm start
    teaches (and so the first responses RL samples), with the reward function: one that
    raises on them would stop the run at its first step, after the warm start."""
    # Rows without an answer, and multi-turn demonstrations, are not tried.
    tried = [row for row in rows[:REWARD_TRIAL_ROWS]
             if (row.get("extra_info") or {}).get("demonstration", ground_truth(row)) is not None
             and isinstance(sft.demonstration(row), str)]
    try:
        scoring.RewardScorer(fn).score(tried, [sft.demonstration(r) for r in tried], n=1)
    except RewardError as err:
        raise RewardError(f"before the warm start, on the demonstrations of the first "
                          f"training rows as responses: {err}") from None


def _run(config, workdir, p: _Prepared, exit_after_steps, reward_fn) -> dict:
    lead = jax.process_index() == 0
    start = rundir.check_config(workdir, config, has_checkpoint=_has_checkpoint(workdir),
                                write=lead)
    if jax.process_count() > 1:  # process 0 has written config.json (or cleared the workdir)
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("jrl: run directory checked")
    if lead:
        for note in start.notes:
            print(note, flush=True)
    if start.kind == "finished":
        return _finished(config, workdir)
    if p.settings.reward.in_graph_fn or p.settings.trainer.multi_run:
        return _run_multi(config, workdir, p, exit_after_steps)
    scorer, reward_model = experiment.build_reward(config, p.settings, reward_fn)
    trainer = None
    try:  # reward workers and the checkpointer are closed however the run ends
        model, params = experiment.build_model(config, p.tokenizer, p.sharder)
        interrupt.check(_checkpoint_step(workdir))
        os.makedirs(workdir, exist_ok=True)
        params = _warm_start(config, workdir, model, params, p)
        trainer = RLTrainer(p.settings, model, params, p.tokenizer, p.train_rows, p.val_rows,
                            scorer, workdir, config.seed,
                            apply_chat_template=config.data.apply_chat_template,
                            data_seed=config.data.seed, sharder=p.sharder,
                            reward_model=reward_model, rollout_sharder=p.rollout_sharder)
        resumed, final = _fit(config, workdir, trainer, start, exit_after_steps)
    finally:
        if trainer is not None:
            trainer.close()
        scorer.close()
    summary = {"resumed": resumed, "step": trainer.step, **_results(config, workdir, final)}
    return _finish(config, workdir, trainer, model, p.settings.total_steps, summary)


def _run_multi(config, workdir, p: _Prepared, exit_after_steps) -> dict:
    """The runs of `trainer.runs` / `trainer.sweep` in one device program (`jrl.rl.runs`)."""
    from jrl.rl import runs as runs_lib

    t, lead = p.settings.trainer, jax.process_index() == 0
    plan = runs_lib.plan(config)
    mesh = runs_lib.RunsMesh(runs_lib.runs_devices(config, len(plan)))
    model, params = experiment.build_models(config, p.tokenizer, [r.seed for r in plan])
    os.makedirs(workdir, exist_ok=True)
    if config.sft.steps > 0:
        params = runs_lib.warm_start(config, workdir, model, params, p.tokenizer,
                                     p.train_rows, plan, t.steps_per_call, mesh)
    trainer = runs_lib.MultiRunTrainer(
        p.settings, model, params, p.tokenizer, p.train_rows, p.val_rows, plan, workdir,
        apply_chat_template=config.data.apply_chat_template, data_seed=config.data.seed,
        steps_per_call=t.steps_per_call, mesh=mesh)
    try:
        resumed = trainer.maybe_restore()
        if lead:
            print(f"{len(plan)} runs in one program on {mesh.size} device(s), "
                  f"{t.steps_per_call} steps a call: "
                  + "; ".join(r.label for r in plan), flush=True)
        writer = metrics.MetricsWriter(workdir, config.trainer.logger, p.settings.total_steps,
                                       config.to_dict(), start_step=trainer.step, enabled=lead)
        try:
            trainer.fit(config.data.val_batch_size, writer, exit_after_steps)
        finally:
            writer.close()
    finally:
        trainer.close()
    if trainer.step == p.settings.total_steps and lead:
        rundir.mark_finished(workdir, trainer.step, p.settings.total_steps)
    return {"resumed": resumed, "step": trainer.step, **_results(config, workdir, final={})}


def _warm_start(config, workdir, model, params, p: _Prepared):
    """The parameters RL starts from: after `config.sft`'s warm start, if any."""
    if config.sft.steps <= 0:
        return params
    params = sft.warm_start(config, workdir, model, params, p.tokenizer, p.train_rows,
                            p.sharder)
    if model.lora_rank:  # the warm start trained everything: it becomes the base
        params = lora.restart(params, model, jax.random.fold_in(jax.random.key(config.seed), 2))
    return params


def _fit(config, workdir, trainer: RLTrainer, start: rundir.Start, exit_after_steps):
    """Restores the latest checkpoint (if any) and trains; returns (resumed, the last
    validation metrics)."""
    lead = jax.process_index() == 0
    if lead:
        print(trainer.memory_report(), flush=True)
        print(trainer.prompt_sharing_report(), flush=True)
        if (line := trainer.packing_report()) is not None:
            print(line, flush=True)
    resumed = trainer.maybe_restore(start.resume_from)
    writer = metrics.MetricsWriter(workdir, config.trainer.logger, trainer.s.total_steps,
                                   config.to_dict(), start_step=trainer.step, enabled=lead)
    try:
        return resumed, trainer.fit(config.data.val_batch_size, writer, exit_after_steps)
    finally:
        writer.close()


def _finish(config, workdir, trainer: RLTrainer, model, total_steps: int, summary: dict):
    """Marks a complete run finished and exports it (`trainer.export_hf`)."""
    lead, step = jax.process_index() == 0, trainer.step
    if step == total_steps and lead:
        rundir.mark_finished(workdir, step, total_steps)
    if config.model.path and config.trainer.export_hf and step == total_steps:
        export = os.path.join(workdir, "hf_export")
        # Every process takes part in gathering the parameters; process 0 writes.
        params = jax.tree.map(sharding.host_array, trainer.actor_params())
        if model.lora_rank and lead:  # the adapters as PEFT files, then merged
            adapter = os.path.join(workdir, "peft_adapter")
            lora.save_peft(params, model, adapter, base_model_name_or_path=config.model.path)
            summary["peft_adapter"] = adapter
        export_model, params = lora.merge(params, model)
        if lead:
            hf.save_pretrained(export, export_model, params)
        summary["hf_export"] = export
    return summary


def _finished(config, workdir: str) -> dict:
    """The summary of the finished run in `workdir`, which is not run again."""
    done = rundir.read_finished(workdir)
    if jax.process_index() == 0:
        print(f"{workdir} holds a finished run (step {done['step']} of {done['total_steps']}, "
              "same config); its results follow. For a new run pass a new --workdir, or "
              "--config.trainer.resume_mode=disable to start this one over.", flush=True)
    return {"resumed": False, "finished": True, "step": done["step"],
            **_results(config, workdir, final={})}


def _has_checkpoint(workdir: str) -> bool:
    directory = os.path.join(workdir, "checkpoints")
    return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


def _checkpoint_step(workdir: str) -> int:
    """The step of the workdir's latest complete checkpoint (0: none), where a stopped
    start resumes."""
    directory = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(directory):
        return 0
    return max((int(name) for name in os.listdir(directory) if name.isdigit()), default=0)


def _results(config, workdir: str, final: dict) -> dict:
    """Validation before and after RL (from metrics.jsonl) and the curves' path."""
    out = {"final": final}
    jsonl = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(jsonl):
        return out
    records = metrics.read_jsonl(jsonl)
    if any("run" in r for r in records):
        return {**out, **_run_results(config, workdir, records)}
    validations = [{k: v for k, v in r.items() if k.startswith("val-")} for r in records]
    validations = [v for v in validations if v]
    if validations:
        out["initial"] = validations[0] if config.trainer.val_before_train else {}
        out["final"] = final or validations[-1]
    out["curves"] = os.path.join(workdir, "curves.png")
    if jax.process_index() == 0:
        metrics.plot_curves(jsonl, out["curves"])
    return out


def _run_results(config, workdir: str, records: list[dict]) -> dict:
    """Each run's validation before and after RL (`jrl.rl.runs`), and their curves."""
    from jrl.rl import runs as runs_lib

    t = config.trainer
    plan = runs_lib.plan(config)
    table = []
    for index, run in enumerate(plan):
        validations = [{k: v for k, v in r.items() if k.startswith("val-")}
                       for r in records if r.get("run") == index]
        validations = [v for v in validations if v]
        table.append({"run": index, "seed": run.seed, "lr": run.lr, "setting": run.setting,
                      "initial": validations[0] if validations and t.val_before_train else {},
                      "final": validations[-1] if validations else {}})
    curves = os.path.join(workdir, "curves.png")
    if jax.process_index() == 0:
        settings = [r.setting for r in plan]
        groups = settings if len(set(settings)) > 1 else None
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
    config = cli.CONFIG.value
    if config is None:
        raise app.UsageError("--config=configs/<name>.py is required")
    workdir = cli.WORKDIR.value or os.path.join("runs", cli.config_name())
    compilation_cache.configure(config)  # before anything compiles
    summary = run(config, workdir)
    interrupt.check(summary["step"])  # a signal after the last step: no summary, same status
    print_summary(summary)


if __name__ == "__main__":
    cli.run(main)
