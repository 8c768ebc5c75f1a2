"""Sampling responses from a causal LM: one jitted program, prefill + `lax.while_loop` decode.

`generate` repeats each left-padded prompt `n` times (the samples of a prompt are
adjacent rows), fills a KV cache of `P + R` slots with one forward over the
prompts, then decodes one token per `lax.while_loop` iteration until every row has
emitted a stop token or `R = max_new_tokens` tokens exist. Nothing loops over
tokens in Python and nothing returns to the host until the whole batch is done.

Sampling applies, in this order (as Hugging Face and vLLM do), temperature,
top-k and top-p (nucleus, Holtzman et al. 2019, https://arxiv.org/abs/1904.09751)
to the float32 logits, then draws from the renormalised distribution.
`rollout_log_probs` is the log-probability of each drawn token under that
processed distribution (greedy decoding draws from a point mass: 0).

Top-k and top-p without sorting the vocabulary: with weights `w_i = exp(z_i - max z)`
in [0, 1], both filters keep `{i : w_i >= t}` for a threshold t. For top-k, t is
the largest float32 with `#{w_i >= t} >= k` (the k-th largest weight); for top-p,
the largest with tail mass `sum_{w_i >= t} w_i >= top_p * sum_i w_i` (over the
top-k survivors when both are on). Tail sums are monotone in t, and non-negative
float32 values order like their int32 bit patterns, so t is found exactly by a
search over the 30-bit patterns of [0, 1]: 10 passes, each evaluating 7 probes
with one fused read of the row. That is a few reads of `[N, V]` per step instead
of a sort (about 3x faster at V = 152k on an H200), and it keeps the same tokens
as the sort-based rules except for exact float ties at the boundary, which are
kept together (as Hugging Face's top-k does).

Randomness: row r (of the `B·n` output rows) draws step i with
`fold_in(fold_in(rng, r), i)`, so a row's sample depends only on the key, its
global row index, its prompt and the parameters, not on how the batch is split
across devices or on the other rows.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jrl import sharding
from jrl.kernels import decode_attention, logprob_head
from jrl.models import gemma, moe, transformer
from jrl.models.cache import (
    CACHE_LOGICAL_AXES,
    KVCache,
    RowCache,
    init_cache,
    inverse_rows,
    positions_from_mask,
    take_rows,
)
from jrl.models.config import ModelConfig
from jrl.models.heads import unembed
from jrl.models.transformer import forward
from jrl.sharding import constrain

Params = Mapping[str, Any]

# The sampling keys of the config: set under `rollout.*` for training, and under verl's
# `rollout.val_kwargs.*` for validation.
VAL_KWARGS = ("do_sample", "temperature", "top_p", "top_k", "n")

# Probes per pass of the top-k / top-p threshold search: 7 probes split the
# interval into 8 parts (3 bits a pass, 10 passes for the 30 bits of [0, 1]). Fewer
# probes mean more passes over the row, more probes more work per pass; 3 to 7
# was the fastest on an H200 at V = 152k.
_PROBES_PER_PASS = 7
# `SamplingConfig.gemm`'s values.
GEMMS = ("cublas", "xla")
# `SamplingConfig.kv_cache`'s values.
KV_CACHES = ("contiguous", "paged")
# Continued rows' prefill (`_prefill_by_length`): slices of each batch shard's rows, and
# the columns one forward takes.
PREFILL_SLICES = 8
PREFILL_COLUMNS = 512
# Bit pattern of float32 1.0: weights exp(z - max z) lie in [0, 1].
_FLOAT32_ONE_BITS = 0x3F800000


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How `generate` samples (verl's `actor_rollout_ref.rollout` keys). Hashable: static under jit.

    Attributes:
      n: samples per prompt; the n samples of prompt b are rows `b*n .. b*n + n - 1`.
      max_new_tokens: R, the most tokens generated per row (verl's `response_length`).
      temperature: logits are divided by it; must be > 0 when `do_sample`.
      top_k: keep the k most likely tokens; 0 or -1 turns it off (verl uses -1).
      top_p: keep the smallest set of most likely tokens whose mass reaches top_p;
        1.0 turns it off.
      do_sample: False decodes greedily (argmax); temperature, top_k, top_p are ignored.
      stop_token_ids: a row stops after emitting any of these (e.g. the tokenizer's
        EOS ids, `ModelConfig.eos_token_ids`); empty = never stop early.
      pad_token_id: written after a row has stopped; must be a valid token id.
      ignore_stop: generate all R tokens for every row (benchmarks).
      decode_buckets: how many batch sizes the decode loop may run at: when every
        batch shard's unfinished rows fit the next smaller one (evenly spaced down to
        1/decode_buckets of the rows), they are compacted into it, so finished rows
        stop costing decode steps. 1: the whole batch to the end. Each size compiles
        one more copy of the decode step. No effect with `ignore_stop`.
      cache_segments: decode the response in this many segments, each a program with a
        cache of `P + R (k+1) / cache_segments` slots for only the rows still running,
        so cache memory follows the tokens generated (`jrl.rollout.segments`); the
        host reads the running rows between segments. The same rollout, bit for bit
        on XLA:CPU, at the same decode cost. 1: one program, a cache of
        `P + R` slots for every row. Only outside another jit.
      gemm: on a GPU, how the sampler's programs compile their matmuls: "cublas"
        (each a cuBLAS call; `compiler_options`) or "xla" (XLA's choice, which takes
        Triton GEMM fusions for many of them). No effect off a GPU.
      record_routing: an MoE model's rollout records each token's experts in every
        layer (`RolloutOutput.prompt_routing`, `.response_routing`) for routing replay
        in the training passes. One program only (`cache_segments` 1).
      kv_cache: "contiguous" (every row a cache of `P + R` slots for the whole program)
        or "paged" (`jrl.rollout.paged`: a pool of pages, `max_num_seqs` decode slots
        refilled from the waiting rows as rows stop). The same tokens either way.
      page_size: slots per page of the paged cache.
      num_pages: pages in the paged cache's pool, one of them the trash page; 0: enough
        for every decode slot at full length.
      max_num_seqs: decode slots of the paged cache (rows decoded at once); 0: all rows.
      refill_rows: rows prefilled into freed slots at once (fewer when fewer wait); 0:
        an eighth of the decode slots.
    """

    n: int = 1
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    do_sample: bool = True
    stop_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    ignore_stop: bool = False
    decode_buckets: int = 1
    cache_segments: int = 1
    gemm: str = "cublas"
    record_routing: bool = False
    kv_cache: str = "contiguous"
    page_size: int = 16
    num_pages: int = 0
    max_num_seqs: int = 0
    refill_rows: int = 0

    def __post_init__(self):
        # A list (from a ConfigDict or JSON) would make the config unhashable.
        stops = self.stop_token_ids
        stops = (stops,) if _is_int(stops) else tuple(stops)
        object.__setattr__(self, "stop_token_ids", stops)

    def validate(self, vocab_size: int | None = None, prefix: str = "rollout") -> SamplingConfig:
        """Checks every field; returns self so it can be chained.

        Args:
          vocab_size: V; when given, token ids must lie in `[0, V)`.
          prefix: key path used in error messages.

        Raises:
          ValueError: naming the bad key and what would be valid.
        """
        def fail(key, requirement):
            value = getattr(self, key)
            raise ValueError(f"{prefix}.{key} must be {requirement}, got {value!r}")

        if not _is_int(self.n) or self.n < 1:
            fail("n", "an integer >= 1")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            fail("max_new_tokens", "an integer >= 1")
        if not isinstance(self.do_sample, (bool, np.bool_)):
            fail("do_sample", "True or False")
        if self.do_sample and not (_is_real(self.temperature) and 0 < self.temperature < np.inf):
            fail("temperature", "> 0 (and finite) when do_sample=True; "
                 "use do_sample=False for greedy decoding")
        if not _is_int(self.top_k) or self.top_k < -1:
            fail("top_k", "a positive integer, or 0 / -1 to turn top-k off")
        if not (_is_real(self.top_p) and 0 < self.top_p <= 1):
            fail("top_p", "in (0, 1] (1.0 turns top-p off)")
        valid_id = "a token id in [0, vocab_size)" if vocab_size else "a token id >= 0"
        in_vocab = lambda t: _is_int(t) and 0 <= t < (vocab_size or np.iinfo(np.int32).max)
        if not all(in_vocab(t) for t in self.stop_token_ids):
            fail("stop_token_ids", f"a tuple of token ids, each {valid_id} ({vocab_size=})")
        if not in_vocab(self.pad_token_id):
            fail("pad_token_id", f"{valid_id} ({vocab_size=})")
        if not isinstance(self.ignore_stop, (bool, np.bool_)):
            fail("ignore_stop", "True or False")
        if not _is_int(self.decode_buckets) or self.decode_buckets < 1:
            fail("decode_buckets", "an integer >= 1 (1: no compaction)")
        if not _is_int(self.cache_segments) or not 1 <= self.cache_segments <= max(
                self.max_new_tokens, 1):
            fail("cache_segments", "an integer from 1 (one program) to max_new_tokens "
                 f"(rollout.response_length = {self.max_new_tokens}): each segment decodes "
                 "at least one token")
        if self.gemm not in GEMMS:
            fail("gemm", f"one of {', '.join(map(repr, GEMMS))}")
        if not isinstance(self.record_routing, (bool, np.bool_)):
            fail("record_routing", "True or False")
        if self.record_routing and self.cache_segments > 1:
            fail("cache_segments", "1 when the rollout records its routing (routing replay)")
        if self.kv_cache not in KV_CACHES:
            fail("kv_cache", f"one of {', '.join(map(repr, KV_CACHES))}")
        if not _is_int(self.page_size) or self.page_size < 1:
            fail("page_size", "an integer >= 1")
        for key, zero in (("num_pages", "enough for every decode slot at full length"),
                          ("max_num_seqs", "every row at once"),
                          ("refill_rows", "an eighth of max_num_seqs")):
            if not _is_int(getattr(self, key)) or getattr(self, key) < 0:
                fail(key, f"an integer >= 0 (0: {zero})")
        if self.kv_cache == "paged" and (self.cache_segments > 1 or self.record_routing):
            fail("kv_cache", "'contiguous' with rollout.cache_segments > 1 or routing "
                 "records (actor.router_replay=rollout)")
        return self

    def for_validation(self, **val_kwargs) -> SamplingConfig:
        """Validation sampling: this config with verl's `rollout.val_kwargs` applied.

        Args:
          **val_kwargs: any of `do_sample, temperature, top_p, top_k, n`; None
            values are ignored (inherit). verl's defaults are `do_sample=False,
            temperature=0, top_p=1.0, top_k=-1, n=1` (greedy).

        Returns:
          The validated validation `SamplingConfig`.
        """
        unknown = sorted(set(val_kwargs) - set(VAL_KWARGS))
        if unknown:
            raise ValueError(
                f"rollout.val_kwargs has unknown key(s) {unknown}; "
                f"valid keys are {list(VAL_KWARGS)}"
            )
        overrides = {key: value for key, value in val_kwargs.items() if value is not None}
        return dataclasses.replace(self, **overrides).validate(prefix="rollout.val_kwargs")


