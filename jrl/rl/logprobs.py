"""Memory-bounded log-probabilities and entropy of response tokens.

A `[B, T, V]` float32 logits tensor is never materialised at once: the
unembedding, log-softmax, gather and entropy run over chunks of the response
inside a `lax.scan`, so peak memory is `B * chunk * V` floats instead of
`B * T * V`. The backward pass has its own rule (`jax.custom_vjp`): it keeps only
each token's log-normaliser, recomputes a chunk's logits, forms the gradient of
the log-prob (and entropy) with respect to them in one elementwise pass, and
multiplies that into the gradients of the hidden states and the weight. (Autodiff
of the forward would scatter the gather's gradient into a zero `[B, C, V]` buffer
and run the softmax's backward as several passes over it.)

The backbone's forward can share prompts: a rollout lays out the n samples of a
prompt as consecutive rows, each repeating the prompt. With `group=k`, the rows
are regrouped as `[B / k, P + k R]`, one prompt followed by its k responses, so the
prompt's layers run once per group instead of k times; each response attends to
its group's prompt keys and to its own (`transformer.SharedPrompt`). The outputs
are the plain layout's, row for row, up to floating-point summation order, and
so are the gradients (the prompt's, summed over its k responses).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jrl import sharding
from jrl.kernels import logprob_head
from jrl.models import cache as cache_lib
from jrl.models import context_attention, gemma, heads, moe, transformer
from jrl.models.config import ModelConfig
from jrl.rl import buckets, packing
from jrl.sharding import constrain

Array = jax.Array


def sequence_inputs(prompt_ids, prompt_mask, responses, response_mask):
    """Concatenates left-padded prompts and right-padded responses.

    Returns:
      `(tokens [B, P+R], mask [B, P+R], positions [B, P+R])`.
    """
    tokens = jnp.concatenate([prompt_ids, responses], axis=1).astype(jnp.int32)
    mask = jnp.concatenate([prompt_mask, response_mask], axis=1).astype(jnp.int32)
    return tokens, mask, cache_lib.positions_from_mask(mask)


def _unembedding(params) -> tuple[Array, bool]:
    """The LM head's weight as stored (master dtype) and whether it is `[V, D]` (tied)."""
    if "lm_head" in params:
        return params["lm_head"]["kernel"], False
    return params["embed"]["embedding"], True


def _capped_logits(weight, hidden_bcd, vocab_first, softcap):
    """float32 logits `[B, C, V]` of one chunk, soft-capped where the model is (Gemma's
    `final_logit_softcapping`, before the temperature as the sampler applies it);
    `weight` in the hidden states' dtype (cast once, outside the loop over chunks)."""
    spec = "bcd,vd->bcv" if vocab_first else "bcd,dv->bcv"
    logits = jnp.einsum(spec, hidden_bcd, weight, preferred_element_type=jnp.float32)
    return gemma.softcap(constrain(logits, ("batch", "length", "vocab")), softcap)


def _chunk_logits(weight, hidden_bcd, vocab_first, temperature, softcap=None):
    """`_capped_logits` divided by the temperature."""
    return _capped_logits(weight, hidden_bcd, vocab_first, softcap) / temperature


def _chunk_forward(weight, hidden_bcd, targets_bc, vocab_first, temperature, with_entropy,
                   softcap=None):
    """(log_probs, entropy, log_z), each float32 `[B, C]`, of one chunk."""
    logits_bcv = _chunk_logits(weight, hidden_bcd, vocab_first, temperature, softcap)
    log_z_bc = jax.nn.logsumexp(logits_bcv, axis=-1)
    target_logit_bc = jnp.take_along_axis(logits_bcv, targets_bc[..., None], axis=-1)[..., 0]
    log_probs_bc = target_logit_bc - log_z_bc
    if not with_entropy:
        return log_probs_bc, jnp.zeros_like(log_probs_bc), log_z_bc
    probs_bcv = jnp.exp(logits_bcv - log_z_bc[..., None])
    entropy_bc = log_z_bc - jnp.sum(probs_bcv * logits_bcv, axis=-1)
    return log_probs_bc, entropy_bc, log_z_bc


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _fused_log_probs(weight, hidden_nbcd, targets_nbc, vocab_first, temperature, with_entropy,
                     entropy_grad, impl, softcap=None):
    """`(log_probs, entropy)`, each `[N, B, C]`, over N chunks (`_fused_fwd`, `_fused_bwd`)."""
    out, _ = _fused_fwd(weight, hidden_nbcd, targets_nbc, vocab_first, temperature, with_entropy,
                        entropy_grad, impl, softcap)
    return out


