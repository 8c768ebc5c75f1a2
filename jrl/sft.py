"""Supervised fine-tuning on (prompt, answer) rows: the warm start before RL.

`python -m jrl.sft --config=configs/x.py --workdir=...` runs the `sft` section of
an experiment config on its training rows and saves the parameters; the RL
entry point runs the same warm start first when `sft.steps > 0`.
"""

from __future__ import annotations

import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jrl import sharding as sharding_lib
from jrl.algos import masks
from jrl.app import experiment, interrupt, rundir
from jrl.config import settings
from jrl.config.settings import ExperimentSettings
from jrl.data.dataset import Row, encode_prompts, ground_truth
from jrl.errors import CheckpointError, ConfigError, JrlError, RunDirError
from jrl.models.config import ModelConfig
from jrl.rl import logprobs, update
from jrl.rl.checkpoint import Checkpointer, UnreadableCheckpoint
from jrl.rollout import multi_turn


class NonFiniteLossError(JrlError, FloatingPointError):
    """The warm start's loss is NaN or infinite (named with its step)."""


def encode_examples(tokenizer, rows, max_prompt_length: int, max_response_length: int,
                    apply_chat_template: bool = False, tools=None):
    """Left-padded prompts and right-padded responses, as numpy arrays: `(prompt_ids,
    prompt_mask, responses, response_mask, attention_mask)`.

    A response is `answer + eos`, or for a multi-turn demonstration (a list of assistant
    and tool messages) the rollout's layout (`multi_turn.demonstration_tokens`): the
    loss (`response_mask`) covers the assistant turns, the attention every token.
    Prompts render the multi-turn tool schemas `tools` as the rollout's do.
    """
    prompt_ids, prompt_mask = encode_prompts(tokenizer, rows, max_prompt_length,
                                             apply_chat_template, tools)
    responses = np.full((len(rows), max_response_length), tokenizer.pad_token_id, np.int32)
    response_mask = np.zeros_like(responses)
    attention_mask = np.zeros_like(responses)
    template = None
    for i, row in enumerate(rows):
        shown = demonstration(row)
        if isinstance(shown, str):
            ids = tokenizer.encode(shown) + [tokenizer.eos_token_id]
            trained = [1] * len(ids)
        else:
            template = template or multi_turn.TurnTemplate(tokenizer)
            ids, trained = multi_turn.demonstration_tokens(tokenizer, shown, template)
        if len(ids) > max_response_length:
            raise ConfigError(f"the warm start's answer for training row {i + 1} (its "
                              f"demonstration and the end token) needs {len(ids)} tokens, "
                              f"more than rollout.response_length={max_response_length}; "
                              f"set --config.rollout.response_length={len(ids)} or more")
        responses[i, : len(ids)] = ids
        response_mask[i, : len(ids)] = trained
        attention_mask[i, : len(ids)] = 1
    return prompt_ids, prompt_mask, responses, response_mask, attention_mask


def demonstration(row: Row) -> str | list:
    """The response SFT imitates: `extra_info["demonstration"]` if set (a string, or a
    multi-turn list of assistant and tool messages), else the ground truth."""
    shown = (row.get("extra_info") or {}).get("demonstration", ground_truth(row))
    return shown if isinstance(shown, list) else str(shown)


def sft_loss(params, batch, *, model: ModelConfig):
    """Token-mean negative log-likelihood of the responses' trained tokens."""
    log_probs, _ = logprobs.response_log_probs(
        params, batch["prompt_ids"], batch["prompt_mask"], batch["responses"],
        batch["attention_mask"], config=model)
    return -masks.masked_mean(log_probs, batch["response_mask"])


def sft_update(state: update.ModelState, batch, *, model: ModelConfig,
               optimizer: optax.GradientTransformation):
    """One optimizer step on a batch: (new state, the loss before it)."""
    loss, grads = jax.value_and_grad(sft_loss)(state.params, batch, model=model)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    return update.ModelState(optax.apply_updates(state.params, updates), opt_state), loss


sft_step = jax.jit(sft_update, static_argnames=("model", "optimizer"), donate_argnums=0)