@flax.struct.dataclass
class RolloutOutput:
    """What `generate` returns; N = B·n rows, the n samples of a prompt adjacent.

    Attributes:
      prompt_ids: int32 `[N, P]` the prompts, repeated n times, left-padded.
      prompt_mask: int32 `[N, P]` 1 on real prompt tokens.
      responses: int32 `[N, R]` sampled tokens, right-padded with `pad_token_id`
        after the stop token.
      response_mask: int32 `[N, R]` 1 up to and including the stop token.
      rollout_log_probs: float32 `[N, R]` log-prob of each sampled token under the
        processed distribution it was drawn from; 0 on padding and when greedy.
      response_lengths: int32 `[N]` number of response tokens (sum of the mask).
      prompt_routing, response_routing: with `SamplingConfig.record_routing`, each
        prompt and response token's experts in every layer, `[N, P, L, k]` and
        `[N, R, L, k]` (`moe.NOT_RECORDED` on padding and on each row's last response
        token, which is never fed back); else None.
      finished: from `continue_rows`, bool `[N]`: the row has emitted a stop token or
        holds R tokens (else it stopped at the call's step budget, to be continued);
        else None.
      preemptions: from the paged cache (`jrl.rollout.paged`), int32 `[N]`: how many times
        each row gave its pages back and started over; else None.
      page_usage: from the paged cache, float32 `[N]`: the most pages its rows held at
        once, as a fraction of the pool (the trash page aside), the same for every row
        of the call; else None.
      carried: from `continue_rows(keep_cache=True)`, its cache for the next call
        (`Carried`); else None.
    """

    prompt_ids: jax.Array
    prompt_mask: jax.Array
    responses: jax.Array
    response_mask: jax.Array
    rollout_log_probs: jax.Array
    response_lengths: jax.Array
    prompt_routing: jax.Array | None = None
    response_routing: jax.Array | None = None
    finished: jax.Array | None = None
    preemptions: jax.Array | None = None
    page_usage: jax.Array | None = None
    carried: Carried | None = None

    def sequences(self) -> tuple[jax.Array, jax.Array]:
        """Prompt and response side by side: `(ids [N, P+R], mask [N, P+R])`."""
        ids = jnp.concatenate([self.prompt_ids, self.responses], axis=1)
        mask = jnp.concatenate([self.prompt_mask, self.response_mask], axis=1)
        return ids, mask


@flax.struct.dataclass
class _DecodeState:
    """Carry of the decode loop (N rows, R response slots, S = P + R cache slots)."""

    step: jax.Array  # int32 []: index of the next response token to sample
    last_tokens: jax.Array  # int32 [N]: token sampled at step - 1, fed next
    done: jax.Array  # bool [N]: the row has emitted a stop token
    lengths: jax.Array  # int32 [N]: response length (R until the row stops)
    responses: jax.Array  # int32 [N, R]
    log_probs: jax.Array  # float32 [N, R]
    cache: KVCache  # L buffers [N, K, S, H] each for keys and values
    key_mask: jax.Array  # int32 [N, S]: cache slots holding real tokens
    keys: jax.Array  # [N] the rows' PRNG keys (`row_keys`)
    prompt_lengths: jax.Array  # int32 [N]
    rows: jax.Array  # int32 [N]: each row's index among the output rows
    # int32 [N, R, L, k] and [N, P, L, k]: the experts of each response token fed and of
    # each prompt token (`record_routing`), or None.
    routing: jax.Array | None = None
    prompt_routing: jax.Array | None = None
    # int32 [N]: response index of each row's step 0, when continuing begun responses
    # (`continue_rows`); None when every row starts at 0 with the step shared.
    offsets: jax.Array | None = None


def generate(
    params: Params,
    prompt_ids: jax.Array,
    prompt_mask: jax.Array,
    rng: jax.Array,
    sampling: SamplingConfig,
    *,
    config: ModelConfig,
) -> RolloutOutput:
    """Samples `sampling.n` responses per prompt in one compiled program
    (`sampling.cache_segments` > 1, several programs with the host between them, is
    `jrl.rollout.segments.generate`).

    Shard `prompt_ids`/`prompt_mask` over the batch axis (and the parameters as
    the mesh rules say); the computation and the outputs follow those shardings,
    and the samples do not depend on them. Nothing is donated: the parameters are
    still needed by the caller, and the only large buffer, the KV cache, is
    created and updated in place inside the program.

    Args:
      params: causal-LM parameters (`jrl.models.init_params` / `load_pretrained`).
      prompt_ids: int `[B, P]` LEFT-padded prompts.
      prompt_mask: `[B, P]` 1 on real tokens; every row needs at least one.
      rng: PRNG key (typed or raw); the same key gives the same samples.
      sampling: `SamplingConfig` (static).
      config: the model architecture (static).

    Returns:
      `RolloutOutput` with N = B·n rows and R = `sampling.max_new_tokens` columns.

    Raises:
      ValueError: a bad sampling key, `sampling.cache_segments` > 1 (that is
        `jrl.rollout.segments.generate`), or prompts that are not `[B, P]`,
        left-padded, non-empty and within the vocabulary (values are checked when
        the inputs are concrete, before compiling).
    """
    check_inputs(prompt_ids, prompt_mask, sampling, config)
    if sampling.cache_segments > 1:
        raise ValueError(f"rollout.cache_segments={sampling.cache_segments}: decoding in "
                         "segments runs several programs with the host between them; call "
                         "jrl.rollout.segments.generate (outside a jit), or set it to 1")
    if sampling.kv_cache == "paged":
        raise ValueError("rollout.kv_cache='paged': call jrl.rollout.paged.generate, or set "
                         "it to 'contiguous'")
    return call_program(generate_program, (params, prompt_ids, prompt_mask, rng),
                        sampling=sampling, config=config)


def call_program(program, operands, *, sampling: SamplingConfig, **static):
    """`program(*operands, sampling=sampling, **static)`, the keyword arguments static:
    traced in place inside the caller's jit (whose compiler options apply: JAX takes them
    only on the outermost jit), else compiled by `jit_sampler`."""
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(operands)):
        return program(*operands, sampling=sampling, **static)
    jitted = jit_sampler(program, sampling, static_argnames=("sampling", *static))
    return jitted(*operands, sampling=sampling, **static)


def compiler_options(sampling: SamplingConfig, backend: str | None = None) -> dict[str, Any]:
    """XLA options for the sampler's programs on `backend` (default: JAX's): on a GPU
    with `sampling.gemm` "cublas", no Triton GEMM fusions, so every matmul is a cuBLAS
    call; else none.

    A decode step's matmuls have one token per row. On an H200, XLA's Triton GEMM
    fusions for them were slower than cuBLAS: the sampler alone ran 2-5% faster with
    cuBLAS at batch 64-512 and compiled in 7 s instead of 17. The update's large
    matmuls go the other way, so only the sampler's programs take this.
    """
    if sampling.gemm == "cublas" and (backend or jax.default_backend()) == "gpu":
        return {"xla_gpu_enable_triton_gemm": False}
    return {}


def jit_sampler(fun, sampling: SamplingConfig, **jit_kwargs):
    """`jax.jit(fun, **jit_kwargs)` compiled with `compiler_options(sampling)`: one
    jitted function per function, options and arguments (hashable), so repeated calls
    share jit's cache. Call the result outside any jit: JAX takes compiler options
    only on the outermost one (inside another, call `fun` itself)."""
    options = tuple(sorted(compiler_options(sampling).items()))
    return _jit(fun, options, tuple(sorted(jit_kwargs.items())))


@functools.cache
def _jit(fun, options: tuple, jit_kwargs: tuple):
    return jax.jit(fun, compiler_options=dict(options), **dict(jit_kwargs))