def _fused_fwd(weight, hidden_nbcd, targets_nbc, vocab_first, temperature, with_entropy,
               entropy_grad, impl, softcap=None):
    del entropy_grad
    if impl == "mosaic":  # (never with a soft-cap: `token_log_probs` takes XLA's head)
        lp, ent, log_z = _kernel_forward(weight, hidden_nbcd, targets_nbc, vocab_first,
                                         temperature, with_entropy, impl)
        return (lp, ent), (weight, hidden_nbcd, targets_nbc, log_z, ent)
    compute_weight = weight.astype(hidden_nbcd.dtype)

    def body(_, xs):
        return None, _chunk_forward(compute_weight, *xs, vocab_first, temperature,
                                    with_entropy, softcap)

    _, (lp, ent, log_z) = jax.lax.scan(body, None, (hidden_nbcd, targets_nbc))
    return (lp, ent), (weight, hidden_nbcd, targets_nbc, log_z, ent)


def _kernel_forward(weight, hidden_nbcd, targets_nbc, vocab_first, temperature, with_entropy,
                    impl):
    """`_fused_fwd`'s outputs from `logprob_head.log_softmax_stats`, over all chunks at once
    (no `[B, C, V]` logits: nothing to bound by chunking)."""
    n, b, c, d = hidden_nbcd.shape
    rows = lambda x: x.swapaxes(0, 1).reshape(b, n * c, *x.shape[3:])
    chunks = lambda x: x.reshape(b, n, c).swapaxes(0, 1)
    w = logprob_head.pad_vocab(weight.astype(hidden_nbcd.dtype), vocab_first)
    vocab = weight.shape[0] if vocab_first else weight.shape[1]
    log_z, target, ent = logprob_head.log_softmax_stats(
        rows(hidden_nbcd), w, rows(targets_nbc), vocab=vocab, vocab_first=vocab_first,
        temperature=temperature, with_entropy=with_entropy, impl=impl)
    return chunks(target - log_z), chunks(ent), chunks(log_z)


def _fused_bwd(vocab_first, temperature, with_entropy, entropy_grad, impl, softcap, residuals,
               cotangents):
    """Recomputes each chunk's logits and forms d(loss)/d(logits) in one elementwise pass.

    With `z` the logits and `p = softmax(z)`: `d log p[y] / dz = onehot(y) - p` and
    `dH / dz = -p * (log p + H)`; `z = x @ W / temperature`, or with a soft-cap c
    `z = c tanh(x @ W / c) / temperature`, whose derivative in `x @ W` is
    `(1 - tanh^2) / temperature`. Without `entropy_grad`
    the entropy's cotangent is ignored (its term costs a pass over the chunk's logits).
    With `impl="mosaic"` (and `logprob_head.BACKWARD` "mosaic") d(loss)/d(logits) comes
    from `logprob_head.grad_logits`, the logits recomputed on chip; the two matmuls of the
    chain rule stay XLA's either way.
    """
    weight, hidden_nbcd, targets_nbc, log_z_nbc, ent_nbc = residuals
    g_lp_nbc, g_ent_nbc = cotangents
    vocab = weight.shape[0] if vocab_first else weight.shape[1]
    w = weight.astype(hidden_nbcd.dtype)
    kernel = impl == "mosaic" and logprob_head.BACKWARD == "mosaic"
    if kernel:  # whole vocabulary blocks; the padding's gradients (0) are cut at the end
        w = logprob_head.pad_vocab(w, vocab_first, logprob_head.MOSAIC_BACKWARD)

    def grad_logits(hidden_bcd, targets_bc, log_z_bc, ent_bc, g_lp_bc, g_ent_bc):
        if kernel:
            return logprob_head.grad_logits(
                hidden_bcd, w, targets_bc, log_z_bc, g_lp_bc, g_ent_bc, ent_bc, vocab=vocab,
                vocab_first=vocab_first, temperature=temperature,
                entropy_grad=with_entropy and entropy_grad)
        capped_bcv = _capped_logits(w, hidden_bcd, vocab_first, softcap)
        log_p_bcv = capped_bcv / temperature - log_z_bc[..., None]
        p_bcv = jnp.exp(log_p_bcv)
        onehot_bcv = jnp.arange(vocab)[None, None, :] == targets_bc[..., None]
        grad_bcv = g_lp_bc[..., None] * (onehot_bcv.astype(jnp.float32) - p_bcv)
        if with_entropy and entropy_grad:
            grad_bcv -= g_ent_bc[..., None] * p_bcv * (log_p_bcv + ent_bc[..., None])
        if softcap is not None:
            grad_bcv *= 1 - jnp.square(capped_bcv / softcap)
        return (grad_bcv / temperature).astype(hidden_bcd.dtype)

    def body(grad_w, xs):
        hidden_bcd = xs[0]
        grad_bcv = grad_logits(*xs)
        if vocab_first:
            grad_h_bcd = jnp.einsum("bcv,vd->bcd", grad_bcv, w)
            grad_w_chunk = jnp.einsum("bcv,bcd->vd", grad_bcv, hidden_bcd,
                                      preferred_element_type=jnp.float32)
        else:
            grad_h_bcd = jnp.einsum("bcv,dv->bcd", grad_bcv, w)
            grad_w_chunk = jnp.einsum("bcd,bcv->dv", hidden_bcd, grad_bcv,
                                      preferred_element_type=jnp.float32)
        return grad_w + grad_w_chunk, grad_h_bcd

    xs = (hidden_nbcd, targets_nbc, log_z_nbc, ent_nbc, g_lp_nbc, g_ent_nbc)
    grad_w, grad_h_nbcd = jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32), xs)
    grad_w = grad_w[:vocab] if vocab_first else grad_w[:, :vocab]
    return grad_w.astype(weight.dtype), grad_h_nbcd, None