def sft_optimizer(lr: float, lr_warmup_steps: int) -> optax.GradientTransformation:
    """AdamW whose rate rises linearly from 0 over `lr_warmup_steps`, then stays at `lr`."""
    if lr_warmup_steps < 0:
        raise ConfigError(f"sft.lr_warmup_steps must be >= 0, got {lr_warmup_steps}")
    schedule = optax.linear_schedule(0.0, lr, lr_warmup_steps) if lr_warmup_steps else lr
    return optax.adamw(schedule, weight_decay=0.0)


def train_sft(params, rows: list[Row], tokenizer, *, model: ModelConfig, steps: int,
              batch_size: int, lr: float, max_prompt_length: int, max_response_length: int,
              seed: int = 0, lr_warmup_steps: int = 0, apply_chat_template: bool = False,
              log_every: int = 0,
              sharder: sharding_lib.Sharder | None = None, tools=None):
    """Runs `steps` AdamW steps on random batches of `rows`; returns the new params.

    The learning rate rises linearly from 0 over `lr_warmup_steps`, then stays at `lr`.

    With a `sharder`, batches are split over its batch axes and the optimizer state
    follows the parameters' shardings.
    """
    if batch_size > len(rows):
        raise ConfigError(f"sft.batch_size={batch_size}: more than the {len(rows)} training "
                          "rows (the warm start draws a batch without replacement); set "
                          f"--config.sft.batch_size to at most {len(rows)}")
    optimizer = sft_optimizer(lr, lr_warmup_steps)
    if sharder is None:
        state = update.ModelState(params, optimizer.init(params))
        put, context = (lambda batch: jax.tree.map(jnp.asarray, batch)), contextlib.nullcontext()
    else:
        sharder.check_batch(batch_size, "sft.batch_size")
        param_shardings = jax.tree.map(lambda x: x.sharding, params)
        opt_shardings = sharder.opt_state(optimizer, params, param_shardings)
        state = update.ModelState(
            params, jax.jit(optimizer.init, out_shardings=opt_shardings)(params))
        put, context = sharder.put_batch, sharder.active()
    with context:
        return _sft_loop(state, rows, tokenizer, optimizer, put, model=model, steps=steps,
                         batch_size=batch_size, max_prompt_length=max_prompt_length,
                         max_response_length=max_response_length, seed=seed,
                         apply_chat_template=apply_chat_template, log_every=log_every,
                         tools=tools)


def _sft_loop(state, rows, tokenizer, optimizer, put, *, model, steps, batch_size,
              max_prompt_length, max_response_length, seed, apply_chat_template, log_every,
              tools):
    examples = encode_examples(tokenizer, rows, max_prompt_length, max_response_length,
                               apply_chat_template, tools)
    rng = np.random.default_rng(seed)
    for step in range(steps):
        pick = rng.choice(len(rows), size=batch_size, replace=False)
        batch = put(dict(zip(("prompt_ids", "prompt_mask", "responses", "response_mask",
                              "attention_mask"), (x[pick] for x in examples), strict=True)))
        state, loss = sft_step(state, batch, model=model, optimizer=optimizer)
        # One step in flight at a time: on a CPU with more (fake) devices than cores, steps
        # queued behind each other can deadlock in their all-reduces.
        loss = float(loss)
        if not np.isfinite(loss):
            raise NonFiniteLossError(
                f"sft step {step + 1} of {steps}: the loss is {loss}; the warm start stopped. "
                "Check that the tokenizer matches the model (token ids below its vocab_size; "
                "tokenizer.* and model.path), or lower sft.lr")
        if log_every and (step + 1) % log_every == 0:
            print(f"sft step {step + 1}/{steps}: loss {loss:.4f}", flush=True)
        interrupt.check(0)  # Ctrl-C: RL has not started; the warm start is not kept
    return state.params


