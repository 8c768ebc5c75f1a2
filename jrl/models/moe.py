"""Mixture-of-experts MLP of the Qwen3-MoE and Mixtral families: top-k routing and dropless
dispatch through grouped matmuls.

Each token's hidden state goes through a router (`[D, E]`, no bias), a softmax over the E
experts in float32, and the top k of those probabilities; with `norm_topk_prob` (always
for Mixtral) the k weights are divided by their sum. The token's output is the weighted
sum of its k experts' SwiGLU MLPs:

    y = sum_j w_j * down_e(silu(gate_e(x)) * up_e(x)),   e = e_j, j < k

Dispatch is dropless: the N k (token, expert) pairs are sorted by expert, so that each
expert's tokens are one contiguous group, and every projection is one grouped matmul
over the groups (`jrl.kernels.grouped_matmul`). No token is dropped and no capacity is padded;
the cost follows the tokens, not E times the tokens. The outputs go back to their tokens
by the inverse permutation and are summed over each token's k pairs (`spread` and
`collect`, gathers both ways). The routing weights multiply each row's hidden values
before the down projection, the same sum as weighting its outputs, so that the backward
keeps no `[N k, D]` output for the weights' gradient.

Parameter tree of one layer (`[L, ...]` stacked by the layer scan; E experts, F the
experts' width, `moe_intermediate_size`):

    mlp/router/kernel          [D, E]       (embed, None)
    mlp/gate_proj/kernel       [E, D, F]    (experts, embed, mlp)
    mlp/up_proj/kernel         [E, D, F]
    mlp/down_proj/kernel       [E, F, D]    (experts, mlp, embed)
    mlp/gate_up_proj/kernel    [E, D, 2F]   the sampler's: gate and up joined
    mlp/<name>_lora/{a, b}     [E, in, r], [E, r, out]   LoRA on the experts

Routing replay (verl's `router_replay`): the sampler records each token's k experts in
every layer (`RECORD_COLLECTION`), and the training passes route each token to its
recorded experts instead of their own top k (`forced`), the weights still the training
router's probabilities of those experts (renormalised as configured); a token with no
record (`NOT_RECORDED`) takes its own top k.

The router's load-balancing loss is transformers' `load_balancing_loss_func` (Switch
Transformer, Fedus et al. 2021, eqs. 4-6, generalised to k experts a token): with
`f_e` the share of the (token, choice) pairs routed to expert e and `P_e` the mean
router probability of e, both over every layer's valid tokens,
`loss = E * sum_e (k f_e) P_e`. The layers record the sums it needs (`RouterStats`).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from jrl import sharding
from jrl.kernels import grouped_matmul

# The collection and name under which each MoE layer records its router statistics
# (`nn.Module.sow`); `transformer.forward_with_router` collects them.
ROUTER_COLLECTION, ROUTER_NAME = "intermediates", "router_stats"
# ... and each token's chosen experts, `[B, T, k]` (routing replay; the sampler's forwards).
RECORD_COLLECTION, RECORD_NAME = "routing", "experts"
# A recorded expert id meaning "no record": the token routes itself.
NOT_RECORDED = -1
# The mesh axis the experts are split over (expert parallelism).
EXPERT_AXIS = "expert"
# Names (`jax.ad_checkpoint.checkpoint_name`) of the block's values that the
# `dots_saveable` remat policy keeps, as it keeps a dense projection's output: each
# expert projection's output (LoRA included), each adapter's rank-r product, and the
# dispatch (two permutations and E sizes). The backward then runs no grouped matmul
# and no sort of the forward again; what it recomputes (the router's `[N, E]` logits
# and top-k, the rows' gather, the SwiGLU) is small or memory-bound.
EXPERTS_OUT, EXPERTS_LOW, EXPERTS_DISPATCH = "experts_out", "experts_low", "experts_dispatch"
SAVED_NAMES = (EXPERTS_OUT, EXPERTS_LOW, EXPERTS_DISPATCH)
GATE_UP = ("gate_proj", "up_proj")
# The experts' gate and up kernels joined, `[E, D, 2F]` (gate's F columns first), which
# the sampler's layer carries instead of the two (`transformer.fuse_projections`, where
# neither has an unmerged adapter and no mesh axis splits F): one grouped matmul instead
# of two, reading the same weights: Qwen3-30B-A3B's shapes (12 layers) at 256 rows on
# one H100, 27,292 against 26,826 tok/s. Never trained or saved: a training pass would
# copy them into the joined kernel each call, which takes what the matmul gains
# (docs/performance.md).
# `JOIN_GATE_UP` (read when a program is traced): whether the sampler joins them (the
# benches compare both).
GATE_UP_JOINED = "gate_up_proj"
JOIN_GATE_UP = True


def join_gate_up(mlp: dict) -> dict:
    """An MoE layer's `mlp` parameters with the experts' gate and up kernels as one
    `GATE_UP_JOINED` kernel `[E, D, 2F]`, gate's columns first (the sampler's layout)."""
    rest = {name: w for name, w in mlp.items() if name not in GATE_UP}
    kernel = jnp.concatenate([mlp[name]["kernel"] for name in GATE_UP], axis=-1)
    return {**rest, GATE_UP_JOINED: {"kernel": kernel}}


class Routing(NamedTuple):
    """Each token's experts and weights.

    Attributes:
      experts_nk: int32 `[N, k]`, the chosen experts, most probable first.
      weights_nk: float32 `[N, k]`, their weights (renormalised where configured).
      probs_ne: float32 `[N, E]`, the router's full softmax.
    """

    experts_nk: jax.Array
    weights_nk: jax.Array
    probs_ne: jax.Array


class RouterStats(NamedTuple):
    """Sums over one layer's valid tokens (stacked `[L, ...]` over layers by the scan).

    Attributes:
      assigned_e: float32 `[E]`, (token, choice) pairs routed to each expert.
      probs_e: float32 `[E]`, the router's probabilities summed over the tokens.
      tokens: float32 `[]`, the valid tokens.
    """

    assigned_e: jax.Array
    probs_e: jax.Array
    tokens: jax.Array


def route(logits_ne: jax.Array, k: int, normalize: bool,
          forced_nk: jax.Array | None = None) -> Routing:
    """Top-k routing as transformers computes it: softmax in float32, the k largest
    probabilities (ties to the lower expert index), renormalised to sum to 1 when
    `normalize`. `forced_nk`: experts to route each token to instead (routing replay),
    their weights the same probabilities'; rows of `NOT_RECORDED` route themselves."""
    probs = jax.nn.softmax(logits_ne.astype(jnp.float32), axis=-1)
    weights, experts = lax.top_k(probs, k)
    if forced_nk is not None:
        recorded = jnp.all(forced_nk != NOT_RECORDED, axis=-1, keepdims=True)
        experts = jnp.where(recorded, forced_nk.astype(jnp.int32), experts)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(experts.astype(jnp.int32), weights, probs)


