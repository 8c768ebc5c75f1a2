"""The RL step's programs on a mesh: `jrl.rl.step`'s functions jitted with the shardings of
their inputs and outputs, and compiled ahead of the first step.

The shardings come from the parameters' logical axes (`jrl.models.param_logical_axes`)
and the mesh's rules (`jrl.sharding.Sharder`): the actor's parameters and optimizer
state, the critic's, the train state they make up, the LoRA base apart from the
adapters that train, the actor's weights gathered over `fsdp` for the rollout, and a
copy of them on the sampling group (one-step asynchronous training). `Programs` jits
`step.init` (the actor's initial parameters donated), `step.forward`, `step.learn` (the
state donated) and `step.generate` per sampling setting; `compile_traced` compiles
traced programs at once, in threads. The reports (`memory_report`, `packing_report`,
`prompt_sharing_report`) say how the programs lay the step out on the devices.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jrl import sharding as sharding_lib
from jrl.config.settings import Settings
from jrl.models import CACHE_LOGICAL_AXES, lora, param_logical_axes
from jrl.models.cache import layer_slots
from jrl.models.config import ModelConfig
from jrl.optim import make_optimizer
from jrl.rl import logprobs, packing, types
from jrl.rl import step as step_lib
from jrl.rl.update import ModelState
from jrl.rollout import paged, segments
from jrl.rollout.sampler import Prefix, SamplingConfig, cache_slots, compiler_options


class Programs:
    """`jrl.rl.step`'s functions jitted for a mesh, with the shardings they read and write.

    Args:
      settings: validated static settings.
      model_config: the architecture of actor, reference and critic.
      actor_params: the actor's initial parameters (only their shapes are read).
      sharder: the training mesh and its rules.
      rollout_sharder: the sampling group's mesh (one-step asynchronous training), or
        None (the training devices also sample).
    """

    def __init__(self, settings: Settings, model_config: ModelConfig, actor_params,
                 sharder: sharding_lib.Sharder,
                 rollout_sharder: sharding_lib.Sharder | None = None):
        self.settings, self.model_config = settings, model_config
        self.sharder, self.rollout_sharder = sharder, rollout_sharder
        # The rollout on the training devices: rows split over `context` as well, tokens
        # whole (`Sharder.for_rollout`); the training sharder itself without `context`.
        self.sampling_sharder = sharder.for_rollout()
        self._build_shardings(jax.eval_shape(lambda p: p, actor_params))
        self._build_programs()

    # -- shardings -----------------------------------------------------------------------------

    def _build_shardings(self, full_shapes) -> None:
        """Shardings of parameters, optimizer states and the train state from their
        logical axes; the rollout reads the actor's weights gathered over `fsdp`."""
        sharder, model_config = self.sharder, self.model_config
        self.actor_opt = make_optimizer(self.settings.actor.optim)
        self.full_shardings = sharder.params(param_logical_axes(model_config, "lm"), full_shapes)
        # With LoRA the state trains the adapters; the frozen base is apart.
        base_shapes, shapes = full_shapes, full_shapes
        self.frozen_shardings, self.actor_shardings = None, self.full_shardings
        if model_config.lora_rank:
            base_shapes, shapes = lora.split(full_shapes)
            self.frozen_shardings, self.actor_shardings = lora.split(self.full_shardings)
        actor = ModelState(self.actor_shardings,
                           sharder.opt_state(self.actor_opt, shapes, self.actor_shardings))
        self.rollout_shardings = None
        if sharder.mesh.shape["fsdp"] > 1:
            gathered = sharding_lib.Sharder(sharder.mesh, sharder.rules_without("fsdp"))
            self.rollout_shardings = gathered.params(param_logical_axes(model_config, "lm"),
                                                     full_shapes)
        self.state_shardings = types.TrainState(
            step=sharder.replicated, actor=actor, critic=self._critic_shardings(base_shapes),
            kl=sharder.replicated)
        self.sampler_shapes, self.sampler_shardings = None, None
        if self.rollout_sharder is not None:  # the sampling group's copy of the weights
            self.sampler_shapes = jax.eval_shape(
                lambda p: step_lib.sampling_params(p, model_config)[1], full_shapes)
            self.sampler_shardings = self.rollout_sharder.params(
                param_logical_axes(step_lib.sampling_model(model_config), "lm"),
                self.sampler_shapes)

    def _critic_shardings(self, base_shapes) -> ModelState | None:
        """The critic's parameter and optimizer-state shardings (None without a critic);
        `base_shapes`: the backbone it starts from (the LoRA base with adapters)."""
        self.critic_opt = None
        if self.settings.critic is None:
            return None
        self.critic_opt = make_optimizer(self.settings.critic.optim)
        critic_model = step_lib.critic_model(self.model_config, self.settings)
        lora_model = critic_model if critic_model.lora_rank else None
        critic_shapes = jax.eval_shape(
            functools.partial(step_lib.init_critic, lora_model=lora_model), base_shapes,
            jax.random.key(0))
        axes = param_logical_axes(critic_model, "value")
        if lora_model is not None:  # the trained part: adapters and the value head
            axes = {**lora.split(axes)[1], "value_head": axes["value_head"]}
        shardings = self.sharder.params(axes, critic_shapes)
        return ModelState(shardings,
                          self.sharder.opt_state(self.critic_opt, critic_shapes, shardings))

    # -- programs ------------------------------------------------------------------------------

    def _build_programs(self) -> None:
        """`step.init`, `step.forward` and `step.learn` jitted with the mesh's shardings
        (the actor's initial parameters donated to `init`, the state to `learn`);
        `step.generate` is jitted per sampling setting (`generator`)."""
        settings, model_config = self.settings, self.model_config
        batch, replicated = self.sharder.batch(), self.sharder.replicated
        states, frozen = self.state_shardings, self.frozen_shardings
        optimizers = dict(settings=settings, actor_opt=self.actor_opt,
                          critic_opt=self.critic_opt)
        ref = (frozen or self.actor_shardings) if settings.needs_reference else None
        self.init = jax.jit(
            functools.partial(step_lib.init, **optimizers, model_config=model_config),
            in_shardings=(self.actor_shardings, replicated, frozen), out_shardings=states,
            donate_argnums=0)
        self.forward = jax.jit(
            functools.partial(step_lib.forward, settings=settings, model_config=model_config),
            in_shardings=(states, ref, batch, frozen), out_shardings=batch)
        self.learn = jax.jit(
            functools.partial(step_lib.learn, **optimizers, model_config=model_config,
                              critic_warmup=settings.trainer.critic_warmup),
            in_shardings=(states, batch, replicated, frozen), out_shardings=(states, replicated),
            donate_argnums=0)
        self._generators: dict[tuple, Callable] = {}
        self.rollout_params = jax.jit(
            functools.partial(step_lib.rollout_params, model_config=model_config,
                              param_shardings=self.rollout_shardings),
            in_shardings=(states, frozen))
        self.step_keys = jax.jit(step_lib.step_keys)

    def generator(self, sampling: SamplingConfig, group: bool = False) -> Callable:
        """`step.generate` for `sampling`, jitted with the mesh's shardings and the
        sampler's compiler options (`rollout.compiler_options`); with `group`,
        `step.generate_from` on the sampling group. One program a sampling setting."""
        key = (sampling, group)
        if key not in self._generators:
            self._generators[key] = self._jit_generator(sampling, group)
        return self._generators[key]

    def continuer(self, sampling: SamplingConfig, max_steps: int,
                  keep_cache: bool = False) -> Callable:
        """`step.continue_rows` for `sampling` (n 1) and `max_steps`, jitted as the
        rollout is (partial rollouts' rounds, on the training devices), the previous
        round's cache (`sampler.Carried`, or None) its last argument (not donated: its
        shape is the previous round's prefix width's); with `keep_cache`, its own
        returned. A program a setting, prefix width, and for rounds
        with a cache and without."""
        key = ("continue", sampling, max_steps, keep_cache)
        if key not in self._generators:
            batch = self.sharder.batch()
            self._generators[key] = jax.jit(
                functools.partial(step_lib.continue_rows, sampling=sampling,
                                  model_config=self.model_config, max_steps=max_steps,
                                  keep_cache=keep_cache,
                                  param_shardings=self.rollout_shardings),
                in_shardings=(self.state_shardings, batch, batch, batch,
                              self.frozen_shardings, batch),
                out_shardings=batch, compiler_options=compiler_options(sampling))
        return self._generators[key]

    def _jit_generator(self, sampling: SamplingConfig, group: bool) -> Callable:
        if group:
            batch = self.rollout_sharder.batch()
            return jax.jit(
                functools.partial(step_lib.generate_from, sampling=sampling,
                                  model_config=self.model_config),
                in_shardings=(self.sampler_shardings, batch, batch,
                              self.rollout_sharder.replicated),
                out_shardings=batch, compiler_options=compiler_options(sampling))
        batch = self.sharder.batch()
        return jax.jit(
            functools.partial(step_lib.generate, sampling=sampling,
                              model_config=self.model_config,
                              param_shardings=self.rollout_shardings),
            in_shardings=(self.state_shardings, batch, batch, self.sharder.replicated,
                          self.frozen_shardings),
            out_shardings=batch, compiler_options=compiler_options(sampling))

    # -- the step's layout ---------------------------------------------------------------------

    @property
    def batch_sequences(self) -> int:
        """The sequences of a step's batch: its prompts times `rollout.n`."""
        return self.settings.train_batch_size * self.settings.rollout.n

    @functools.cached_property
    def prompt_groups(self) -> dict[str, int]:
        """Rows that share a prompt's forward in each of the step's passes
        (`step.prompt_groups`; all 1 with `actor.share_prompts` off)."""
        with self.sharder.active():
            return step_lib.prompt_groups(self.settings, self.batch_sequences)

    @functools.cached_property
    def _prompt_mismatch(self):
        return jax.jit(logprobs.prompt_mismatch, static_argnums=2)

    def check_shared_prompts(self, rollout: types.Rollout, step: int) -> None:
        """Stops before any pass of step `step` runs when the rows that share a prompt's
        forward do not hold the same prompt (ids and mask)."""
        group = max(self.prompt_groups.values())
        if group == 1:
            return
        mismatched = int(sharding_lib.host_array(self._prompt_mismatch(
            rollout.prompt_ids, rollout.prompt_mask, group)))
        if mismatched:
            raise ValueError(
                f"step {step}: {mismatched} rows of the batch do not hold the prompt of "
                f"the first row of their group of {group} rows, which actor.share_prompts "
                "needs (the log-prob, value and update passes read each group's prompt from "
                "its first row); lay the rollout.n samples of a prompt out as consecutive "
                "rows with the same prompt ids and mask, or set actor.share_prompts=False")

    # -- tracing ahead of the first step -------------------------------------------------------

    def trace_step(self, state: types.TrainState, ref_params, frozen, root_key,
                   needs_baseline: bool) -> dict[str, jax.stages.Traced]:
        """The step's programs traced on the shapes it will give them, by name: its
        rollout ("generate"; with partial rollouts, the rounds' programs,
        `trace_continuers`), "forward", ReMax's greedy rollout ("generate_greedy", with
        `needs_baseline`) and "learn". Traced under the training mesh's rules (the
        caller's `Sharder.active`), as the step traces them."""
        settings, filter_groups = self.settings, self.settings.filter_groups
        key, gen_key = self.step_keys(root_key, state.step)
        prompts = settings.train_batch_size if filter_groups is None else \
            filter_groups.gen_batch_size
        if settings.partial_tokens is not None:  # rounds of continued rows on the host
            traced = self.trace_continuers(state, frozen)
            out = continued_rollout(self.batch_sequences, settings.max_prompt_length,
                                            settings.rollout.max_new_tokens,
                                            settings.rollout.do_sample, self._batch_struct)
        else:
            traced = {"generate": self.trace_rollout(state, frozen, settings.rollout,
                                                     prompts, gen_key)}
            out = traced["generate"].out_info
        if filter_groups is not None:  # the batch DAPO's rounds fill on the host
            out = jax.tree.map(lambda x: self._batch_struct(
                (self.batch_sequences, *x.shape[1:]), x.dtype), out)
        traced["forward"] = self.forward.trace(state, ref_params, out, frozen)
        n, r = out.responses.shape
        host = dict(token_level_scores=self._batch_struct((n, r), jnp.float32),
                    uid=self._batch_struct((n,), jnp.int32))
        if needs_baseline:  # over the step's prompts (`Rollouts.rewards`)
            greedy = dataclasses.replace(settings.rollout, n=1, do_sample=False)
            traced["generate_greedy"] = self.trace_rollout(state, frozen, greedy,
                                                           settings.train_batch_size, gen_key)
            host["reward_baselines"] = self._batch_struct((n,), jnp.float32)
        exp = traced["forward"].out_info.replace(**host)
        traced["learn"] = self.learn.trace(state, exp, key, frozen)
        return traced

    def trace_continuers(self, state: types.TrainState, frozen) -> dict[str, jax.stages.Traced]:
        """Partial rollouts' round programs (`continuer`, no cache handed in), one for each
        prefix width a round may take (`partial.prefix_widths`), traced on the decode rows
        the rounds give them, by name ("continue_W" for width W)."""
        settings = self.settings
        sampling = dataclasses.replace(settings.rollout, n=1)
        budget, num_new = settings.partial_tokens, sampling.max_new_tokens
        rows = self.batch_sequences
        ids = self._batch_struct((rows, settings.max_prompt_length), jnp.int32)
        key_data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
        flags = self._batch_struct((rows,), jnp.bool_)
        program = self.continuer(sampling, budget, settings.partial_keep_cache)
        traced = {}
        with self.sampling_sharder.active():  # as the rounds trace it
            for width in prefix_widths(budget, num_new):
                prefix = Prefix(
                    responses=self._batch_struct((rows, width), jnp.int32),
                    log_probs=self._batch_struct((rows, width), jnp.float32),
                    lengths=self._batch_struct((rows,), jnp.int32), finished=flags,
                    keys=self._batch_struct((rows, *key_data.shape), key_data.dtype),
                    cached=flags)
                traced[f"continue_{width}"] = program.trace(state, ids, ids, prefix, frozen,
                                                            None)
        return traced

    def trace_rollout(self, state: types.TrainState, frozen, sampling: SamplingConfig,
                      prompts: int, key) -> jax.stages.Traced:
        """The rollout program of `sampling` traced for `prompts` prompts and `key` as
        the caller passes it: the step's from a program, the validation's made eagerly
        (jit tells the two apart, so with the same sampling and rows, ReMax's greedy
        rollout and a greedy validation are two programs)."""
        ids = self._batch_struct((prompts, self.settings.max_prompt_length), jnp.int32)
        with self.sampling_sharder.active():  # as the rollout traces it
            return self.generator(sampling).trace(state, ids, ids, key, frozen)

    def _batch_struct(self, shape, dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self.sharder.batch(len(shape)))