def check_inputs(prompt_ids, prompt_mask, sampling: SamplingConfig, config: ModelConfig) -> None:
    """The checks `generate` makes before compiling (for callers that jit `generate_program`)."""
    sampling.validate(config.vocab_size)
    _check_prompts(prompt_ids, prompt_mask, config)
    if (sampling.kv_cache == "paged" and config.decode_attention_impl == "mosaic"
            and not decode_attention.on_tpu()
            and not decode_attention.paged_applies(sampling.page_size, config.head_dim)):
        raise ValueError(
            f"model.decode_attention_impl='mosaic' reads the paged cache's pages in place, "
            f"which needs rollout.page_size a power of two from 8 to "
            f"{decode_attention.max_page(config.head_dim)}, got {sampling.page_size}; set "
            "rollout.page_size=16 (or decode_attention_impl='auto')")


def generate_program(params, prompt_ids, prompt_mask, rng, *, sampling, config
                     ) -> RolloutOutput:
    """The body of `generate` (arguments already checked), to be jitted by the caller
    with its own shardings; shapes as in `generate`."""
    if sampling.kv_cache == "paged":
        raise ValueError("rollout.kv_cache='paged' is the program of jrl.rollout.paged "
                         "(paged.generate, paged.generate_program)")
    row_prompt_ids, row_prompt_mask, state, params = start(params, prompt_ids, prompt_mask,
                                                           rng, sampling, config)
    out, *_ = _decode_to(params, state, state.responses.shape[1],
                        prompt_len=prompt_ids.shape[1], sampling=sampling, config=config)
    if not sampling.record_routing:
        return rollout_output(row_prompt_ids, row_prompt_mask, *out)
    *out, response_routing, prompt_routing = out
    return rollout_output(row_prompt_ids, row_prompt_mask, *out).replace(
        prompt_routing=prompt_routing, response_routing=response_routing)


@flax.struct.dataclass
class Prefix:
    """Responses begun by earlier calls, to be continued (`continue_rows`); N rows.

    Attributes:
      responses: int32 `[N, W]` each row's tokens so far, right-padded (W <= R).
      log_probs: float32 `[N, W]` their rollout log-probs.
      lengths: int32 `[N]` tokens so far, in `[0, W]` (0: a row not begun).
      finished: bool `[N]` the row is complete; it keeps its tokens and draws none.
      keys: `[N]` the rows' PRNG keys (typed, or their key data `[N, ...]`): a row's
        token i is drawn with `fold_in(keys[r], i)` whichever call draws it, so a row
        continued over several calls with the same parameters draws the tokens of one
        call (`row_keys` gives the keys of `generate`'s rows).
      cached: bool `[N]` or None: rows the previous call left in its cache (`Carried`),
        each with every token so far but the last, under the parameters of this call;
        they are prefilled from their last token (None: every row from its first).
    """

    responses: jax.Array
    log_probs: jax.Array
    lengths: jax.Array
    finished: jax.Array
    keys: jax.Array
    cached: jax.Array | None = None


@flax.struct.dataclass
class Carried:
    """A `continue_rows` call's cache, left for the next call under the same parameters
    (`keep_cache`), so that its rows still running are not prefilled again.

    Attributes:
      cache: N rows: the cache of every row still running when the call's `max_steps`
        ran out, as it was then (before the decode loop's later compactions).
      rows: int32 `[N]` the call's row each cache row holds; N where it holds none (a
        row that stopped).
      next_slot: the slot of the last token drawn (not yet fed) of a row that drew the
        call's whole `max_steps`: such a row's tokens so far but that one end just below.
    """

    cache: KVCache
    rows: jax.Array
    next_slot: int = flax.struct.field(pytree_node=False, default=0)


def new_rows(rng, num_rows: int, width: int = 0) -> Prefix:
    """A `Prefix` of `num_rows` rows not begun, keyed as `generate`'s rows are."""
    return Prefix(responses=np.zeros((num_rows, width), np.int32),
                  log_probs=np.zeros((num_rows, width), np.float32),
                  lengths=np.zeros((num_rows,), np.int32),
                  finished=np.zeros((num_rows,), bool), keys=row_keys(rng, num_rows))


def continue_rows(params: Params, prompt_ids: jax.Array, prompt_mask: jax.Array,
                  prefix: Prefix, sampling: SamplingConfig, *, config: ModelConfig,
                  max_steps: int, carried: Carried | None = None,
                  keep_cache: bool = False) -> RolloutOutput:
    """Continues begun responses by at most `max_steps` tokens each, in one program:
    the partial rollout's step (`rollout.partial`).

    Each row's prompt and its tokens so far are prefilled together (under `params`,
    which may be newer than the ones that drew the tokens, as after an update), then
    the rows decode as in `generate` until each has stopped, holds R tokens or has
    drawn `max_steps` more. With the same parameters, a row continued over several
    calls gets the tokens of one `generate` call (its key and token index pick each
    draw) and their log-probs up to rounding (a prefilled token's keys and values are
    computed in one pass rather than one step at a time).

    Args:
      params: causal-LM parameters.
      prompt_ids, prompt_mask: `[N, P]` each row's LEFT-padded prompt (one row per
        sample: `sampling.n` must be 1).
      prefix: the rows' responses so far (`Prefix`; `new_rows` for rows not begun).
      sampling: `SamplingConfig` (static); R = `max_new_tokens`.
      config: the model architecture (static).
      max_steps: the most tokens a row draws in this call (static).
      carried: the previous call's `Carried` cache (`keep_cache`), under the same
        parameters: the rows `prefix.cached` marks (and it holds) are prefilled from
        their last token only. Not used for models with sliding-window layers.
      keep_cache: return this call's cache (`RolloutOutput.carried`) for the next.

    Returns:
      `RolloutOutput` with R columns: the prefix and the new tokens, `response_lengths`
      the tokens so far, `finished` which rows are complete (and `carried`).

    Raises:
      ValueError: bad shapes, `sampling.n` > 1, a setting this path does not take
        (`cache_segments` > 1, `record_routing`), or (on concrete inputs) lengths outside
        `[0, W]` and prompts as `generate` checks them.
    """
    check_inputs(prompt_ids, prompt_mask, sampling, config)
    prefix = _with_typed_keys(prefix)
    _check_prefix(prompt_ids, prefix, sampling, max_steps)
    return call_program(continue_program, (params, prompt_ids, prompt_mask, prefix, carried),
                        sampling=sampling, config=config, max_steps=max_steps,
                        keep_cache=keep_cache)


def continue_program(params, prompt_ids, prompt_mask, prefix: Prefix,
                     carried: Carried | None = None, *, sampling: SamplingConfig,
                     config: ModelConfig, max_steps: int, keep_cache: bool = False
                     ) -> RolloutOutput:
    """The body of `continue_rows` (arguments already checked; the prefix's keys typed or
    as key data), to be jitted by the caller with its own shardings."""
    prefix = _with_typed_keys(prefix)
    num_rows, prompt_len = prompt_ids.shape
    num_new, width = sampling.max_new_tokens, prefix.responses.shape[1]
    steps = min(max_steps, num_new)
    ids, mask, lengths, begun, done = joined_prefix(prompt_ids, prompt_mask, prefix, sampling)
    total = prompt_len + width
    params = per_layer(params, config)
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    responses, log_probs, keys = prefix.responses, prefix.log_probs, prefix.keys
    if width:  # rows of unlike lengths: each prefilled over its own columns, longest first
        groups = _row_groups(num_rows)
        held = _held_rows(carried, prefix.cached, done, num_rows, groups, config)
        # Finished rows draw nothing and rows held in `carried` need their last token:
        # both are prefilled in the last chunk only, after the others, longest first.
        late = done if held is None else done | held[0]
        work = jnp.where(late, 0, jnp.sum(mask, axis=1))
        order = jax.vmap(lambda n: jnp.argsort(-n, stable=True))(_grouped(work, groups))
        take = functools.partial(_take_rows, order=order, groups=groups)
        ids, mask, lengths, begun, done, late, rows, responses, log_probs, keys = map(
            take, (ids, mask, lengths, begun, done, late, rows, responses, log_probs, keys))
        reuse = None
        if held is not None:  # each row's cache row in `carried`, in the rows' new order
            where = _take_rows(held[1], order=order, groups=groups)
            reuse = (jax.tree.map(functools.partial(
                take_rows, index_gr=_grouped(where, groups), axes=CACHE_LOGICAL_AXES,
                mode="fill"), carried.cache), carried.next_slot)
        logits_nv, cache, key_mask, total = _prefill_by_length(params, ids, mask, steps,
                                                               config, groups, late, reuse)
    else:
        logits_nv, cache, key_mask = _prefill(params, ids, mask, steps, config, ring=True)[:3]
    responses, log_probs, out_lengths = begun_outputs(responses, log_probs, lengths, begun,
                                                      done, steps, sampling)
    state = _DecodeState(
        step=jnp.zeros((), jnp.int32),
        last_tokens=jnp.zeros((num_rows,), jnp.int32),
        done=done,
        lengths=out_lengths,
        responses=responses,
        log_probs=log_probs,
        cache=cache,
        key_mask=key_mask,
        keys=keys,
        prompt_lengths=jnp.sum(mask, axis=1),
        rows=rows,
        offsets=lengths,
    )
    state = _emit(state, _from_logits(logits_nv, sampling), sampling)
    (*out, finished), state, kept = _decode_to(params, state, steps, prompt_len=total,
                                               sampling=sampling, config=config,
                                               in_order=not width, keep_cache=keep_cache)
    kept = Carried(*kept, total + steps - 1) if keep_cache else None
    return rollout_output(prompt_ids.astype(jnp.int32), prompt_mask.astype(jnp.int32),
                          *out).replace(finished=finished, carried=kept)


