"""Many runs in one program: rewards in the graph, steps scanned, runs vmapped.

With a reward that is a JAX function of token ids (`reward.in_graph_fn`,
`jrl.rewards.in_graph`) a whole RL step needs nothing from the host but its prompts:

    rl_step(state, prompts, targets) = generate -> forward -> rewards -> learn  (one program)

`trainer.steps_per_call=K` runs K steps as one `lax.scan` (their prompts drawn on the
host beforehand, the metrics stacked and written after the call), and `trainer.runs`
/ `trainer.sweep` run R independent runs at once, `jax.vmap`ped over a leading runs
axis of the state: each run its own seed (initial weights, warm-start batches,
sampling) and, in a sweep, its own values of the `SWEEPABLE` hyperparameters. All runs
read the same prompts (the data order is `data.seed`'s, as in a single run), so run r is
step for step the run that `seed = seeds[r]` (and its settings) would make alone, up to
the summation order of batched matrix products. `mesh.runs` splits the runs axis over
devices (`RunsMesh`).

The warm start (`sft`) is vmapped too, K steps a call. Metrics carry a `run` field
(`metrics.jsonl`; TensorBoard tags `run<r>/...`); the console shows their mean.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jrl import metrics, sft
from jrl.algos import kl_control
from jrl.app import interrupt, rundir
from jrl.config.settings import SWEEPABLE, ExperimentSettings, Settings, parse_sweep
from jrl.data.dataset import BatchIterator, IteratorState, encode_prompts
from jrl.errors import ConfigError
from jrl.models.config import ModelConfig
from jrl.optim import make_optimizer
from jrl.rewards import in_graph
from jrl.rewards.responses import decode_responses
from jrl.rl import evaluate, update
from jrl.rl import step as step_lib
from jrl.rl.checkpoint import Checkpointer, UnreadableCheckpoint
from jrl.rl.trainer import learn_metrics


def vmapped_model(model_config: ModelConfig) -> ModelConfig:
    """`model_config` as the vmapped programs run it: training attention on XLA where
    "auto" would take cuDNN on a GPU (JAX's cuDNN attention batches neither a vmapped
    mask nor vmapped segment lengths: its batching rule reshapes them per head and per
    row), or splash on a TPU. A forced "cudnn" is refused before the run (`jrl.train`).
    The sampler's decode head on XLA where "auto" would take the kernel: vmapped, the
    kernel has not run on a GPU, and its interpret mode (the CPU's) cannot be vmapped
    (its callbacks are ordered effects)."""
    changes = {name: "xla" for name in ("attention_impl", "decode_head_impl")
               if getattr(model_config, name) == "auto"}
    return dataclasses.replace(model_config, **changes) if changes else model_config


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of a multi-run program: its seed, peak actor learning rate, initial
    in-reward KL coefficient, PPO clip ratio and sampling temperature, and the keys its
    sweep varies."""

    seed: int
    lr: float
    kl_coef: float = 0.0
    clip_ratio: float = 0.2
    temperature: float = 1.0
    swept: tuple[str, ...] = ()

    @property
    def setting(self) -> str:
        """The swept values, e.g. "lr=0.0001" ("" without a sweep)."""
        return " ".join(f"{SWEEPABLE[k]}={getattr(self, SWEEPABLE[k]):g}" for k in self.swept)

    @property
    def label(self) -> str:
        return f"seed={self.seed} {self.setting}".strip()


def plan(settings: Settings) -> list[Run]:
    """The runs of `settings`: `trainer.runs` seeds (`seed`, `seed + 1`, ...) for each
    setting of `trainer.sweep` (its keys' values crossed; settings outer, seeds inner)."""
    trainer = settings.trainer
    sweep = parse_sweep(trainer.sweep)  # checked with the settings (`check_sweep`)
    single = {"actor.optim.lr": settings.actor.optim.lr,
              "algorithm.kl_ctrl.kl_coef": settings.algorithm.kl_coef,
              "actor.clip_ratio": settings.actor.loss.clip_ratio,
              "rollout.temperature": settings.rollout.temperature}
    values = [sweep.get(key, [single[key]]) for key in SWEEPABLE]
    return [Run(settings.experiment.seed + i, lr, kl, clip, temp, tuple(sweep))
            for lr, kl, clip, temp, i in itertools.product(*values, range(trainer.runs))]


def place_scores(scores, response_mask):
    """`jrl.rewards.responses.place_scores` on the device: each score at its row's last
    response token (0 in an empty row)."""
    valid = response_mask > 0
    width = valid.shape[-1]
    last = jnp.where(valid.any(-1), width - 1 - jnp.argmax(valid[:, ::-1], axis=-1), 0)
    return jnp.where(jnp.arange(width) == last[:, None], scores[:, None], 0.0).astype(jnp.float32)


def with_run_settings(settings: Settings, hp: dict) -> Settings:
    """`settings` with the run's own values of the sweepable settings that live in it
    (`hp`: traced scalars by `Run` field). The copies skip the settings' checks, which
    the config's values passed and which cannot look at traced values."""
    if "lr" in hp:  # the schedule's peak (`optim.learning_rate_schedule`)
        optim = _unchecked(settings.actor.optim, lr=hp["lr"])
        settings = _unchecked(settings, actor=_unchecked(settings.actor, optim=optim))
    if "clip_ratio" in hp:
        loss = _unchecked(settings.actor.loss, clip_ratio=hp["clip_ratio"])
        settings = _unchecked(settings, actor=_unchecked(settings.actor, loss=loss))
    if "temperature" in hp:  # the sampler's, and the log-prob passes' that match it
        rollout = _unchecked(settings.rollout, temperature=hp["temperature"])
        settings = _unchecked(settings, rollout=rollout)
    return settings


def _unchecked(settings, **changes):
    """A copy of a frozen settings dataclass with `changes`, without `__post_init__`."""
    out = copy.copy(settings)
    for name, value in changes.items():
        object.__setattr__(out, name, value)
    return out


def rl_step(state, ref, root, hp, batch, *, settings: Settings, model_config: ModelConfig,
            reward: in_graph.InGraphReward, actor_opt, critic_opt):
    """One run's RL step on the device: the trainer's step (`step.run_step`) with the
    reward in the graph. `batch`: prompt ids/mask `[B, P]`, target ids/mask `[B, T]`,
    source `[B]`; `root`: the run's key (`key(seed)`); `hp`: its swept hyperparameters
    (`with_run_settings`)."""
    settings = with_run_settings(settings, hp)
    phases = step_lib.Phases(
        generate=lambda state, batch, key: step_lib.generate(
            state, batch["prompt_ids"], batch["prompt_mask"], key, sampling=settings.rollout,
            model_config=model_config),
        forward=lambda state, rollout: step_lib.forward(
            state, ref, rollout, settings=settings, model_config=model_config),
        rewards=functools.partial(in_graph_rewards, batch=batch, n=settings.rollout.n,
                                  reward=reward),
        learn=functools.partial(step_lib.learn, settings=settings, model_config=model_config,
                                actor_opt=actor_opt, critic_opt=critic_opt,
                                critic_warmup=settings.trainer.critic_warmup))
    state, reward_metrics, learned = step_lib.run_step(
        phases, state, batch, step_lib.step_keys(root, state.step))
    return state, {**learned, **reward_metrics}


def in_graph_rewards(state, rollout, exp, key, *, batch, n: int,
                     reward: in_graph.InGraphReward):
    """`rl_step`'s rewards: the `n` responses to each of the batch's prompts scored
    against its targets, each score on its row's last response token, the group ids;
    and the means of the reward's extra values."""
    del state, key  # (the host's rewards phase samples ReMax's baselines with them)
    prompts = batch["prompt_ids"].shape[0]
    scores, extras = reward.score(
        rollout.responses, rollout.attention_mask(),
        *(jnp.repeat(batch[k], n, axis=0) for k in ("targets", "target_mask", "source")))
    exp = exp.replace(token_level_scores=place_scores(scores, exp.response_mask),
                      uid=jnp.repeat(jnp.arange(prompts, dtype=jnp.int32), n))
    return exp, {f"reward_extra/{k}/mean": v.mean() for k, v in extras.items()}


def rl_steps(states, refs, roots, hps, batches, **kw):
    """K steps (`lax.scan` over the leading axis of `batches`) of R runs (`vmap` over the
    leading axis of `states`, `refs`, `roots`, `hps`); metrics `[K, R]`."""
    one = jax.vmap(functools.partial(rl_step, **kw), in_axes=(0, 0, 0, 0, None))
    return jax.lax.scan(lambda st, batch: one(st, refs, roots, hps, batch), states, batches)


def sft_steps(states, batches, *, model: ModelConfig, optimizer):
    """K warm-start steps of R runs: `batches` `[K, R, ...]`; losses `[K, R]`."""
    one = jax.vmap(functools.partial(sft.sft_update, model=model, optimizer=optimizer))
    return jax.lax.scan(one, states, batches)


def validation_rollouts(states, roots, step, start, batch, *, settings: Settings,
                        model_config: ModelConfig, reward: in_graph.InGraphReward):
    """Every run's validation rollout of one batch of prompts and its in-graph scores,
    sampled with the key the trainer's validation uses."""
    n = settings.validation.n

    def one(state, root):
        key = jax.random.fold_in(jax.random.fold_in(root, 2**31 - 2), step)
        rollout = step_lib.generate(state, batch["prompt_ids"], batch["prompt_mask"],
                                    jax.random.fold_in(key, start),
                                    sampling=settings.validation, model_config=model_config)
        mask = rollout.attention_mask()
        scores, extras = reward.score(
            rollout.responses, mask,
            *(jnp.repeat(batch[k], n, axis=0) for k in ("targets", "target_mask", "source")))
        return rollout.responses, mask, scores, extras

    return jax.vmap(one)(states, roots)


class RunsMesh:
    """The devices the runs are split over (`mesh.runs`): every stacked array's leading
    runs axis sharded over them (a device holds R / devices runs), prompts replicated."""

    def __init__(self, devices: int = 1):
        self.mesh = Mesh(np.asarray(jax.devices()[:devices]), ("runs",))
        self.stacked = NamedSharding(self.mesh, P("runs"))  # [R, ...]
        self.scanned = NamedSharding(self.mesh, P(None, "runs"))  # [K, R, ...]

    @property
    def size(self) -> int:
        return self.mesh.size

    def put(self, tree):
        """`tree`'s stacked leaves (`[R, ...]`) split over the runs' devices."""
        return jax.device_put(tree, self.stacked)


def runs_devices(mesh_runs: int, runs: int) -> int:
    """`mesh.runs` (its value: `mesh_runs`) resolved (-1: every device), checked to divide
    the `runs` runs."""
    count, size = jax.device_count(), int(mesh_runs)
    size = count if size == -1 else size
    if size < 1 or size > count or runs % size:
        raise ConfigError(f"mesh.runs={mesh_runs}: the runs are split over "
                          f"this many of the {count} devices, which must divide the {runs} "
                          f"runs (trainer.runs x the sweep's settings); use 1, -1 or a "
                          "divisor of both")
    return size


class Prompts:
    """The rows' prompts and targets encoded once, as arrays (`[N, ...]`), and batches of
    them by row index."""

    def __init__(self, tokenizer, rows, settings: Settings, chat: bool, sources: list[str]):
        self.rows = rows
        ids, mask = encode_prompts(tokenizer, rows, settings.max_prompt_length, chat, None)
        targets, target_mask, source, _ = in_graph.encode_targets(tokenizer, rows,
                                                                  sources=sources)
        self.arrays = dict(prompt_ids=ids, prompt_mask=mask, targets=targets,
                           target_mask=target_mask, source=source)

    def take(self, index) -> dict[str, np.ndarray]:
        return {k: v[np.asarray(index)] for k, v in self.arrays.items()}


class MultiRunTrainer:
    """R runs of one config trained in one program (the module docstring).

    Args:
      settings: validated settings (with `reward.in_graph_fn`).
      model_config: the architecture.
      params: the runs' initial actor parameters, stacked (`[R, ...]` leaves).
      tokenizer: encodes prompts and targets, decodes validation answers.
      train_rows, val_rows: prompt rows in verl's schema.
      runs: one `Run` per leading index of `params`.
      workdir: checkpoints and metrics.
      apply_chat_template, data_seed: as `jrl.rl.trainer.RLTrainer`'s.
      steps_per_call: RL steps per program call (`trainer.steps_per_call`).
    """

    def __init__(self, settings: Settings, model_config: ModelConfig, params, tokenizer,
                 train_rows, val_rows, runs: list[Run], workdir: str,
                 apply_chat_template: bool = False, data_seed: int = 0,
                 steps_per_call: int = 1, mesh: RunsMesh | None = None):
        self.settings = settings
        mesh = self.mesh = mesh or RunsMesh()
        params = mesh.put(params)
        model_config = vmapped_model(model_config)
        self.model_config, self.tokenizer, self.runs = model_config, tokenizer, runs
        self.steps_per_call, self.data_seed = steps_per_call, data_seed
        self.reward = in_graph.resolve(settings.reward.in_graph_fn, tokenizer)
        sources = sorted({row["data_source"] for row in [*train_rows, *val_rows]})
        self.train = Prompts(tokenizer, train_rows, settings, apply_chat_template, sources)
        self.val = Prompts(tokenizer, val_rows, settings, apply_chat_template, sources) \
            if val_rows else None
        self.actor_opt = make_optimizer(settings.actor.optim)
        self.critic_opt = make_optimizer(settings.critic.optim) \
            if settings.critic is not None else None
        self.roots = mesh.put(jnp.stack([jax.random.key(r.seed) for r in runs]))
        # The swept values a step reads (the KL coefficient is the state's).
        fields = ["lr"] + [SWEEPABLE[k] for k in ("actor.clip_ratio", "rollout.temperature")
                           if k in runs[0].swept]
        self.hps = mesh.put({f: jnp.asarray([getattr(r, f) for r in runs], jnp.float32)
                             for f in fields})
        init = functools.partial(step_lib.init, settings=settings, actor_opt=self.actor_opt,
                                 critic_opt=self.critic_opt, model_config=model_config)
        init_keys = jax.vmap(lambda root: jax.random.fold_in(root, 2**31 - 1))(self.roots)
        copy = lambda p: jax.tree.map(jnp.copy, step_lib.compute_params(p, model_config))
        self.refs = jax.jit(copy, out_shardings=mesh.stacked)(params) \
            if settings.needs_reference else None
        # Each run's in-reward KL coefficient starts at its own value (a sweep's).
        kl = kl_control.KLControlState(mesh.put(jnp.asarray([r.kl_coef for r in runs],
                                                            jnp.float32)))
        self.state = jax.jit(jax.vmap(init), out_shardings=mesh.stacked)(
            params, init_keys).replace(kl=kl)
        self.step, self.data, self._saved_step = 0, IteratorState(), 0
        self._resumed_from: str | None = None  # the resume_path checkpoint started from
        kw = dict(settings=settings, model_config=model_config, reward=self.reward)
        self._steps = jax.jit(functools.partial(
            rl_steps, **kw, actor_opt=self.actor_opt, critic_opt=self.critic_opt),
            out_shardings=(mesh.stacked, mesh.scanned), donate_argnums=0)
        self._validate = jax.jit(functools.partial(validation_rollouts, **kw),
                                 out_shardings=mesh.stacked)
        self.checkpointer = Checkpointer(rundir.checkpoints_dir(workdir),
                                         max_to_keep=settings.trainer.max_ckpt_to_keep)

    @property
    def num_runs(self) -> int:
        return len(self.runs)

    def close(self) -> None:
        self.checkpointer.close()

    # -- checkpoints ---------------------------------------------------------------------------

    def save(self) -> None:
        """Checkpoints every run's state (stacked), the step and the data position."""
        self.checkpointer.save_train_state(self.step, self.state, self.data)
        self._saved_step = self.step

    def _stop_if_asked(self) -> None:
        """Between calls: after Ctrl-C / SIGTERM, checkpoints the last step (unless saved
        already) and raises `interrupt.Stopped`."""
        if interrupt.requested() is None:
            return
        if self.step > 0 and self.step != self._saved_step:
            self.save()
        interrupt.check(self.step, rundir.resume_command(self._resumed_from, self._saved_step))

    def maybe_restore(self, resume_from: str | None = None) -> bool:
        """Continues from a checkpoint: `resume_from` (a `<dir>/<step>` checkpoint directory,
        possibly of another run) or else the workdir's latest complete one, if any."""
        self._resumed_from = resume_from
        with rundir.restoring(self.checkpointer, resume_from,
                              self.settings.total_steps) as (checkpointer, step):
            if step is None:
                return False
            state, self.step, self.data = checkpointer.restore_train_state(
                step, self.state, None)
        self.state = state.replace(step=self.mesh.put(jnp.full((self.num_runs,), self.step,
                                                               jnp.int32)))
        self._saved_step = self.step
        return True

    # -- the loop ------------------------------------------------------------------------------

    def train_steps(self, iterator: BatchIterator, count: int) -> list[list[dict]]:
        """`count` RL steps of every run in one call; per step, each run's metrics."""
        index = [iterator.next_batch() for _ in range(count)]
        batches = jax.tree.map(lambda *x: np.stack(x), *[self.train.take(i) for i in index])
        start = time.perf_counter()
        self.state, stacked = self._steps(self.state, self.refs, self.roots, self.hps, batches)
        stacked = jax.device_get(stacked)  # [K, R] each
        seconds = time.perf_counter() - start
        self.step, self.data = self.step + count, iterator.state
        out = []
        for k in range(count):
            per_run = []
            for r in range(self.num_runs):
                record = learn_metrics({name: v[k, r] for name, v in stacked.items()},
                                       self.settings, self.step - count + k)
                record.update({"timing_s/step": seconds / count,
                               "perf/time_per_step": seconds / count})
                per_run.append(record)
            out.append(per_run)
        return out

    def validate(self, batch_size: int) -> list[dict[str, float]]:
        """Every run's validation metrics (`jrl.rl.evaluate`, with in-graph scores)."""
        rows, n = self.val.rows, self.settings.validation.n
        results = {}

        def respond(run, batch, padded, start):
            if start not in results:
                index = list(range(start, start + len(batch)))
                index += [index[-1]] * (len(padded) - len(batch))
                out = self._validate(self.state, self.roots, self.step, start,
                                     self.val.take(index))
                results[start] = jax.device_get(out)
            responses, mask, scores, extras = results[start]
            count = len(batch) * n
            texts = decode_responses(self.tokenizer, responses[run][:count], mask[run][:count])
            return (scores[run][:count], {k: v[run][:count] for k, v in extras.items()}, 0,
                    texts)

        return [evaluate.evaluate(rows, functools.partial(respond, r), batch_size=batch_size,
                                  n=n) for r in range(self.num_runs)]

    def fit(self, val_batch_size: int, writer: metrics.MetricsWriter | None = None,
            exit_after_steps: int | None = None) -> list[dict[str, float]]:
        """Runs every run to `total_steps` (or `exit_after_steps` more); returns each run's
        last validation metrics."""
        settings, trainer_settings = self.settings, self.settings.trainer
        total = settings.total_steps
        iterator = BatchIterator(list(range(len(self.train.rows))), settings.train_batch_size,
                                 self.data_seed, shuffle=True, state=self.data)
        last = [{} for _ in self.runs]
        if trainer_settings.val_before_train and self.step == 0 and self.val is not None:
            last = self.validate(val_batch_size)
            _write(writer, 0, last)
        end = total if exit_after_steps is None else min(total, self.step + exit_after_steps)
        while self.step < end:
            self._stop_if_asked()
            count = _steps_to_boundary(self.step, end, self.steps_per_call,
                                       (trainer_settings.test_freq, trainer_settings.save_freq))
            for k, per_run in enumerate(self.train_steps(iterator, count)):
                step = self.step - count + k + 1
                if k == count - 1 and self.val is not None and _due(
                        step, trainer_settings.test_freq, total):
                    last = self.validate(val_batch_size)
                    per_run = [{**run_metrics, **val} for run_metrics, val
                               in zip(per_run, last, strict=True)]
                _write(writer, step, per_run)
            if _due(self.step, trainer_settings.save_freq, total):
                self.save()
        return last


def _due(step: int, every: int, total: int) -> bool:
    return bool(every) and (step % every == 0 or step == total)


def _steps_to_boundary(step: int, end: int, most: int, every: tuple[int, ...]) -> int:
    """Steps of the next call: at most `most`, ending at `end` or at the next multiple of
    any of `every` (validation and checkpoints happen between calls)."""
    count = min(most, end - step)
    for e in every:
        if e:
            count = min(count, e - step % e)
    return max(count, 1)


def _write(writer, step: int, per_run: list[dict]) -> None:
    """Each run's metrics under its index; the console shows their mean."""
    if writer is None:
        return
    for r, run_metrics in enumerate(per_run):
        writer.write(step, run_metrics, run=r)
    keys = set.intersection(*(set(run_metrics) for run_metrics in per_run))
    writer.show(step, {k: float(np.mean([run_metrics[k] for run_metrics in per_run]))
                       for k in keys})


# -- warm start ------------------------------------------------------------------------------


def warm_start(experiment_settings: ExperimentSettings, workdir: str, model: ModelConfig,
               params, tokenizer, train_rows, runs: list[Run], steps_per_call: int,
               mesh: RunsMesh | None = None, *, config_keys: dict):
    """Every run's supervised warm start (the `sft` settings), vmapped, `steps_per_call`
    steps a call; or the workdir's, made with the same settings (`config_keys`, as
    `jrl.sft.warm_start`'s) and seeds. Run r's batches are those `jrl.sft.train_sft`
    draws with `seed = runs[r].seed`."""
    directory = os.path.join(workdir, "sft")
    ckpt = Checkpointer(directory)
    sft_settings = experiment_settings.sft
    wanted = {**config_keys, "seeds": [r.seed for r in runs]}
    try:
        step = ckpt.latest_step()
        if step is not None:
            sft.check_stored(directory, ckpt.read_meta(step).get("settings", {}), wanted)
            print(f"sft: reusing the warm starts in {directory}", flush=True)
            return ckpt.restore(step, (mesh or RunsMesh()).put(params))[0]
        print(f"sft: {sft_settings.steps} steps, batch {sft_settings.batch_size}, "
              f"{len(runs)} runs at once", flush=True)
        params = train_sft_runs(params, train_rows, tokenizer, model=vmapped_model(model),
                                experiment_settings=experiment_settings,
                                seeds=[r.seed for r in runs], steps_per_call=steps_per_call,
                                mesh=mesh)
        ckpt.save(sft_settings.steps, params, {"steps": sft_settings.steps, "settings": wanted})
        return params
    except UnreadableCheckpoint as err:
        raise sft.unreadable_warm_start(err, directory) from err
    finally:
        ckpt.close()


def train_sft_runs(params, rows, tokenizer, *, model: ModelConfig,
                   experiment_settings: ExperimentSettings, seeds: list[int],
                   steps_per_call: int, mesh: RunsMesh | None = None):
    """`jrl.sft.train_sft` for each seed at once: `params` stacked per run (split over
    `mesh`'s devices)."""
    sft_settings, data, mesh = experiment_settings.sft, experiment_settings.data, mesh or RunsMesh()
    optimizer = sft.sft_optimizer(sft_settings.lr, sft_settings.lr_warmup_steps)
    examples = sft.encode_examples(tokenizer, rows, data.max_prompt_length,
                                   sft_settings.max_response_length, data.apply_chat_template, None)
    names = ("prompt_ids", "prompt_mask", "responses", "response_mask", "attention_mask")
    rngs = [np.random.default_rng(seed) for seed in seeds]
    state = jax.jit(jax.vmap(lambda p: update.ModelState(p, optimizer.init(p))),
                    out_shardings=mesh.stacked)(mesh.put(params))
    program = jax.jit(functools.partial(sft_steps, model=model, optimizer=optimizer),
                      out_shardings=(mesh.stacked, mesh.scanned), donate_argnums=0)
    done = 0
    while done < sft_settings.steps:
        count = min(steps_per_call, sft_settings.steps - done)
        picks = np.stack([[rng.choice(len(rows), size=sft_settings.batch_size, replace=False)
                           for rng in rngs] for _ in range(count)])  # [K, R, B]
        state, losses = program(state, dict(zip(names, (x[picks] for x in examples),
                                                strict=True)))
        losses = np.asarray(jax.device_get(losses))
        done += count
        if not np.isfinite(losses).all():
            raise sft.NonFiniteLossError(
                f"sft steps {done - count + 1}-{done} of {sft_settings.steps}: a loss is not "
                f"finite (runs {sorted(set(np.nonzero(~np.isfinite(losses))[1].tolist()))}); the "
                "warm start stopped. Lower sft.lr")
        every = max(sft_settings.steps // 5, 1)
        if done // every > (done - count) // every:
            print(f"sft step {done}/{sft_settings.steps}: loss {losses[-1].mean():.4f} "
                  "(mean of runs)", flush=True)
        interrupt.check(0)
    return state.params