def prefix_width(longest: int, budget: int, num_new: int) -> int:
    """A round's prefix columns for a longest row of `longest` tokens: its tokens in a
    power of two of rounds of `budget` tokens, at most R = `num_new`, so a few programs
    serve every round (each prefills a row over about its own tokens,
    `sampler.continue_rows`) while the cache, which every prefill chunk attends over,
    grows with the rows."""
    rounds = -(-longest // budget)
    return min(budget * (1 << (rounds - 1).bit_length()), num_new) if rounds else 0


def prefix_widths(budget: int, num_new: int) -> list[int]:
    """Every width `prefix_width` gives for a row still running (fewer than R tokens):
    0, then `budget` doubled while below R - 1 tokens' rounds, capped at R."""
    longest = [*range(0, num_new, budget), num_new - 1]  # each round count, and the most
    return sorted({prefix_width(n, budget, num_new) for n in longest})


def continued_rollout(rows: int, prompt_len: int, num_new: int, do_sample: bool,
                      struct) -> types.Rollout:
    """The step's `Rollout` of `rows` rows as the rounds give it to the passes after them
    (`PartialExperience._batch`), each array as `struct(shape, dtype)` makes it."""
    ids = struct((rows, prompt_len), jnp.int32)
    responses = struct((rows, num_new), jnp.int32)
    return types.Rollout(prompt_ids=ids, prompt_mask=ids, responses=responses,
                         response_mask=responses,
                         rollout_log_probs=struct((rows, num_new), jnp.float32)
                         if do_sample else None)


def compile_traced(traced: dict[str, jax.stages.Traced]) -> list[str]:
    """Lowers the traced programs one after another (lowering is Python's), `learn` first
    (the slowest to compile), each handed to a thread that compiles it while the next
    lowers (XLA compiles outside the GIL); returns their names in that order once all
    have compiled (a compile's error raised here). jit's cache then holds them for the
    calls of the step."""
    order = sorted(traced, key=lambda name: name != "learn")
    with concurrent.futures.ThreadPoolExecutor(len(order), "jrl-compile") as pool:
        compiles = [pool.submit(traced[name].lower().compile) for name in order]
        for done in compiles:
            done.result()
    return order


# -- reports -------------------------------------------------------------------------------------


def prompt_sharing_report(programs: Programs) -> str:
    """One line: how many rows share a prompt's forward in each pass, and why none do
    when sharing is on but no micro-batch allows it."""
    settings, sharder = programs.settings, programs.sharder
    if not settings.share_prompts:
        return "shared prompts: off (actor.share_prompts=False)"
    line = "shared prompts, rows per prompt forward: " + ", ".join(
        f"{name} {k}" for name, k in programs.prompt_groups.items())
    if max(programs.prompt_groups.values()) > 1:
        return line
    if sharder.context > 1:
        return line + (f" (none: mesh.context={sharder.context} splits the plain layout "
                       "only)")
    return line + (f" (none: in every pass the rows a micro-batch puts on each of the "
                   f"{sharder.batch_size_multiple} batch shards have no factor above 1 "
                   f"in common with rollout.n={settings.rollout.n})")


def packing_report(settings: Settings, sharder: sharding_lib.Sharder,
                   with_reference: bool) -> str | None:
    """One line: the packed rows each batch shard runs per micro-batch in every pass
    with token-budget micro-batches (None: no pass packs; `mesh.context` splits each
    row over its devices). A budget of one row runs one full-length sequence a
    micro-batch. `with_reference`: `step.forward` runs the reference's pass."""
    names = {"rollout": "log-prob/value passes", "actor": "actor update",
             "critic": "critic update"}
    forward_runs = bool(step_lib.forward_passes(settings, with_reference))
    passes = [(names[key.split(".")[0]], key, budget, n)
              for key, budget, n in settings.token_budgets()
              if forward_runs or not key.startswith("rollout.")]
    if not passes:
        return None
    length = packing.row_length(settings.max_sequence_length, sharder.context)
    shards = sharder.batch_size_multiple
    rows = {name: packing.rows_per_device(budget, length, n, shards)
            for name, _, budget, n in passes}
    line = f"token-budget micro-batches, rows of {length} slots: " + ", ".join(
        f"{name} {rows[name]} ({key}={budget})" for name, key, budget, _ in passes)
    single = [key for name, key, _, n in passes if rows[name] == 1 and n > shards]
    if single:
        line += (f"; one row a micro-batch runs one full-length sequence: "
                 f"{2 * length} tokens or more in "
                 f"{', '.join(single)} give two (docs/guide.md, 'Long responses')")
    return line


def memory_report(programs: Programs, state: types.TrainState, frozen, ref_params) -> str:
    """Per-device bytes of parameters, optimizer states and the rollout's KV cache."""
    sharder, model_config = programs.sharder, programs.model_config
    states = programs.state_shardings
    parts = [("actor params", state.actor.params, states.actor.params),
             ("actor optimizer", state.actor.opt_state, states.actor.opt_state)]
    if frozen is not None:
        parts.append(("frozen base (LoRA; the reference)", frozen, programs.frozen_shardings))
        if model_config.lora_rollout == "merged":
            kernels = lambda tree: {g: {n: tree["layers"][g][n] for n in tree["layers"][g]
                                        if n in model_config.lora_targets}
                                    for g in ("attn", "mlp")}
            parts.append(("merged kernels (during rollouts)", kernels(frozen),
                          kernels(programs.frozen_shardings)))
    elif ref_params is not None:
        parts.append(("reference params", ref_params, programs.actor_shardings))
    if state.critic is not None:
        parts += [("critic params", state.critic.params, states.critic.params),
                  ("critic optimizer", state.critic.opt_state, states.critic.opt_state)]
    parts += _kv_cache_parts(programs)
    lines = [f"mesh {dict(sharder.mesh.shape)} over {sharder.mesh.devices.size} devices; "
             "per device:"]
    for name, tree, shardings in parts:
        nbytes = sharder.bytes_per_device(tree, shardings)
        lines.append(f"  {name:<34} {sharding_lib.format_bytes(nbytes)}")
    return "\n".join(lines)


def _page_pool(programs: Programs, rows: int) -> tuple[str, object, object]:
    """`memory_report`'s part for the paged cache's pool (`jrl.rollout.paged`)."""
    settings, model_config = programs.settings, programs.model_config
    sizes = paged.shape(settings.rollout, rows, settings.max_prompt_length)
    shape = (sizes["pages"], model_config.num_kv_heads, settings.rollout.page_size,
             model_config.head_dim)
    name = (f"KV cache, {sizes['pages']} pages x {settings.rollout.page_size} slots "
            f"({sizes['seqs']} decode slots for {rows} rows)")
    pools = [jax.ShapeDtypeStruct(shape, jnp.dtype(model_config.dtype))] * (
        2 * model_config.num_layers)
    return name, pools, [programs.sampling_sharder.named((None,) * 4, shape)] * len(pools)


def _kv_cache_parts(programs: Programs) -> list[tuple[str, object, object]]:
    """`memory_report`'s (name, shapes, shardings) of the rollout's KV cache, and of the
    sampling group's weights and cache."""
    settings, model_config = programs.settings, programs.model_config
    prompts = settings.train_batch_size if settings.filter_groups is None else \
        settings.filter_groups.gen_batch_size
    rows = prompts * settings.rollout.n
    # A multi-turn rollout's cache also holds one tool block (`jrl.rollout.multi_turn`).
    block = 0 if settings.multi_turn is None else \
        settings.multi_turn.config.max_tool_response_tokens + 1
    slots = cache_slots(model_config, settings.max_sequence_length + block)
    name = f"KV cache, {rows} rows x {slots} slots"
    if settings.rollout.kv_cache == "paged":
        return [_page_pool(programs, rows)]
    if settings.rollout.cache_segments > 1:  # the first segment's; later ones follow the tokens
        first = segments.segment_slots(model_config, settings.max_prompt_length,
                                       settings.rollout)[0]
        name = (f"KV cache, {rows} rows x {first} slots (segment 1 of "
                f"{settings.rollout.cache_segments}; then the rows still running, at most "
                f"{rows} x {slots})")
        slots = first
    # The single-turn program's sliding-window layers keep rings of their window
    # (`jrl.models.cache.init_cache`).
    ring = settings.multi_turn is None and settings.rollout.cache_segments == 1
    per_layer = layer_slots(model_config, slots, ring)
    if per_layer.count(slots) < len(per_layer):
        rings = sorted(set(per_layer) - {slots})
        name += (f" ({len(per_layer) - per_layer.count(slots)} sliding-window layers of "
                 f"{model_config.num_layers}: rings of {', '.join(map(str, rings))} slots)")
    shapes = [(rows, model_config.num_kv_heads, n, model_config.head_dim)
              for n in per_layer for _ in range(2)]
    cache = [jax.ShapeDtypeStruct(shape, jnp.dtype(model_config.dtype)) for shape in shapes]
    parts = [(name, cache,
              [programs.sampling_sharder.named(CACHE_LOGICAL_AXES, s) for s in shapes])]
    if programs.sampler_shardings is not None:  # per device of the sampling group
        parts.append(("sampling group: weights (x2)", programs.sampler_shapes,
                      programs.sampler_shardings))
        rollout_cache = [programs.rollout_sharder.named(CACHE_LOGICAL_AXES, s) for s in shapes]
        parts.append(("sampling group: KV cache", cache, rollout_cache))
    return parts