def joined_prefix(prompt_ids, prompt_mask, prefix: Prefix, sampling: SamplingConfig):
    """Each row's prompt and its begun response, left-padded together (each row moved
    right by its prefix's unused columns): `(ids [N, P + W], mask [N, P + W], lengths [N],
    begun [N, W], done [N])`, `lengths` the prefix's tokens, `begun` its columns that
    hold them and `done` the rows that draw nothing (finished, or R tokens)."""
    num_rows, prompt_len = prompt_ids.shape
    width = prefix.responses.shape[1]
    lengths = prefix.lengths.astype(jnp.int32)
    begun = jnp.arange(width)[None, :] < lengths[:, None]
    begun_ids = jnp.where(begun, prefix.responses.astype(jnp.int32), sampling.pad_token_id)
    ids = jnp.concatenate([prompt_ids.astype(jnp.int32), begun_ids], axis=1)
    mask = jnp.concatenate([prompt_mask.astype(jnp.int32), begun.astype(jnp.int32)], axis=1)
    total = prompt_len + width
    source = (jnp.arange(total)[None, :] - (width - lengths)[:, None]) % total
    ids = constrain(jnp.take_along_axis(ids, source, axis=1), ("batch", None))
    mask = constrain(jnp.take_along_axis(mask, source, axis=1), ("batch", None))
    done = prefix.finished.astype(bool) | (lengths >= sampling.max_new_tokens)
    return ids, mask, lengths, begun, done


def begun_outputs(responses, log_probs, lengths, begun, done, steps: int,
                  sampling: SamplingConfig):
    """A continued call's outputs before it draws: the prefix's tokens and log-probs
    (`[N, W]`, kept where `begun`) padded to R columns, and each row's length should it
    not stop: `steps` more tokens, at most R (its own where `done`)."""
    num_new = sampling.max_new_tokens
    widen = lambda x, fill: jnp.pad(jnp.where(begun, x, fill),
                                    ((0, 0), (0, num_new - x.shape[1])), constant_values=fill)
    out_lengths = jnp.where(done, lengths, jnp.minimum(lengths + steps, num_new))
    return (widen(responses.astype(jnp.int32), sampling.pad_token_id),
            widen(log_probs.astype(jnp.float32), 0.0), out_lengths)


def _held_rows(carried: Carried | None, cached, done, num_rows: int, groups: int,
               config: ModelConfig):
    """`(held [N], where [N])`: which rows are prefilled from the `carried` cache (marked
    `cached`, still running, and among its rows) and each one's row there; None when no
    row is (no cache, or a model with sliding-window layers, whose rings hold slots by
    index and are not moved)."""
    if carried is None or cached is None or not carries_cache(config):
        return None
    per_group = num_rows // groups
    there = _grouped(carried.rows, groups)
    local = jnp.where(there < num_rows, there % per_group, per_group)
    where = _ungrouped(inverse_rows(local, per_group))
    held = cached.astype(bool) & ~done & (where < there.shape[1])
    return held, where


def carries_cache(config: ModelConfig) -> bool:
    """Whether `continue_rows` starts rows from a `Carried` cache for this model: not with
    sliding-window layers, whose rings hold slots by index and are not moved."""
    return gemma.SLIDING not in (config.layer_types or ())


def _with_typed_keys(prefix: Prefix) -> Prefix:
    """The prefix with typed keys (from key data, as a host keeps them)."""
    if jax.dtypes.issubdtype(prefix.keys.dtype, jax.dtypes.prng_key):
        return prefix
    return prefix.replace(keys=jax.random.wrap_key_data(prefix.keys))


def _check_prefix(prompt_ids, prefix: Prefix, sampling: SamplingConfig, max_steps) -> None:
    """`continue_rows`' checks of the prefix and its settings, before compiling."""
    num_rows = prompt_ids.shape[0]
    if sampling.n != 1:
        raise ValueError(f"rollout.n={sampling.n}: continued rows are given one prompt "
                         "row each (repeat the prompts n times and set n to 1)")
    if sampling.cache_segments > 1 or sampling.record_routing:
        raise ValueError("continuing begun responses runs one program without routing "
                         "records: set rollout.cache_segments to 1 and "
                         "actor.router_replay to none")
    if not _is_int(max_steps) or max_steps < 1:
        raise ValueError(f"max_steps must be an integer >= 1, got {max_steps!r}")
    width = prefix.responses.shape[-1] if prefix.responses.ndim == 2 else "W"
    shapes = {"responses": (num_rows, width), "log_probs": (num_rows, width),
              "lengths": (num_rows,), "finished": (num_rows,), "keys": (num_rows,)}
    if prefix.cached is not None:
        shapes["cached"] = (num_rows,)
    for name, shape in shapes.items():
        if tuple(getattr(prefix, name).shape) != shape:
            raise ValueError(f"prefix.{name} must be {list(shape)} for {num_rows} prompt "
                             f"rows; got {list(getattr(prefix, name).shape)}")
    if width > sampling.max_new_tokens:
        raise ValueError(f"prefix.responses has {width} columns, more than "
                         f"max_new_tokens={sampling.max_new_tokens}")
    lengths = _host_value(prefix.lengths)
    if lengths is not None:
        bad = (lengths < 0) | (lengths > width)
        if bad.any():
            row = int(np.argmax(bad))
            raise ValueError(f"prefix row {row} has length {int(lengths[row])}, outside "
                             f"[0, {width}] (the prefix's columns)")


def _decode_to(params, state: _DecodeState, end: int, *, prompt_len: int,
               sampling: SamplingConfig, config: ModelConfig, in_order: bool = True,
               keep_cache: bool = False):
    """Decodes from `state` until step `end` or until every row has stopped, at the decode
    loop's batch sizes (`decode_sizes`): `(outputs, final state, kept)`, the rows'
    outputs (`_outputs`) in the order of `state.rows` (`in_order`: the state's own) and,
    with `keep_cache`, `(cache, rows)` holding every row still running at step `end`
    (`Carried`'s; else None)."""
    num_rows = state.responses.shape[0]
    groups = _row_groups(num_rows)
    sizes = decode_sizes(num_rows, groups, sampling)
    kept = None
    if keep_cache and len(sizes) > 1:  # the rows' cache, before compactions drop any
        kept = (jax.tree.map(jnp.zeros_like, state.cache),
                jnp.full((num_rows,), num_rows, jnp.int32))
    state, out, kept = decode_rows(params, state, _outputs(state), end, sizes, groups,
                                   prompt_len=prompt_len, sampling=sampling, config=config,
                                   kept=kept)
    if keep_cache and len(sizes) == 1:  # no compaction: the batch holds every row
        kept = (state.cache, jnp.where(state.done, num_rows, state.rows))
    if len(sizes) > 1 or not in_order:
        return _write_rows(out, state, groups), state, kept
    return _outputs(state), state, kept


def _outputs(state: _DecodeState) -> tuple[jax.Array, ...]:
    """The state's per-row outputs: responses, log-probs, lengths (whether each row
    finished, when continuing; the recorded routing of the responses and the prompts)."""
    out = (state.responses, state.log_probs, state.lengths)
    if state.offsets is not None:
        out = (*out, state.done)
    return out if state.routing is None else (*out, state.routing, state.prompt_routing)


def start(params, prompt_ids, prompt_mask, rng, sampling: SamplingConfig, config: ModelConfig,
          num_slots: int | None = None):
    """Prefill and the first response token: `(row_prompt_ids [N, P], row_prompt_mask
    [N, P], state, per-layer params)`, the state's cache of `num_slots` slots (None: P + R,
    rounded as `_prefill` does)."""
    repeat = lambda x, axes=("batch", None): constrain(
        jnp.repeat(x, sampling.n, axis=0), axes)
    prompt_ids, prompt_mask = prompt_ids.astype(jnp.int32), prompt_mask.astype(jnp.int32)
    row_prompt_ids, row_prompt_mask = repeat(prompt_ids), repeat(prompt_mask)
    num_rows = row_prompt_ids.shape[0]
    num_new = sampling.max_new_tokens
    params = per_layer(params, config)
    # The n samples of a prompt share its prefill: run it once per prompt, then copy
    # the cache to the n rows.
    # The single program's rows fill contiguous slots, so Gemma's sliding-window layers
    # keep rings of their window (`cache.init_cache`); a segment's cache, moved between
    # programs of different lengths, keeps full buffers.
    prefilled = _prefill(params, prompt_ids, prompt_mask, num_new, config, num_slots,
                         record=sampling.record_routing, ring=num_slots is None)
    logits_bv, cache, key_mask = prefilled[:3]
    routing = prompt_routing = None
    if sampling.record_routing:  # the prompts' experts, and room for the responses'
        prompt_routing = repeat(prefilled[3], ("batch", None, None, None))
        prompt_routing = jnp.where(row_prompt_mask[:, :, None, None] > 0, prompt_routing,
                                   moe.NOT_RECORDED)
        routing = jnp.full((num_rows, num_new, *prompt_routing.shape[2:]), moe.NOT_RECORDED,
                           jnp.int32)
    logits_nv, key_mask = repeat(logits_bv), repeat(key_mask)
    cache = jax.tree.map(lambda x: repeat(x, CACHE_LOGICAL_AXES), cache)
    state = _DecodeState(
        step=jnp.zeros((), jnp.int32),
        last_tokens=jnp.zeros((num_rows,), jnp.int32),
        done=jnp.zeros((num_rows,), bool),
        lengths=jnp.full((num_rows,), num_new, jnp.int32),
        responses=jnp.full((num_rows, num_new), sampling.pad_token_id, jnp.int32),
        log_probs=jnp.zeros((num_rows, num_new), jnp.float32),
        cache=cache,
        key_mask=key_mask,
        keys=row_keys(rng, num_rows),
        prompt_lengths=jnp.sum(row_prompt_mask, axis=1),
        rows=jnp.arange(num_rows, dtype=jnp.int32),
        routing=routing,
        prompt_routing=prompt_routing,
    )
    return (row_prompt_ids, row_prompt_mask,
            _emit(state, _from_logits(logits_nv, sampling), sampling), params)