def router_stats(routing: Routing, valid_n: jax.Array | None) -> RouterStats:
    """The layer's sums for the load-balancing loss and the load metrics; `valid_n`
    (`[N]`, 1 for a real token) leaves padding out, as transformers' attention mask
    does. None: every token counts."""
    num_experts = routing.probs_ne.shape[-1]
    valid = (jnp.ones(routing.probs_ne.shape[:1], jnp.float32) if valid_n is None
             else valid_n.astype(jnp.float32))
    per_choice = jnp.repeat(valid, routing.experts_nk.shape[1])
    assigned = jnp.zeros((num_experts,), jnp.float32).at[routing.experts_nk.reshape(-1)].add(
        per_choice)
    return RouterStats(assigned, jnp.einsum("ne,n->e", routing.probs_ne, valid),
                       jnp.sum(valid))


def active_size(tree, config) -> float:
    """Parameters of `tree` (a model's, or part of one: adapters) a token runs through:
    each MoE layer's experts count `num_experts_per_tok / num_experts` of their size (a
    token's k experts), the rest whole; the count behind an MoE model's FLOPs a token."""
    share = config.num_experts_per_tok / config.num_experts if config.is_moe else 1.0
    total = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = [getattr(p, "key", None) for p in path]
        expert = ("mlp" in keys and "router" not in keys and config.is_moe)
        total += leaf.size * (share if expert else 1.0)
    return total