def check_stored(directory: str, stored: dict, wanted: dict) -> None:
    """Stops when the warm start stored in `directory` was made with settings other than
    `wanted` (flattened config keys), listing the changed keys."""
    changes = rundir.changed_keys(stored, wanted, ignore=())
    if changes:
        raise RunDirError(
            f"{directory} holds a warm start made with other settings; changed keys, "
            f"old -> new:\n{rundir.format_changes(changes)}\nPass a new --workdir, or "
            "--config.trainer.resume_mode=disable to replace it.")


def warm_start(experiment_settings: ExperimentSettings, workdir, model, params, tokenizer,
               train_rows, sharder=None, *, config_keys: dict):
    """Runs the supervised warm start of the `sft` settings, or restores the workdir's.

    A stored warm start is reused only when the settings it was made with,
    `config_keys` (the `rundir.warm_start_settings` of this config: seed, tokenizer,
    model, sft, data), equal this config's; otherwise this stops with the changed keys.
    """
    directory = os.path.join(workdir, "sft")
    ckpt = Checkpointer(directory)
    sft_settings, data = experiment_settings.sft, experiment_settings.data
    steps = sft_settings.steps
    try:
        step = ckpt.latest_step()
        if step is not None:
            meta = ckpt.read_meta(step)
            # Warm starts saved before their settings were recorded carry only `steps`.
            stored = meta.get("settings") or {"sft.steps": meta.get("steps")}
            current = config_keys if "settings" in meta else {
                k: config_keys.get(k) for k in stored}
            check_stored(directory, stored, current)
            if jax.process_index() == 0:
                print(f"sft: reusing the warm start in {directory} ({meta.get('steps')} steps)",
                      flush=True)
            return ckpt.restore(step, params)[0]
        if jax.process_index() == 0:
            print(f"sft: {steps} steps, batch {sft_settings.batch_size}", flush=True)
        params = train_sft(params, train_rows, tokenizer, model=model, steps=steps,
                           batch_size=sft_settings.batch_size, lr=sft_settings.lr,
                           max_prompt_length=data.max_prompt_length,
                           max_response_length=sft_settings.max_response_length,
                           seed=experiment_settings.seed,
                           lr_warmup_steps=sft_settings.lr_warmup_steps,
                           apply_chat_template=data.apply_chat_template,
                           log_every=max(steps // 5, 1), sharder=sharder,
                           tools=experiment_settings.prompt_tools)
        ckpt.save(steps, params, {"steps": steps, "settings": config_keys})
        return params
    except UnreadableCheckpoint as err:
        raise unreadable_warm_start(err, directory) from err
    finally:
        ckpt.close()


def unreadable_warm_start(err: UnreadableCheckpoint, directory: str) -> CheckpointError:
    """A stored warm start that could not be read, and how to make it again."""
    return CheckpointError(f"{err}; remove {directory} to run the warm start again")


def main(argv):
    """`python -m jrl.sft --config=configs/x.py --workdir=...`: the warm start alone."""
    del argv
    from absl import logging

    from jrl import cli

    logging.set_verbosity(logging.WARNING)
    config = cli.required_config()
    experiment_settings = settings.experiment_from_config(config)
    experiment_settings.sft.check_steps()
    workdir = cli.WORKDIR.value or "runs/sft"
    with rundir.locked(workdir):
        tokenizer = experiment.build_tokenizer(experiment_settings)
        train_rows, _ = experiment.build_data(experiment_settings, tokenizer)
        model, params = experiment.build_model(experiment_settings, tokenizer)
        checkpointer = Checkpointer(os.path.join(workdir, "sft"))
        existing = checkpointer.latest_step()
        checkpointer.close()
        # An existing warm start is checked against this config (an error if it differs).
        warm_start(experiment_settings, workdir, model, params, tokenizer, train_rows,
                   config_keys=rundir.warm_start_settings(config))
    if existing is None:
        print(f"saved the warm-started parameters under {workdir}/sft")
    else:
        print(f"{workdir}/sft already holds this warm start; nothing to train (a new --workdir "
              "makes another)")


if __name__ == "__main__":
    from absl import flags

    from jrl import cli

    flags.adopt_module_key_flags(cli)  # --help lists --config, --workdir and --debug
    cli.run(main)