def decode_rows(params, state: _DecodeState, out, end: int, sizes: tuple[int, ...], groups: int,
                *, prompt_len: int, sampling: SamplingConfig, config: ModelConfig,
                kept=None):
    """Decodes until step `end` or until every row has stopped, at the batch sizes
    `sizes` (the state's own first): `(state, out, kept)`, the output buffers `out`
    (`_write_rows`) holding the rows that left the batch at each compaction.

    `kept` (None, or `(cache, rows)` of the output's N rows, `rows` N where a cache row
    holds none) takes the batch's rows still running at the batch size where step `end`
    is reached, before the compactions that follow drop some: a continued call's next
    call starts them from there.

    `params` are the per-layer parameters (`per_layer`)."""
    for i, smaller in enumerate((*sizes[1:], 0)):
        reached = state.step >= end if i and kept is not None else False
        state = decode_until(params, state, end, smaller, groups, prompt_len=prompt_len,
                             sampling=sampling, config=config)
        if kept is not None:  # written once, at the batch where the budget ran out
            kept = _keep_rows(kept, state, (state.step >= end) & jnp.logical_not(reached),
                              groups)
        if smaller:
            out = _write_rows(out, state, groups)
            state = _compact(state, smaller, groups)
    return state, out, kept


def decode_until(params, state: _DecodeState, end: int, smaller: int, groups: int, *,
                 prompt_len: int, sampling: SamplingConfig, config: ModelConfig) -> _DecodeState:
    """Decodes at the state's batch size until step `end` or until every group's
    unfinished rows fit `smaller` rows (0: until none is left)."""
    def decode(state: _DecodeState) -> _DecodeState:
        hidden_nd, state = _decode_step(params, state, prompt_len, config)
        return _emit(state, lambda keys: next_tokens(params, hidden_nd, keys, sampling, config),
                     sampling)

    def running(state: _DecodeState) -> jax.Array:
        unfinished = jnp.sum(~_grouped(state.done, groups), axis=1)
        return (state.step < end) & (jnp.max(unfinished) > smaller // groups)

    return lax.while_loop(running, decode, state)


def rollout_output(row_prompt_ids, row_prompt_mask, responses, log_probs, lengths
                   ) -> RolloutOutput:
    """`RolloutOutput` of the rows' prompts and their `[N, R]` responses."""
    response_mask = jnp.arange(responses.shape[1])[None, :] < lengths[:, None]
    return RolloutOutput(
        prompt_ids=row_prompt_ids,
        prompt_mask=row_prompt_mask,
        responses=responses,
        response_mask=response_mask.astype(jnp.int32),
        rollout_log_probs=log_probs,
        response_lengths=lengths,
    )


def decode_sizes(num_rows: int, groups: int, sampling: SamplingConfig) -> tuple[int, ...]:
    """The decode loop's batch sizes, largest first: `num_rows`, then down to
    `num_rows / decode_buckets`, each a whole number of rows per batch shard (`groups`);
    `(num_rows,)` when rows never stop early."""
    if sampling.ignore_stop or not sampling.stop_token_ids or sampling.decode_buckets == 1:
        return (num_rows,)
    per_group = num_rows // groups
    sizes = []
    for k in range(sampling.decode_buckets, 0, -1):
        size = -(-per_group * k // sampling.decode_buckets) * groups
        if size not in sizes:
            sizes.append(size)
    return tuple(sizes)


def _row_groups(num_rows: int) -> int:
    """How many batch shards the rows are split into under the active mesh (1: none).
    Compaction keeps every row on its own shard: it gathers within each group."""
    sharder = sharding.active_sharder()
    if sharder is None:
        return 1
    axes = sharder.spec(("batch",), (num_rows,))[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return math.prod(sharder.mesh.shape[a] for a in axes)


def _grouped(x: jax.Array, groups: int, axes=None) -> jax.Array:
    """Rows `[N, ...]` (logical `axes`, "batch" first) as `[groups, N / groups, ...]`,
    each group on its own shard."""
    axes = axes or ("batch",) + (None,) * (x.ndim - 1)
    return constrain(x.reshape(groups, -1, *x.shape[1:]), (axes[0], None, *axes[1:]))


def _ungrouped(x: jax.Array, axes=None) -> jax.Array:
    axes = axes or ("batch",) + (None,) * (x.ndim - 2)
    return constrain(x.reshape(-1, *x.shape[2:]), axes)


def _write_rows(out, state: _DecodeState, groups: int):
    """The output buffers `(responses [N, R], log_probs [N, R], lengths [N])` with the
    state's rows written at their output rows (each group into its own shard)."""
    return _put_rows(out, _outputs(state), state.rows, groups)


def _keep_rows(kept, state: _DecodeState, now, groups: int):
    """`kept` (`decode_rows`) with, where `now`, the state's rows still running written
    at their output rows (elsewhere the scatter's rows fall out of range: a `lax.cond`
    would hold another copy of the cache)."""
    cache, rows = kept
    valid = now & ~state.done
    leaves, tree = jax.tree.flatten(cache)
    leaves = _put_rows(leaves, jax.tree.leaves(state.cache), state.rows, groups,
                       CACHE_LOGICAL_AXES, valid)
    (rows,) = _put_rows((rows,), (state.rows,), state.rows, groups, valid=valid)
    return jax.tree.unflatten(tree, leaves), rows


def _put_rows(buffers, values, rows, groups: int, axes=None, valid=None
              ) -> tuple[jax.Array, ...]:
    """The `buffers` (`[N, ...]` each) with `values` (`[M, ...]` each) written at rows
    `rows` `[M]` (where `valid`, if given), each group into its own shard (a row's group
    is the same in both)."""
    per_group = buffers[0].shape[0] // groups
    local = _grouped(rows, groups) % per_group
    if valid is not None:  # out of the group's range: dropped
        local = jnp.where(_grouped(valid, groups), local, per_group)

    def put(buffer, values):
        # The rows kept are distinct (the others dropped), so declared unique: a GPU
        # scatter otherwise writes each element by an atomic (`cache.PagedCache.write`).
        put_group = lambda b, i, v: b.at[i].set(v, mode="drop", unique_indices=True)
        return _ungrouped(jax.vmap(put_group)(_grouped(buffer, groups, axes), local,
                                              _grouped(values, groups, axes)), axes)

    return tuple(put(b, v) for b, v in zip(buffers, values, strict=True))


def _compact(state: _DecodeState, size: int, groups: int) -> _DecodeState:
    """The state with `size` rows: in each group its unfinished rows first (in order),
    then finished ones to fill the group's share."""
    order = jax.vmap(lambda done: jnp.argsort(done, stable=True))(_grouped(state.done, groups))
    order = order[:, :size // groups]
    take = functools.partial(_take_rows, order=order, groups=groups)
    rows = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)
            if f.name not in ("step", "cache") and getattr(state, f.name) is not None}
    if isinstance(state.cache, RowCache):  # its rows stay; they map to the new batch
        cache = state.cache.with_batch(order)
    else:
        cache = jax.tree.map(lambda x: take(x, axes=CACHE_LOGICAL_AXES), state.cache)
    return state.replace(cache=cache, **{k: take(v) for k, v in rows.items()})


def _take_rows(x: jax.Array, *, order: jax.Array, groups: int, axes=None) -> jax.Array:
    """Rows of `x` `[N, ...]` picked within each group: `order` `[groups, M]` holds each
    group's row indices (local to the group); `[groups M, ...]` on the groups' shards."""
    return _ungrouped(jax.vmap(lambda x, i: x[i])(_grouped(x, groups, axes), order), axes)


def row_keys(rng, num_rows: int) -> jax.Array:
    """`[num_rows]` keys, `fold_in(rng, r)` for row r (see the module docstring)."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng, jnp.arange(num_rows))


def per_layer(params, config: ModelConfig):
    """`params` with the layers' weights as separate arrays, sliced once per program
    rather than at every decode step, and their projections fused where
    `config.fuse_decode_projections` and the mesh allow (`_fuses`), with the fused decode
    kernel's bias operand made once (`transformer.with_kernel_bias`); the unembedding
    padded for the decode head's kernel where it needs it (`_padded_head`)."""
    layers = tuple(jax.tree.map(lambda w, i=i: w[i], params["layers"])
                   for i in range(config.num_layers))
    if _fuses(config):
        layers = tuple(transformer.with_kernel_bias(transformer.fuse_projections(layer, config),
                                                    config) for layer in layers)
    return {**params, "layers": layers, **_padded_head(params, config)}


def _fuses(config: ModelConfig) -> bool:
    """Whether the sampler fuses projections: asked for, and no mesh axis splits the
    heads (a fused q/k/v kernel keeps its heads whole)."""
    sharder = sharding.active_sharder()
    heads_split = sharder is not None and sharder.spec(
        (None, "heads", None), (config.hidden_size, config.num_heads, config.head_dim))[1]
    return config.fuse_decode_projections and not heads_split


def _prefill(params, prompt_ids, prompt_mask, num_new, config, num_slots=None,
             record: bool = False, ring: bool = False):
    """One forward over the B prompts into a fresh cache of P + R slots (or `num_slots`),
    with `ring` the sliding-window layers' as rings of their window (`init_cache`).

    Returns:
      (logits `[B, V]` float32 at the last prompt slot, cache, key_mask `[B, S]`), with
      S = `cache_slots(P + R)`: rounded up to whole blocks for the decode-attention kernel;
      with `record`, the prompts' experts `[B, P, L, k]` as a fourth.
    """
    batch, prompt_len = prompt_ids.shape
    slots = num_slots or cache_slots(config, prompt_len + num_new)
    cache = init_cache(config, batch, slots, ring=ring)
    key_mask = jnp.pad(prompt_mask, ((0, 0), (0, slots - prompt_len)))
    positions = positions_from_mask(prompt_mask)
    run = transformer.forward_recording if record else forward
    hidden_bpd, cache, *recorded = run(
        params, prompt_ids, positions, key_mask, cache, 0, config=config
    )
    # Left padding puts every row's last prompt token in slot P-1; unembedding only
    # that position avoids a [N, P, V] logits buffer. Sampling wants whole rows.
    logits_bv = unembed(params, hidden_bpd[:, -1], softcap=config.final_logit_softcapping)
    return (constrain(logits_bv, ("batch", None)), cache, key_mask, *recorded)


def _prefill_by_length(params, ids, mask, num_new, config, groups: int, late=None,
                       reuse=None):
    """`_prefill` of rows whose real tokens (left-padded) end together but start at unlike
    columns, as continued rows do, each slice of rows over its own columns only: `(logits
    [N, V], cache, key_mask [N, S], T)`, T the prefill's columns (left padding added for
    whole chunks, so the decode's first slot).

    One forward over `[N, T]` costs every row the longest row's columns. Here the rows,
    sorted longest first within each of the `groups` batch shards, are prefilled in
    `PREFILL_SLICES` slices of each group's rows, each slice in chunks of
    `PREFILL_COLUMNS` columns from the first chunk holding a token of its longest row,
    every chunk attending to the slice's cache so far. Both are loops (`lax.fori_loop`
    over the slices, `lax.while_loop` over a slice's chunks), so the program holds one
    forward and serves any spread of lengths.

    `late` (bool `[N]`): rows that need only the chunk of their last token (finished
    rows, whose outputs are not used, and rows the `reuse` cache holds). `reuse`:
    `(cache, next_slot)`, a previous call's cache (`Carried`, its rows already in this
    order) whose rows hold their tokens so far but the last, which is to be at
    `next_slot`: moved to this layout, it starts the rows' caches."""
    num_rows, total = ids.shape
    per_group = num_rows // groups
    slices = max(d for d in range(1, min(PREFILL_SLICES, per_group) + 1)
                 if per_group % d == 0)
    size = per_group // slices
    columns = min(PREFILL_COLUMNS, total)
    padded = -(-total // columns) * columns
    ids, mask = (jnp.pad(x, ((0, 0), (padded - total, 0))) for x in (ids, mask))
    slots = cache_slots(config, padded + num_new)
    key_mask = jnp.pad(mask, ((0, 0), (0, slots - padded)))
    by_group = functools.partial(_grouped, groups=groups)
    first = jnp.argmax(mask, axis=1)  # every row has a real token
    if late is not None:
        first = jnp.where(late, padded - 1, first)
    cache = init_cache(config, num_rows, slots, ring=True)
    if reuse is not None:
        carried, next_slot = reuse
        move = next_slot - (padded - 1)  # the held rows' last token: from next_slot to T - 1

        def moved(x):  # slot s takes the old slot s + move, zeros where there is none
            x = jnp.pad(x, ((0, 0), (0, 0), (max(-move, 0),
                                             max(slots + move - x.shape[2], 0)), (0, 0)))
            return x[:, :, max(move, 0):max(move, 0) + slots]

        cache = jax.tree.map(moved, carried)
    inputs = tuple(map(by_group, (ids, positions_from_mask(mask), key_mask, first)))
    cache_axes = functools.partial(jax.tree.map, lambda x: by_group(x, axes=CACHE_LOGICAL_AXES))

    def fill(i, carry):
        cache, hidden = carry
        ids, positions, keys, first = (
            _ungrouped(lax.dynamic_slice_in_dim(x, i * size, size, axis=1)) for x in inputs)

        def chunk(carry):
            j, cache, _ = carry
            cut = lambda x: lax.dynamic_slice_in_dim(x, j * columns, columns, axis=1)
            out, cache = forward(params, cut(ids), cut(positions), keys, cache, j * columns,
                                 config=config)
            return j + 1, cache, out[:, -1]

        start = (jnp.min(first) // columns).astype(jnp.int32)
        own = jax.tree.map(lambda x: _ungrouped(lax.dynamic_slice_in_dim(
            x, i * size, size, axis=1), CACHE_LOGICAL_AXES), cache)
        _, piece, last = lax.while_loop(
            lambda carry: carry[0] < padded // columns, chunk,
            (start, own, jnp.zeros((groups * size, config.hidden_size), config.dtype)))
        put = lambda whole, x: lax.dynamic_update_slice_in_dim(whole, x, i * size, axis=1)
        return jax.tree.map(put, cache, cache_axes(piece)), put(hidden, by_group(last))

    cache = cache_axes(cache)
    hidden = by_group(jnp.zeros((num_rows, config.hidden_size), config.dtype))
    cache, hidden = lax.fori_loop(0, slices, fill, (cache, hidden))
    cache = jax.tree.map(lambda x: _ungrouped(x, CACHE_LOGICAL_AXES), cache)
    logits_nv = unembed(params, _ungrouped(hidden), softcap=config.final_logit_softcapping)
    return constrain(logits_nv, ("batch", None)), cache, key_mask, padded


def cache_slots(config: ModelConfig, needed: int) -> int:
    """Cache slots for `needed` tokens: rounded up to whole blocks where the decode steps
    run the decode-attention kernel."""
    return decode_attention.cache_slots(config.decode_attention_impl, config.head_dim, needed,
                                        config.dtype)


def _decode_step(params, state: _DecodeState, prompt_len: int, config):
    """Feeds the last sampled token of every row: `(final hidden states [N, D], state)`,
    for `next_tokens`.

    The token sampled at step i-1 goes to slot `P + i - 1` (shared by all rows) at
    RoPE position `prompt_lengths + i - 1`. Rows that have stopped are fed their
    pad token too and attend to the new slot alone (`decoding_mask`), so attention
    costs follow the rows still running between the batch sizes the loop compacts to
    (`decode_buckets`).
    """
    slot = prompt_len + state.step - 1
    num_rows = state.last_tokens.shape[0]
    key_mask = lax.dynamic_update_slice_in_dim(
        state.key_mask, jnp.ones((num_rows, 1), state.key_mask.dtype), slot, axis=1
    )
    attended = decoding_mask(key_mask, slot, ~state.done)
    positions = (state.prompt_lengths + state.step - 1)[:, None]
    record = state.routing is not None
    hidden_n1d, cache, *recorded = (transformer.forward_recording if record else forward)(
        params, state.last_tokens[:, None], positions, attended, state.cache, slot,
        config=config,
    )
    if record:  # the experts of response token step - 1 (padding after a stop: none)
        experts = jnp.where(state.done[:, None, None, None], moe.NOT_RECORDED, recorded[0])
        state = state.replace(routing=lax.dynamic_update_slice_in_dim(
            state.routing, experts.astype(state.routing.dtype), state.step - 1, axis=1))
    return hidden_n1d[:, 0], state.replace(cache=cache, key_mask=key_mask)


def decoding_mask(key_mask: jax.Array, slot, running: jax.Array) -> jax.Array:
    """The mask `[N, S]` a decode step attends with: `key_mask` for the `running` rows,
    the new `slot` (shared, or `[N]` one per row) alone for the others, whose outputs are
    discarded; the decode kernel (but for `MosaicTiles.row_group`) then reads one block
    of such a row's cache instead of all its filled ones (XLA's path reads every slot
    anyway)."""
    slots = jnp.arange(key_mask.shape[1])
    per_row = jnp.ndim(slot) > 0
    only_new = (slots[None, :] == slot[:, None] if per_row else slots == slot)
    only_new = only_new.astype(key_mask.dtype)
    return jnp.where(running[:, None], key_mask, only_new if per_row else only_new[None, :])


def _emit(state: _DecodeState, sample, sampling: SamplingConfig) -> _DecodeState:
    """Samples response token `state.step` of every row (`offsets + step` when
    continuing) and records it; `sample(keys [N]) -> (tokens, log_probs)` draws
    (`next_tokens`, or `sample_tokens` over given logits: `_from_logits`)."""
    if state.offsets is None:
        index = state.step
        step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(state.keys, index)
    else:
        index = state.offsets + state.step
        step_keys = jax.vmap(jax.random.fold_in)(state.keys, index)
    tokens, log_probs = sample(step_keys)
    tokens = jnp.where(state.done, sampling.pad_token_id, tokens)
    log_probs = jnp.where(state.done, 0.0, log_probs)
    stopped = ~state.done & _is_stop_token(tokens, sampling)
    ended = stopped
    if state.offsets is None:
        write = lambda buffer, column: lax.dynamic_update_slice_in_dim(
            buffer, column[:, None], state.step, axis=1
        )
    else:
        # Each row writes its own column, finished rows none (R: no column), by a select
        # rather than a scatter, which under a batch-sharded mesh gathers its indices and
        # updates from every device at each step; a row that reaches R tokens has finished.
        num_new = state.responses.shape[1]
        columns = jnp.where(state.done, num_new, index)
        at = jnp.arange(num_new)[None, :] == columns[:, None]
        write = lambda buffer, column: jnp.where(at, column[:, None], buffer)
        ended = stopped | (~state.done & (index + 1 >= num_new))
    return state.replace(
        step=state.step + 1,
        last_tokens=tokens,
        done=state.done | ended,
        lengths=jnp.where(stopped, index + 1, state.lengths),
        responses=write(state.responses, tokens),
        log_probs=write(state.log_probs, log_probs),
    )


def _from_logits(logits_nv, sampling: SamplingConfig):
    """`_emit`'s `sample` from given logits `[N, V]`."""
    return lambda keys: sample_tokens(logits_nv, keys, sampling)


def _is_stop_token(tokens_n: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """bool `[N]`: the token ends its row (never with `ignore_stop` or no stop ids)."""
    if sampling.ignore_stop or not sampling.stop_token_ids:
        return jnp.zeros(tokens_n.shape, bool)
    stops = jnp.asarray(sampling.stop_token_ids, jnp.int32)
    return jnp.any(tokens_n[:, None] == stops[None, :], axis=1)


def sample_tokens(
    logits_nv: jax.Array, keys_n: jax.Array, sampling: SamplingConfig
) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row from the processed distribution.

    Args:
      logits_nv: float32 `[N, V]` raw next-token logits.
      keys_n: `[N]` PRNG keys, one per row (unused when greedy).
      sampling: temperature / top_k / top_p / do_sample.

    Returns:
      (tokens int32 `[N]`, log_probs float32 `[N]`): the log-prob of each token
      under the distribution it was drawn from (0 when greedy).
    """
    logits_nv = logits_nv.astype(jnp.float32)
    if not sampling.do_sample:
        tokens = jnp.argmax(logits_nv, axis=-1).astype(jnp.int32)
        return tokens, jnp.zeros(tokens.shape, jnp.float32)
    return jax.vmap(functools.partial(_sample_row, sampling=sampling))(logits_nv, keys_n)


def next_tokens(params, hidden_nd: jax.Array, keys_n: jax.Array, sampling: SamplingConfig,
                config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """A decode step's head: each row's next token and its log-prob (`sample_tokens`'s
    outputs) from its final hidden state `[N, D]`.

    Where `head_impl` takes the kernel, the logits stay on chip: the kernel reduces each
    row's to the masses of ranges of 64 vocabulary entries (`logprob_head.block_masses`)
    and the draw (`_draw_from_masses`) recomputes the logits of the one range its uniform
    number falls in. Otherwise the `[N, V]` float32 logits are formed and sampled."""
    if head_impl(config, sampling) == "mosaic":
        weight, vocab_first = _sampling_head(params, config)
        block_max, masses = logprob_head.block_masses(
            hidden_nd.astype(config.dtype), weight, vocab=config.vocab_size,
            vocab_first=vocab_first, temperature=sampling.temperature,
            parts=logprob_head.SAMPLE_PARTS)
        return _draw_from_masses(hidden_nd, weight, vocab_first, block_max, masses, keys_n,
                                 config.vocab_size, sampling.temperature)
    logits_nv = unembed(params, hidden_nd, softcap=config.final_logit_softcapping)
    return sample_tokens(constrain(logits_nv, ("batch", None)), keys_n, sampling)


def head_impl(config: ModelConfig, sampling: SamplingConfig) -> str:
    """`"mosaic"` where `next_tokens` takes the kernel (`config.decode_head_impl`), else
    `"xla"`: the kernel draws with a fixed temperature alone, so any draw it does not
    make (`head_kernel_lacks`, or a traced temperature) takes XLA's head, "mosaic" or not
    (the config check refuses a forced "mosaic" whose training draws it would not make,
    and with runs in one program, so only greedy validation falls back; a Gemma config
    with a final soft-cap refuses it too, `gemma.check`). Otherwise "auto" takes the
    kernel where `logprob_head.choose_impl` would take the log-prob kernel (a Hopper GPU,
    a 16-bit compute dtype, hidden size a multiple of 64 up to 2,048, no `tensor` or
    `context` axis)."""
    if (head_kernel_lacks(sampling, config.vocab_size)
            or not isinstance(sampling.temperature, int | float)):
        return "xla"
    return "mosaic" if _kernel_applies(config) else "xla"


def head_kernel_lacks(sampling, vocab_size: int | None = None) -> list[str]:
    """What of `sampling`'s draw (a `SamplingConfig`, or the `rollout` settings) the decode
    head's kernel does not make: greedy decoding, top-k, top-p (empty: a temperature
    draw, which it makes)."""
    top_k_on = sampling.top_k > 0 and (vocab_size is None or sampling.top_k < vocab_size)
    return [why for why, on in (
        ("greedy decoding (rollout.do_sample=False)", not sampling.do_sample),
        (f"top-k (rollout.top_k={sampling.top_k})", top_k_on),
        (f"top-p (rollout.top_p={sampling.top_p})", sampling.top_p < 1.0),
    ) if on]


# The unembedding padded to whole `SAMPLE_BLOCKS.v` blocks, made once per rollout by
# `per_layer` for a vocabulary that needs it (none of the released Qwen, Llama or Gemma
# ones do).
PADDED_HEAD = "sampling_head"


def _sampling_head(params, config: ModelConfig) -> tuple[jax.Array, bool]:
    """The kernel's unembedding `(weight, vocab_first)` in the compute dtype: `[Vp, D]`
    (tied, the embedding) or `[D, Vp]` (`lm_head`), padded (`PADDED_HEAD`) where the
    vocabulary is not whole blocks."""
    vocab_first = "lm_head" not in params
    if PADDED_HEAD in params:
        return params[PADDED_HEAD], vocab_first
    weight = params["embed"]["embedding"] if vocab_first else params["lm_head"]["kernel"]
    return weight.astype(config.dtype), vocab_first


def _kernel_applies(config: ModelConfig) -> bool:
    """The model's side of `head_impl`: `decode_head_impl` not "xla", no final soft-cap,
    and `logprob_head.choose_impl` taking the kernel (its errors naming
    `model.decode_head_impl`)."""
    return (config.decode_head_impl != "xla" and config.final_logit_softcapping is None
            and logprob_head.choose_impl(config.decode_head_impl, config.hidden_size,
                                         dtype=config.dtype,
                                         key="model.decode_head_impl") == "mosaic")


def _padded_head(params, config: ModelConfig) -> dict:
    """`{PADDED_HEAD: weight}` where the kernel may draw (`head_impl` but for the sampling
    settings) and the vocabulary is not whole blocks, else `{}`: a copy made once per
    rollout, which XLA drops from a program that does not read it (but for the first
    stage of `cache_segments > 1`, which returns the per-layer parameters to the later
    stages)."""
    blocks = logprob_head.SAMPLE_BLOCKS
    if config.vocab_size % blocks.v == 0 or not _kernel_applies(config):
        return {}
    weight, vocab_first = _sampling_head(params, config)
    return {PADDED_HEAD: logprob_head.pad_vocab(weight, vocab_first, blocks)}


def _draw_from_masses(hidden_nd, weight, vocab_first: bool, block_max, masses, keys_n,
                      vocab: int, temperature: float) -> tuple[jax.Array, jax.Array]:
    """`_inverse_cdf_sample` of every row over `block_masses`' ranges: the range whose
    cumulative mass passes the row's uniform number `u` (the one `jax.random.uniform`
    draws from the row's key, as the XLA path does), then, within it, the first entry
    whose cumulative weight passes `u`, the range's logits recomputed from its rows of
    the unembedding (`[N, v / parts, D]` gathered). Entries of zero weight (padding,
    and past the last range of positive mass when rounding puts `u` on a boundary) are
    never returned. The log-prob is `z_token - log Z`, `log Z` from the masses.

    Returns:
      (tokens int32 `[N]`, log_probs float32 `[N]`).
    """
    parts, num_blocks, n = masses.shape
    width = weight.shape[0 if vocab_first else 1] // (num_blocks * parts)
    top_n = jnp.max(block_max, axis=0)
    # Range (j, s) is column j * parts + s: the ranges in vocabulary order.
    mass_nr = jnp.transpose(masses * jnp.exp(block_max - top_n)[None], (2, 1, 0))
    mass_nr = mass_nr.reshape(n, num_blocks * parts)
    cdf_nr = jnp.cumsum(mass_nr, axis=1)
    total_n = cdf_nr[:, -1]
    u_n = jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys_n) * total_n
    last_r = jax.vmap(_last_positive)(mass_nr)
    chosen_n = jnp.minimum(jnp.sum(cdf_nr <= u_n[:, None], axis=1), last_r)
    if vocab_first:
        rows_nwd = jnp.take(weight.reshape(-1, width, weight.shape[1]), chosen_n, axis=0)
        z_nw = jnp.einsum("nd,nwd->nw", hidden_nd.astype(weight.dtype), rows_nwd,
                          preferred_element_type=jnp.float32)
    else:
        cols_dnw = jnp.take(weight.reshape(weight.shape[0], -1, width), chosen_n, axis=1)
        z_nw = jnp.einsum("nd,dnw->nw", hidden_nd.astype(weight.dtype), cols_dnw,
                          preferred_element_type=jnp.float32)
    ids_nw = chosen_n[:, None] * width + jnp.arange(width)[None, :]
    z_nw = jnp.where(ids_nw < vocab, z_nw / temperature, -jnp.inf)
    w_nw = jnp.exp(z_nw - top_n[:, None])
    before_n = (jnp.take_along_axis(cdf_nr, chosen_n[:, None], axis=1)[:, 0]
                - jnp.take_along_axis(mass_nr, chosen_n[:, None], axis=1)[:, 0])
    inner_cdf_nw = before_n[:, None] + jnp.cumsum(w_nw, axis=1)
    inner_n = jnp.minimum(jnp.sum(inner_cdf_nw <= u_n[:, None], axis=1),
                          jax.vmap(_last_positive)(w_nw))
    z_n = jnp.take_along_axis(z_nw, inner_n[:, None], axis=1)[:, 0]
    tokens = (chosen_n * width + inner_n).astype(jnp.int32)
    return tokens, z_n - top_n - jnp.log(total_n)


def _sample_row(logits_v, key, sampling: SamplingConfig):
    """One row of `sample_tokens`: (token int32 [], log_prob float32 [])."""
    processed_v = _process_row(logits_v, sampling)
    top = jnp.max(processed_v)
    token, mass = _inverse_cdf_sample(key, processed_v, top)
    # log softmax at the token, with the normaliser the draw summed anyway.
    return token, processed_v[token] - top - jnp.log(mass)


# Vocabulary block of the two-level inverse-CDF search.
_CDF_BLOCK = 128


def _inverse_cdf_sample(key, logits_v, top):
    """Draws `i ~ softmax(logits)` from one uniform number: `i = min{i : CDF(i) > u}`.

    A Gumbel-max draw needs V random numbers per row and step, which costs more
    than the rest of sampling on a large vocabulary. Here the CDF is searched in two
    levels: cumulative sums of blocks of `_CDF_BLOCK` weights `exp(logit - top)` pick
    the block (one read of the row), then the chosen block's weights are recomputed
    and summed up to the token, so no `[V]` weights are ever stored. Tokens of zero
    weight (masked by top-k / top-p) are never returned, also when rounding puts `u`
    on a boundary.

    Returns:
      (token int32 [], the total weight `sum_i exp(logit_i - top)`).
    """
    v = logits_v.shape[0]
    blocks_v = jnp.pad(logits_v, (0, (-v) % _CDF_BLOCK), constant_values=-jnp.inf)
    blocks_v = blocks_v.reshape(-1, _CDF_BLOCK)
    block_mass = jnp.sum(jnp.exp(blocks_v - top), axis=1)  # -inf -> 0
    block_cdf = jnp.cumsum(block_mass)
    u = jax.random.uniform(key, (), jnp.float32) * block_cdf[-1]
    block = jnp.minimum(jnp.sum(block_cdf <= u), _last_positive(block_mass))
    row = jnp.exp(blocks_v[block] - top)
    inner_cdf = (block_cdf[block] - block_mass[block]) + jnp.cumsum(row)
    inner = jnp.minimum(jnp.sum(inner_cdf <= u), _last_positive(row))
    return (block * _CDF_BLOCK + inner).astype(jnp.int32), block_cdf[-1]


def _last_positive(x):
    """Index of the last element > 0 of a 1-D array (0 if none)."""
    n = x.shape[0]
    return n - 1 - jnp.argmax(x[::-1] > 0)


def processed_logits(logits_nv: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """The logits `sample_tokens` draws from: `[..., V]`, -inf outside top-k / top-p.

    Args:
      logits_nv: float32 `[..., V]` raw logits.
      sampling: the sampling settings; for greedy decoding the raw logits are
        returned unchanged.

    Returns:
      float32 `[..., V]`; its `log_softmax` is the sampling distribution.
    """
    logits_nv = logits_nv.astype(jnp.float32)
    if not sampling.do_sample:
        return logits_nv
    flat = logits_nv.reshape(-1, logits_nv.shape[-1])
    processed = jax.vmap(functools.partial(_process_row, sampling=sampling))(flat)
    return processed.reshape(logits_nv.shape)


def _process_row(logits_v: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """Temperature, then top-k, then top-p on one row `[V]`; -inf marks removed tokens."""
    scaled_v = logits_v / sampling.temperature
    top_k = sampling.top_k if 0 < sampling.top_k < logits_v.shape[-1] else 0
    if not top_k and sampling.top_p >= 1.0:
        return scaled_v
    # Weights in [0, 1] (the best token has exactly 1) order tokens like the logits.
    weights_v = jnp.exp(scaled_v - jnp.max(scaled_v))
    threshold = jnp.float32(0.0)
    if top_k:
        # The k-th largest weight: the largest t with at least k weights >= t.
        threshold = _largest_threshold(weights_v, jnp.ones_like(weights_v), top_k)
    if sampling.top_p < 1.0:
        # Over the top-k survivors, the largest t whose tail mass reaches top_p.
        kept_v = jnp.where(weights_v >= threshold, weights_v, 0.0)
        threshold = _largest_threshold(weights_v, kept_v, sampling.top_p * jnp.sum(kept_v))
    return jnp.where(weights_v >= threshold, scaled_v, -jnp.inf)


def _largest_threshold(weights_v: jax.Array, values_v: jax.Array, target) -> jax.Array:
    """Largest float32 `t` in [0, 1] with `sum(values[weights >= t]) >= target`.

    The tail sum is non-increasing in `t` and non-negative float32 values order like
    their int32 bit patterns, so the search runs over the bit patterns of [0, 1]:
    each pass evaluates the tail sum at `_PROBES_PER_PASS` evenly spaced probes and
    keeps the sub-interval where it crosses the target. Invariant: the tail sum at
    `lo` reaches the target (at t = 0 it is the total) and at `hi` it does not
    (`hi` starts just above 1.0, where it is 0). The result is exact: a single
    float, not an approximation.

    Args:
      weights_v: float32 `[V]` in [0, 1], the order used for the threshold.
      values_v: float32 `[V]` >= 0, what is summed (ones to count, weights for mass).
      target: the sum to reach; must be > 0 and at most `sum(values)`.

    Returns:
      float32 scalar threshold.
    """
    parts = _PROBES_PER_PASS + 1
    fractions = range(1, parts)

    def tail_sums(bits):
        thresholds = lax.bitcast_convert_type(bits, jnp.float32)
        # One sum per probe, not one [probes, V] sum: XLA fuses sibling reductions
        # of the same operand into one kernel that reads the row once, which on
        # GPU is ~2x faster than reducing a broadcast.
        return jnp.stack([
            jnp.sum(jnp.where(weights_v >= thresholds[m], values_v, 0.0))
            for m in range(_PROBES_PER_PASS)
        ])

    def refine(_, bounds):
        lo, hi = bounds
        gap = hi - lo
        # lo + floor(gap * j / parts) without overflowing int32.
        probes = jnp.stack([lo + gap // parts * j + gap % parts * j // parts for j in fractions])
        reaches = tail_sums(probes) >= target
        lo = jnp.max(jnp.where(reaches, probes, lo))
        hi = jnp.min(jnp.where(reaches, hi, probes))
        return lo, hi

    bounds = (jnp.int32(0), jnp.int32(_FLOAT32_ONE_BITS + 1))
    lo, _ = lax.fori_loop(0, _num_search_passes(), refine, bounds)
    return lax.bitcast_convert_type(lo, jnp.float32)


def _num_search_passes() -> int:
    """Passes after which the bit-pattern interval of `_largest_threshold` has width 1."""
    gap, passes = _FLOAT32_ONE_BITS + 1, 0
    while gap > 1:
        gap = math.ceil(gap / (_PROBES_PER_PASS + 1))
        passes += 1
    return passes


def _check_prompts(prompt_ids, prompt_mask, config: ModelConfig) -> None:
    """Shape checks always; value checks (left padding, vocab range) on concrete inputs."""
    if prompt_ids.ndim != 2 or tuple(prompt_ids.shape) != tuple(prompt_mask.shape):
        raise ValueError(
            "prompt_ids and prompt_mask must both be [B, P]; got "
            f"{tuple(prompt_ids.shape)} and {tuple(prompt_mask.shape)}"
        )
    if prompt_ids.shape[1] == 0:
        raise ValueError("prompts must have at least one column (P >= 1)")
    ids, mask = _host_value(prompt_ids), _host_value(prompt_mask)
    if ids is None or mask is None:
        return
    mask = mask.astype(bool)
    _raise_for_first_row(~mask.any(axis=1), "is empty (prompt_mask is all 0)")
    _raise_for_first_row(
        (mask[:, :-1] & ~mask[:, 1:]).any(axis=1),
        "is not left-padded: prompt_mask must be 0..0 1..1 (real tokens at the end)",
    )
    outside = mask & ((ids < 0) | (ids >= config.vocab_size))
    _raise_for_first_row(
        outside.any(axis=1), f"has token ids outside [0, vocab_size={config.vocab_size})"
    )


def _raise_for_first_row(bad_rows: np.ndarray, problem: str) -> None:
    if bad_rows.any():
        row = int(np.argmax(bad_rows))
        raise ValueError(f"prompt row {row} {problem} ({int(bad_rows.sum())} bad row(s))")


def _host_value(x) -> np.ndarray | None:
    """x as a numpy array, or None when it is traced or not fully addressable."""
    if isinstance(x, jax.core.Tracer):
        return None
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return None
    return np.asarray(x)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(
        x, (bool, np.bool_)
    )