def load_balancing_loss(stats: RouterStats) -> jax.Array:
    """transformers' auxiliary loss from the layers' stacked `RouterStats`: every layer's
    tokens pooled, `E * sum_e (assigned_e / tokens) (probs_e / tokens)`. 0 when no token
    is valid."""
    num_experts = stats.probs_e.shape[-1]
    tokens = jnp.maximum(jnp.sum(stats.tokens), 1.0)
    assigned = jnp.sum(stats.assigned_e.reshape(-1, num_experts), axis=0) / tokens
    probs = jnp.sum(stats.probs_e.reshape(-1, num_experts), axis=0) / tokens
    return num_experts * jnp.sum(assigned * probs)


def load_metrics(stats: RouterStats) -> dict[str, jax.Array]:
    """Tokens per expert (each layer's (token, choice) pairs; min, mean and max over
    the layers' experts) and the load imbalance, each layer's busiest expert over its
    mean, averaged over the layers (1: balanced; E / k: each token to the same k)."""
    num_experts = stats.assigned_e.shape[-1]
    assigned = stats.assigned_e.reshape(-1, num_experts)
    mean = jnp.mean(assigned, axis=-1)
    imbalance = jnp.max(assigned, axis=-1) / jnp.maximum(mean, 1e-9)
    return {"moe/tokens_per_expert_min": jnp.min(assigned),
            "moe/tokens_per_expert_mean": jnp.mean(assigned),
            "moe/tokens_per_expert_max": jnp.max(assigned),
            "moe/max_over_mean_load": jnp.mean(imbalance)}


class Dispatch(NamedTuple):
    """The (token, choice) pairs sorted by expert.

    Attributes:
      order: int32 `[N k]`, the pairs' flat indices (`n k + j`) in expert order.
      inverse: int32 `[N k]`, each pair's row in that order (`inverse[order[r]] = r`).
      group_sizes: int32 `[E]`, pairs per expert (the grouped matmuls' groups).
    """

    order: jax.Array
    inverse: jax.Array
    group_sizes: jax.Array


def dispatch(experts_nk: jax.Array, num_experts: int) -> Dispatch:
    flat = experts_nk.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
    sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    return Dispatch(*(checkpoint_name(x, EXPERTS_DISPATCH) for x in (order, inverse, sizes)))