_fused_log_probs.defvjp(_fused_fwd, _fused_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _traced_temperature_log_probs(weight, hidden_nbcd, targets_nbc, temperature, vocab_first,
                                  with_entropy, entropy_grad, softcap=None):
    """`_fused_log_probs` (XLA) with `temperature` a traced operand (one run's own in a
    sweep, `jrl.rl.runs`), not differentiated: the same forward and backward passes."""
    return _fused_fwd(weight, hidden_nbcd, targets_nbc, vocab_first, temperature,
                      with_entropy, entropy_grad, "xla", softcap)[0]


def _traced_fwd(weight, hidden_nbcd, targets_nbc, temperature, vocab_first, with_entropy,
                entropy_grad, softcap=None):
    out, residuals = _fused_fwd(weight, hidden_nbcd, targets_nbc, vocab_first, temperature,
                                with_entropy, entropy_grad, "xla", softcap)
    return out, (residuals, temperature)


def _traced_bwd(vocab_first, with_entropy, entropy_grad, softcap, residuals, cotangents):
    residuals, temperature = residuals
    grads = _fused_bwd(vocab_first, temperature, with_entropy, entropy_grad, "xla", softcap,
                       residuals, cotangents)
    return (*grads, None)


_traced_temperature_log_probs.defvjp(_traced_fwd, _traced_bwd)


def token_log_probs(
    params,
    hidden_brd: Array,
    targets_br: Array,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = 128,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    impl: str = "auto",
    softcap: float | None = None,
):
    """Log-probs (and entropy) of `targets` given the hidden states that predict them.

    Args:
      params: model parameters (for the unembedding).
      hidden_brd: `[B, R, D]`; `hidden[:, t]` is the state that predicts `targets[:, t]`.
      targets_br: int `[B, R]` token ids.
      temperature: logits are divided by it (as the sampler did).
      chunk_size: response tokens per chunk (None: all of them, one chunk).
      with_entropy: also compute the entropy of each predictive distribution.
      entropy_grad: whether the entropy is differentiated; False when it only feeds a
        metric (its gradient is then taken as zero, and the backward pass skips it).
      impl: "xla" (chunked logits), "mosaic" (`jrl.kernels.logprob_head`, on Hopper GPUs:
        no logits in memory in the forward pass; chunks bound only the backward's) or
        "auto" (the kernel where it applies, `logprob_head.choose_impl`).
      softcap: the model's `final_logit_softcapping` (Gemma): the logits `z` become
        `cap * tanh(z / cap)` before the temperature and the log-softmax, as the sampler's
        (`heads.unembed`). The kernel has no soft-cap: with one the head is XLA's
        ("mosaic" is then refused).

    Returns:
      `(log_probs [B, R], entropy [B, R])` in float32 (entropy zeros if not asked).
    """
    if softcap is not None and impl == "mosaic":
        raise ValueError("the log-prob head's kernel has no soft-cap; use impl 'auto' or "
                         "'xla' for a model with final_logit_softcapping")
    b, r, d = hidden_brd.shape
    if r == 0:
        empty = jnp.zeros((b, 0), jnp.float32)
        return empty, empty
    chunk = r if chunk_size is None else min(chunk_size, r)
    pad = (-r) % chunk
    hidden_brd = jnp.pad(hidden_brd, ((0, 0), (0, pad), (0, 0)))
    targets_br = jnp.pad(targets_br, ((0, 0), (0, pad)))
    n = (r + pad) // chunk
    # Each chunk's tokens split over `context` (if any): every device of a group runs
    # its share of every chunk, not whole chunks of its own.
    hidden_nbcd = constrain(hidden_brd.reshape(b, n, chunk, d).swapaxes(0, 1),
                            (None, "batch", "length", None))
    targets_nbc = constrain(targets_br.reshape(b, n, chunk).swapaxes(0, 1),
                            (None, "batch", "length"))

    weight, vocab_first = _unembedding(params)
    if isinstance(temperature, int | float):
        impl = ("xla" if softcap is not None
                else logprob_head.choose_impl(impl, d, with_entropy, hidden_brd.dtype))
        lp_nbc, ent_nbc = _fused_log_probs(weight, hidden_nbcd, targets_nbc, vocab_first,
                                           temperature, with_entropy, entropy_grad, impl,
                                           softcap)
    else:  # traced (a sweep's run): an operand, and the XLA head (the kernel's is static)
        lp_nbc, ent_nbc = _traced_temperature_log_probs(
            weight, hidden_nbcd, targets_nbc, temperature, vocab_first, with_entropy,
            entropy_grad, softcap)
    unchunk = lambda x: x.swapaxes(0, 1).reshape(b, n * chunk)[:, :r]
    return unchunk(lp_nbc), unchunk(ent_nbc)


def prompt_group(samples_per_prompt: int, micro_batch: int) -> int:
    """Rows per shared prompt for passes over micro-batches of `micro_batch` rows whose
    runs of `samples_per_prompt` rows share a prompt: the largest k dividing both
    `samples_per_prompt` and each batch shard's rows (so no group straddles two
    micro-batches or two shards); 1 when none (no sharing)."""
    sharder = sharding.active_sharder()
    shards = 1 if sharder is None else sharder.batch_size_multiple
    # The shared layout's rows are of unequal parts (prompt, k responses); context
    # parallelism splits the plain layout only.
    if micro_batch % shards or (sharder is not None and sharder.context > 1):
        return 1
    return math.gcd(samples_per_prompt, micro_batch // shards)


def prompt_mismatch(prompt_ids, prompt_mask, group: int) -> Array:
    """float32: how many rows hold another prompt (ids or mask) than the first row of
    their run of `group` rows, i.e. break the layout `response_hidden(group=...)` needs."""
    def differs(x):
        runs = x.reshape(-1, group, x.shape[-1])
        return jnp.any(runs != runs[:, :1], axis=-1).reshape(-1)

    return jnp.sum(differs(prompt_ids) | differs(prompt_mask)).astype(jnp.float32)


def _even_lengths(prompt_ids, prompt_mask, responses, response_mask, group: int,
                  routing=()):
    """The inputs with masked columns added where cuDNN's attention needs even lengths
    (else it falls back to XLA's), or the `context` axis a multiple of its size
    (`jrl.models.context_attention`; the plain layout only): on the left of the prompts
    when P (the plain layout: P + R) is not a multiple, and in the shared layout on the
    right of the responses when R is odd. Masked columns change no real token's output
    (positions follow the mask). `routing`: the recorded `(prompt_routing,
    response_routing)` to pad alike (with `moe.NOT_RECORDED`), or ()."""
    def pad(x, left, right, value=0):
        widths = ((0, 0), (left, right)) + ((0, 0),) * (x.ndim - 2)
        return jnp.pad(x, widths, constant_values=value)

    routing = list(routing)
    p, r = prompt_ids.shape[1], responses.shape[1]
    multiple = 2 if group > 1 else max(2, context_attention.context_size())
    extra = -(p if group > 1 else p + r) % multiple
    if extra:
        prompt_ids, prompt_mask = pad(prompt_ids, extra, 0), pad(prompt_mask, extra, 0)
        if routing:
            routing[0] = pad(routing[0], extra, 0, moe.NOT_RECORDED)
    if group > 1 and r % 2:
        responses, response_mask = pad(responses, 0, 1), pad(response_mask, 0, 1)
        if routing:
            routing[1] = pad(routing[1], 0, 1, moe.NOT_RECORDED)
    return prompt_ids, prompt_mask, responses, response_mask, tuple(routing)


def _forward(params, tokens, positions, mask, config: ModelConfig, with_router: bool,
             routing=None, record: bool = False):
    """The training forward's hidden states, and an MoE model's router statistics when
    `with_router` (else None); `routing`: the experts to replay (`transformer.forward`);
    with `record`, a third: each token's experts `[B, T, L, k]`."""
    if with_router or record:
        out = transformer.forward_with_router(params, tokens, positions, mask, config=config,
                                              routing=routing, record=record)
        return out if with_router else (out[0], None, *out[2:])
    return transformer.forward(params, tokens, positions, mask, config=config,
                               routing=routing)[0], None


class Recorded(NamedTuple):
    """A pass's per-token outputs with the experts its forward chose (`actor.router_replay`
    = "old_log_prob"): `prompt_routing [B, P, L, k]`, `response_routing [B, R, L, k]`,
    laid out as `Rollout`'s."""

    outputs: Any
    prompt_routing: jax.Array
    response_routing: jax.Array


def response_hidden(params, prompt_ids, prompt_mask, responses, response_mask,
                    prompt_routing=None, response_routing=None, *,
                    config: ModelConfig, group: int = 1, with_router: bool = False,
                    record: bool = False):
    """Hidden states `[B, R, D]` that predict each response token (one full forward).

    `group`: k > 1 when each run of k consecutive rows holds the same prompt (ids and
    mask): the prompt's layers then run once per run (the module docstring).
    `with_router`: return `(hidden, router statistics)` of an MoE model
    (`transformer.forward_with_router`), each row's prompt counted once per row in either
    layout. `prompt_routing [B, P, L, k]`, `response_routing [B, R, L, k]`: an MoE model's
    experts to replay (the rollout's), or None. `record`: also return the experts the
    forward chose, `(prompt_routing, response_routing)` shaped as those, last.
    """
    p_in, r_out = prompt_ids.shape[1], responses.shape[1]
    recorded = () if prompt_routing is None else (prompt_routing, response_routing)
    prompt_ids, prompt_mask, responses, response_mask, recorded = _even_lengths(
        prompt_ids, prompt_mask, responses, response_mask, group, recorded)
    tokens, mask, positions = sequence_inputs(prompt_ids, prompt_mask, responses, response_mask)
    routing = jnp.concatenate(recorded, axis=1) if recorded else None
    p = prompt_ids.shape[1]
    r = responses.shape[1]

    def finish(hidden_brd, stats, chosen=()):
        out = (hidden_brd, stats) if with_router else (hidden_brd,)
        if record:  # the columns `_even_lengths` added dropped
            (experts_btlk,) = chosen
            out += ((experts_btlk[:, p - p_in:p], experts_btlk[:, p:p + r_out]),)
        return out if len(out) > 1 else out[0]

    if group == 1:
        hidden_btd, stats, *chosen = _forward(params, tokens, positions, mask, config,
                                              with_router, routing, record)
        return finish(hidden_btd[:, p - 1 : p + r - 1], stats, chosen)
    b = tokens.shape[0]
    if b % group:
        raise ValueError(f"{b} rows do not split into groups of {group} sharing a prompt")
    g = b // group
    first = lambda x: x.reshape(g, group, *x.shape[1:])[:, 0]  # the group's prompt
    grouped = lambda x: jnp.concatenate(
        [first(x[:, :p]), x[:, p:].reshape(g, group * r, *x.shape[2:])], 1)
    shared = transformer.SharedPrompt(first(mask[:, :p]), mask)
    hidden_gtd, stats, *chosen = _forward(
        params, grouped(tokens), grouped(positions), shared, config, with_router,
        None if routing is None else grouped(routing), record)
    # Response token 0 is predicted by the prompt's last position, token t by response t-1.
    last_prompt = jnp.repeat(hidden_gtd[:, p - 1 : p], group, axis=0)
    own = hidden_gtd[:, p:].reshape(b, r, hidden_gtd.shape[-1])[:, : max(r_out - 1, 0)]
    hidden_brd = jnp.concatenate([last_prompt, own], axis=1)[:, :r_out]  # R = 0: none
    hidden_brd = constrain(hidden_brd, ("batch", None, None))
    # The plain layout's rows of the experts chosen: each group's prompt for its k rows.
    chosen = [jnp.concatenate([jnp.repeat(x[:, :p], group, axis=0),
                               x[:, p:].reshape(b, r, *x.shape[2:])], axis=1) for x in chosen]
    return finish(hidden_brd, stats, chosen)


def response_log_probs(params, prompt_ids, prompt_mask, responses, response_mask,
                       prompt_routing=None, response_routing=None, *,
                       config: ModelConfig, temperature: float = 1.0, chunk_size: int = 128,
                       with_entropy: bool = False, group: int = 1, record: bool = False):
    """Log-probs `[B, R]` of the responses under `params` (and entropy `[B, R]`);
    `group`, the routing to replay and `record` (then a `Recorded` of those outputs) as
    in `response_hidden`."""
    hidden = response_hidden(params, prompt_ids, prompt_mask, responses, response_mask,
                             prompt_routing, response_routing, config=config, group=group,
                             record=record)
    if record:
        hidden, chosen = hidden
    out = token_log_probs(params, hidden, responses, temperature=temperature,
                          chunk_size=chunk_size, with_entropy=with_entropy,
                          impl=config.logprob_impl, softcap=config.final_logit_softcapping)
    return Recorded(out, *chosen) if record else out


def response_values(critic_params, prompt_ids, prompt_mask, responses, response_mask, *,
                    config: ModelConfig, group: int = 1) -> Array:
    """Critic values `[B, R]`: the value of the state before each response token;
    `group` as in `response_hidden`."""
    hidden = response_hidden(critic_params, prompt_ids, prompt_mask, responses, response_mask,
                             config=config, group=group)
    return heads.values(critic_params, hidden)


def in_micro_batches(fn, micro_batch: int | None, bucket_sizes: Sequence[int] = (),
                     group: int = 1):
    """`fn(params, prompt_ids, prompt_mask, responses, attention_mask[, prompt_routing,
    response_routing]) -> outputs`, run over micro-batches of `micro_batch` rows.

    The rows `[N, ...]` are viewed as `[N / micro_batch, micro_batch, ...]` and mapped
    sequentially (`lax.map`), so activations and logits are bounded by one micro-batch;
    each micro-batch is split over the mesh's batch axes. None: one pass over all rows.
    With more than one of `bucket_sizes` (`jrl.rl.buckets`), the rows are sorted by their
    used response length first, and each micro-batch runs on the response columns its
    longest row needs; the outputs (`[N, R, ...]` each) come back in the rows' order,
    zero after the columns run. With `group` k > 1, runs of k rows share a prompt
    (`response_hidden`): `fn` gets `group=k`, and sorting moves whole runs (by their
    longest row).
    """
    if group > 1:
        fn = functools.partial(fn, group=group)
    if micro_batch is None and len(bucket_sizes) < 2:
        return fn

    def bucketed(params, prompt_ids, prompt_mask, responses, attention_mask, *routing):
        if len(bucket_sizes) < 2:
            return fn(params, prompt_ids, prompt_mask, responses, attention_mask, *routing)
        r = responses.shape[1]
        prompt_routing = routing[:1]  # the response routing is cut with the responses

        def branch(size):
            def run(responses, attention_mask, *response_routing):
                out = fn(params, prompt_ids, prompt_mask, responses[:, :size],
                         attention_mask[:, :size], *prompt_routing,
                         *(x[:, :size] for x in response_routing))
                if isinstance(out, Recorded):  # the prompts' experts are not cut
                    return out._replace(outputs=buckets.pad_columns(out.outputs, r),
                                        response_routing=buckets.pad_columns(
                                            out.response_routing, r, moe.NOT_RECORDED))
                return buckets.pad_columns(out, r)
            return run

        length = jnp.max(buckets.used_lengths(attention_mask))
        return buckets.switch(length, bucket_sizes, branch, responses, attention_mask,
                              *routing[1:])

    def mapped(params, *arrays):
        n = arrays[0].shape[0]
        micro = n if micro_batch is None else micro_batch
        if n % micro:
            raise ValueError(f"{n} rows do not split into micro-batches of {micro}")
        order = None
        if len(bucket_sizes) > 1:
            order = buckets.sort_order(buckets.used_lengths(arrays[3]), group)
            arrays = tuple(x[order] for x in arrays)
        split = lambda x: constrain(x.reshape(n // micro, micro, *x.shape[1:]),
                                    (None, "batch") + (None,) * (x.ndim - 1))
        out = jax.lax.map(lambda xs: bucketed(params, *xs), tuple(split(x) for x in arrays))
        merge = lambda y: constrain(y.reshape(n, *y.shape[2:]), ("batch",) + (None,) * (y.ndim - 2))
        out = jax.tree.map(merge, out)
        if order is not None:
            inverse = jnp.argsort(order)
            out = jax.tree.map(lambda y: y[inverse], out)
        return out

    return mapped


# Tokens per chunk of the head in packed passes (logits [tokens, V] in float32 at once).
_HEAD_TOKENS = 2048


def _packed_hidden(params, micro: packing.Micro, config: ModelConfig,
                   with_router: bool = False):
    """Hidden states `[G, L, D]` of a packed micro-batch, each slot's next token, and the
    router statistics of an MoE model when `with_router` (else None)."""
    tokens, positions, segments, targets = micro.inputs()
    hidden, stats = _forward(params, tokens, positions, segments, config, with_router)
    return hidden, targets, stats


def packed_log_probs(params, micro: packing.Micro, *, config: ModelConfig,
                     temperature: float = 1.0, chunk_size: int = 128,
                     with_entropy: bool = False, entropy_grad: bool = True,
                     with_router: bool = False):
    """Per slot of a packed micro-batch, the log-prob (and entropy) of the token in the
    next slot, `[G, L]` each (`packing.Micro.responses` takes them to the response grid);
    with `with_router`, an MoE model's router statistics as a third output."""
    hidden_gld, targets_gl, stats = _packed_hidden(params, micro, config, with_router)
    # The head runs on the slots as `[rows, W]` so that a chunk of `chunk_size` columns
    # spans about _HEAD_TOKENS tokens (of one packed row it would be a thin matmul).
    g, length, d = hidden_gld.shape
    rows = math.gcd(g * length, max(1, _HEAD_TOKENS // chunk_size))
    log_probs, entropy = token_log_probs(
        params, hidden_gld.reshape(rows, -1, d), targets_gl.reshape(rows, -1),
        temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy,
        entropy_grad=entropy_grad, impl=config.logprob_impl,
        softcap=config.final_logit_softcapping)
    out = log_probs.reshape(g, length), entropy.reshape(g, length)
    return (*out, stats) if with_router else out


def packed_values(critic_params, micro: packing.Micro, *, config: ModelConfig) -> Array:
    """Per slot of a packed micro-batch, the critic's value of the state after it `[G, L]`."""
    hidden, _, _ = _packed_hidden(critic_params, micro, config)
    return heads.values(critic_params, hidden)


def packed_pass(slot_fn, params, plan: packing.Plan, attention_mask) -> Array:
    """`slot_fn(params, micro)` (`packed_log_probs`, `packed_values`) over the plan's
    token-budget micro-batches (`jrl.rl.packing`), its per-slot outputs gathered to the
    `[N, R]` grid of the response tokens (`attention_mask`: those attended to): the
    counterpart of `in_micro_batches`. One plan serves every pass over the same
    sequences."""
    fn = functools.partial(slot_fn, params)
    shapes = jax.eval_shape(fn, packing.Micro(plan, jnp.int32(0)))
    return packing.map_responses(fn, plan, attention_mask, shapes)