# The rows' moves between token order and expert order, each the other's transpose, as
# gathers in both directions: autodiff would transpose a gather into a scatter-add of
# `[N k, D]` rows, which a GPU runs with atomic adds.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def spread(x_nd, order, inverse, k: int):
    """`[N k, D]`: row r is token `order[r] // k`'s (each token's row, k times, sorted
    by expert)."""
    return jnp.take(x_nd, order // k, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def collect(x_md, order, inverse, k: int):
    """`[N, D]`: each token's k rows (in expert order) summed, in float32, returned in
    the rows' dtype; the transpose of `spread`."""
    x_nkd = jnp.take(x_md, inverse, axis=0).reshape(-1, k, x_md.shape[-1])
    return jnp.sum(x_nkd.astype(jnp.float32), axis=1).astype(x_md.dtype)


def _spread_fwd(x_nd, order, inverse, k):
    return spread(x_nd, order, inverse, k), (order, inverse)


def _spread_bwd(k, residuals, d_md):
    return collect(d_md, *residuals, k), None, None


def _collect_fwd(x_md, order, inverse, k):
    return collect(x_md, order, inverse, k), (order, inverse)


def _collect_bwd(k, residuals, d_nd):
    return spread(d_nd, *residuals, k), None, None


spread.defvjp(_spread_fwd, _spread_bwd)
collect.defvjp(_collect_fwd, _collect_bwd)


class _Kernel(nn.Module):
    """A parameter `kernel` of `shape` (normal init, logical `axes`), returned as it is:
    the block applies its kernels itself (`experts`), inside a `shard_map` under expert
    parallelism."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    stddev: float
    param_dtype: str

    @nn.compact
    def __call__(self) -> jax.Array:
        init = nn.with_logical_partitioning(nn.initializers.normal(self.stddev), self.axes)
        return self.param("kernel", init, self.shape, self.param_dtype)


class _Adapter(nn.Module):
    """The LoRA adapter of one projection of every expert: `a [E, D_in, r]` (uniform in
    `±1/sqrt(D_in)`) and `b [E, r, D_out]` (zero), as `transformer.Lora` for a dense
    projection; returned as they are."""

    shape: tuple[int, int, int]  # the kernel's, [E, D_in, D_out]
    axes: tuple[str, str, str]
    rank: int
    param_dtype: str

    @nn.compact
    def __call__(self) -> tuple[jax.Array, jax.Array]:
        e, d_in, d_out = self.shape
        experts, in_axis, out_axis = self.axes
        bound = 1.0 / math.sqrt(d_in)
        uniform = lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)
        a = self.param("a", nn.with_logical_partitioning(uniform, (experts, in_axis, None)),
                       (e, d_in, self.rank), self.param_dtype)
        b = self.param("b", nn.with_logical_partitioning(nn.initializers.zeros,
                                                          (experts, None, out_axis)),
                       (e, self.rank, d_out), self.param_dtype)
        return a, b


# The experts' projections: name, logical axes of the kernel `[E, D_in, D_out]`.
_PROJECTIONS = (("gate_proj", ("experts", "embed", "mlp")),
                ("up_proj", ("experts", "embed", "mlp")),
                ("down_proj", ("experts", "mlp", "embed")))


def experts_mlp(x_md, kernels, adapters, group_sizes, *, dtype, lora_scale: float = 1.0,
                row_weights_m=None, rows_per_group: int | None = None):
    """Each row's expert's SwiGLU MLP, rows sorted by expert (`group_sizes` of them for
    each of the kernels' experts; rows past their sum come out as zeros or garbage and
    are the caller's to discard): `down(silu(gate(x)) * up(x) * w)`, with LoRA adapters
    `(x a_e) b_e * lora_scale` where `adapters` has them, and `w` each row's routing
    weight (`row_weights_m [M]`, None: 1) applied in its dtype before the down projection.
    The hidden values of rows past the groups are zeroed before it: the kernels leave
    those rows unwritten, and whatever they hold (NaN) would reach the weights' gradient.
    `rows_per_group`: as `grouped_matmul` takes it.

    Each projection's output is named `EXPERTS_OUT` and each adapter's rank-r product
    `EXPERTS_LOW`, for the remat policies to keep. With adapters on both gate and up,
    their `a`s run as one grouped matmul of width 2r, which reads the rows once."""
    grouped = lambda rows, w: grouped_matmul.grouped_matmul(
        rows, w.astype(dtype), group_sizes, rows_per_group=rows_per_group)
    rows = x_md.astype(dtype)
    lows = {}
    if all(name in adapters for name in GATE_UP):
        a_gate, a_up = (adapters[name][0] for name in GATE_UP)
        low = checkpoint_name(grouped(rows, jnp.concatenate([a_gate, a_up], axis=-1)),
                              EXPERTS_LOW)
        lows = dict(zip(GATE_UP, jnp.split(low, 2, axis=-1), strict=True))

    def project(name, rows):
        out = grouped(rows, kernels[name])
        if name in adapters:
            a, b = adapters[name]
            low = lows[name] if name in lows else checkpoint_name(grouped(rows, a), EXPERTS_LOW)
            out = out + grouped(low, b) * jnp.asarray(lora_scale, dtype)
        return checkpoint_name(out, EXPERTS_OUT)

    if GATE_UP_JOINED in kernels:
        if any(name in adapters for name in GATE_UP):
            raise ValueError("the experts' joined gate/up kernel takes no adapters")
        gate_up = checkpoint_name(grouped(rows, kernels[GATE_UP_JOINED]), EXPERTS_OUT)
        gate, up = jnp.split(gate_up, 2, axis=-1)
    else:
        gate, up = (project(name, rows) for name in GATE_UP)
    grouped_rows = jnp.arange(x_md.shape[0]) < jnp.sum(group_sizes)
    hidden = jnp.where(grouped_rows[:, None], nn.silu(gate) * up, 0)
    if row_weights_m is not None:
        hidden = hidden.astype(row_weights_m.dtype) * row_weights_m[:, None]
    return project("down_proj", hidden.astype(dtype))


def _row_weights(weights_nk, order, family: str, dtype):
    """Each sorted row's routing weight `[N k]`: Qwen3-MoE's cast to the compute dtype,
    Mixtral's float32 (as transformers weighs them)."""
    weights = weights_nk.astype(jnp.float32 if family == "mixtral" else dtype)
    return jnp.take(weights.reshape(-1), order)


def _route_tokens(x_nd, router_de, forced_nk, config) -> Routing:
    """The router's logits `x W_r` in the compute dtype, then `route`."""
    c = config
    logits = jnp.einsum("nd,de->ne", x_nd.astype(c.dtype), router_de.astype(c.dtype))
    return route(logits, c.num_experts_per_tok, c.norm_topk_prob, forced_nk)


def _block(x_nd, router_de, kernels, adapters, forced_nk, *, config):
    """The MoE block on one device's tokens with every expert there: `(out [N, D],
    routing)`."""
    c = config
    routing = _route_tokens(x_nd, router_de, forced_nk, c)
    plan = dispatch(routing.experts_nk, c.num_experts)
    out_nd = _experts(x_nd, routing.weights_nk, plan, kernels, adapters, plan.group_sizes,
                      config=c)
    return out_nd, routing


def _expert_parallel_block(x_nd, router_de, kernels, adapters, forced_nk, *, config,
                           axis: str):
    """`_block` inside a `shard_map` over the expert axis `axis` (size P): this device
    holds E / P of the experts and 1 / P of the tokens. The tokens of the P devices are
    gathered (each device routes all of them, the router being replicated), each device
    runs the (token, choice) pairs routed to its own experts, sorted first, through its
    experts' grouped matmuls, and the partial outputs are summed back to the devices
    that hold the tokens (a reduce-scatter). Dropless, with no capacity: a device's
    grouped matmuls cover exactly the pairs routed to its experts."""
    c = config
    e_local = kernels["down_proj"].shape[0]
    gather = lambda x: None if x is None else lax.all_gather(x, axis, axis=0, tiled=True)
    x_all = gather(x_nd)
    routing = _route_tokens(x_all, router_de, gather(forced_nk), c)
    local = routing.experts_nk - lax.axis_index(axis) * e_local
    mine = (local >= 0) & (local < e_local)
    # Other devices' pairs sort after this device's (group e_local, which no kernel has).
    plan = dispatch(jnp.where(mine, local, e_local), e_local + 1)
    out_nd = _experts(x_all, routing.weights_nk, plan, kernels, adapters,
                      plan.group_sizes[:e_local], config=c,
                      kept_m=jnp.take(mine.reshape(-1), plan.order))
    out_nd = lax.psum_scatter(out_nd.astype(jnp.float32), axis, scatter_dimension=0,
                              tiled=True).astype(c.dtype)
    return out_nd, routing


def _experts(x_nd, weights_nk, plan: Dispatch, kernels, adapters, group_sizes, *, config,
             kept_m=None):
    """`[N, D]`: each token's k experts' outputs, weighted and summed: its rows spread in
    expert order (`plan`), through `experts_mlp` over `group_sizes`, and collected back.
    `kept_m`: bool `[N k]` in expert order, the rows whose outputs count (expert
    parallelism: this device's pairs; the others' are zeroed), None: all."""
    c = config
    k = c.num_experts_per_tok
    x_md = spread(x_nd, plan.order, plan.inverse, k)
    # The kernels' grid follows the rows an expert has on average over all E experts
    # (under expert parallelism, `group_sizes` holds this device's E / P only).
    out_md = experts_mlp(x_md, kernels, adapters, group_sizes, dtype=c.dtype,
                         lora_scale=_lora_scale(c),
                         row_weights_m=_row_weights(weights_nk, plan.order, c.family, c.dtype),
                         rows_per_group=x_md.shape[0] // c.num_experts)
    if kept_m is not None:
        out_md = jnp.where(kept_m[:, None], out_md, 0)
    return collect(out_md, plan.order, plan.inverse, k)


def _lora_scale(config) -> float:
    return config.lora_alpha / config.lora_rank if config.lora_rank else 1.0


def expert_axis_size(num_experts: int, num_tokens: int) -> int:
    """Devices the experts are split over: the active mesh's `expert` axis, where it
    divides the experts and the tokens (else 1: every device holds every expert)."""
    sharder = sharding.active_sharder()
    size = 1 if sharder is None else sharder.mesh.shape.get(EXPERT_AXIS, 1)
    return size if num_experts % size == 0 and num_tokens % size == 0 else 1


class MoeMlp(nn.Module):
    """The MoE block of a decoder layer: router, top-k, the experts' SwiGLU MLPs.

    `__call__(x_btd, valid_bt, forced_btk)`; `valid_bt` (1 for a real token, or None)
    weights the router statistics the block records in `ROUTER_COLLECTION` when that
    collection is mutable (the update's forward); the outputs never depend on it.
    `forced_btk`: recorded experts to route to (routing replay), or None. The chosen
    experts are recorded in `RECORD_COLLECTION` when it is mutable. Under a mesh with an
    `expert` axis the experts are split over it (`_expert_parallel_block`).
    """

    config: object  # ModelConfig (not imported: config imports nothing from models)

    @nn.compact
    def __call__(self, x_btd: jax.Array, valid_bt: jax.Array | None = None,
                 forced_btk: jax.Array | None = None) -> jax.Array:
        c = self.config
        b, t, d = x_btd.shape
        e, k, f = c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size
        router = _Kernel((d, e), ("embed", None), c.initializer_range, c.param_dtype,
                         name="router")()
        kernels, adapters = {}, {}
        projections = _PROJECTIONS
        if not self.is_initializing() and self.has_variable("params", GATE_UP_JOINED):
            projections = ((GATE_UP_JOINED, _PROJECTIONS[0][1]), _PROJECTIONS[2])
        for name, axes in projections:
            shape = ((e, d, 2 * f) if name == GATE_UP_JOINED
                     else (e, d, f) if axes[1] == "embed" else (e, f, d))
            kernels[name] = _Kernel(shape, axes, c.initializer_range, c.param_dtype,
                                    name=name)()
            if c.lora_rank and name in c.lora_targets:
                adapters[name] = _Adapter(shape, axes, c.lora_rank, c.param_dtype,
                                          name=f"{name}_lora")()
        x_nd = x_btd.reshape(b * t, d)
        forced = None if forced_btk is None else forced_btk.reshape(b * t, k)
        block = functools.partial(_block, config=c)
        parts = expert_axis_size(e, b * t)
        if parts > 1 and not self.is_initializing():
            block = _in_shard_map(functools.partial(
                _expert_parallel_block, config=c, axis=EXPERT_AXIS), forced is not None)
        out_nd, routing = block(x_nd, router, kernels, adapters, forced)
        if self.is_mutable_collection(RECORD_COLLECTION):
            self.sow(RECORD_COLLECTION, RECORD_NAME, routing.experts_nk.reshape(b, t, k))
        if self.is_mutable_collection(ROUTER_COLLECTION):
            valid = None if valid_bt is None else valid_bt.reshape(-1)
            self.sow(ROUTER_COLLECTION, ROUTER_NAME, router_stats(routing, valid))
        return out_nd.reshape(b, t, d)


def _in_shard_map(block, with_forced: bool):
    """`block(x, router, kernels, adapters, forced)` mapped over the expert axis only (the
    mesh's other axes stay with the compiler): tokens and the experts' weights split over
    it, the router whole; the routing comes out whole on every device."""
    mesh = sharding.active_sharder().mesh
    split, whole = PartitionSpec(EXPERT_AXIS), PartitionSpec()
    in_specs = (split, whole, split, split, split if with_forced else None)
    return jax.shard_map(block, mesh=mesh, in_specs=in_specs,
                         out_specs=(split, Routing(whole, whole, whole)),
                         axis_names=frozenset({EXPERT_AXIS}), check_vma=False)
