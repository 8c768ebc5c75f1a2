"""Mixture-of-experts layers (`jrl.models.moe`) against references written here: routing
by hand, the block as a per-token loop in numpy and as a dense one-hot computation (for
gradients), transformers' load-balancing loss, and the actor loss's router term."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax import lax

from jrl import sharding
from jrl.algos import masks
from jrl.models import (
    ModelConfig,
    forward,
    forward_with_router,
    init_cache,
    init_params,
    load_pretrained,
    lora,
    moe,
    transformer,
)
from jrl.rl import logprobs, update
from jrl.rollout.sampler import SamplingConfig, generate
from tests.rl.test_shared_prompts import _grouped_batch
from tests.rl.test_update import _actor_settings
from tests.tracing import equations

# Jitted, so that each test builds a few programs rather than one per operation.
_forward = jax.jit(forward, static_argnames="config")
_forward_with_router = jax.jit(forward_with_router, static_argnames="config")

_route = jax.jit(moe.route, static_argnames=("k", "normalize"))

_CONFIG = ModelConfig.preset("tiny-moe", hidden_size=16, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=8, initializer_range=0.5)


def test_route_takes_the_top_k_probabilities_and_renormalises():
    logits = np.array([[1.0, 3.0, 2.0, 0.0], [0.5, -1.0, 0.5 + 1e-3, 4.0]], np.float32)
    e = np.exp(np.asarray(logits, np.float64))
    probs = e / e.sum(-1, keepdims=True)
    # Token 0: experts 1 (e^3) and 2 (e^2); token 1: experts 3 and 2 (0.501 > 0.5).
    top = np.array([[1, 2], [3, 2]])
    top_p = np.take_along_axis(probs, top, -1)

    routed = _route(logits, 2, normalize=True)
    np.testing.assert_array_equal(routed.experts_nk, top)
    np.testing.assert_allclose(routed.weights_nk, top_p / top_p.sum(-1, keepdims=True),
                               rtol=1e-6)
    np.testing.assert_allclose(routed.probs_ne, probs, rtol=1e-6)
    unnormalised = _route(logits, 2, normalize=False)
    np.testing.assert_allclose(unnormalised.weights_nk, top_p, rtol=1e-6)


def _block_params(config, seed=0, rank=0):
    """Random parameters of one `MoeMlp` (with LoRA adapters of rank `rank`)."""
    config = dataclasses.replace(config, lora_rank=rank)
    x = jnp.zeros((1, 1, config.hidden_size))
    shapes = jax.eval_shape(lambda: moe.MoeMlp(config).init(jax.random.key(0), x))["params"]
    rng = np.random.default_rng(seed)
    return config, jax.tree.map(
        lambda s: jnp.asarray(rng.normal(0, 0.5, s.shape), s.dtype), nn.meta.unbox(shapes))


def _numpy_block(params, config, x_nd):
    """The block token by token: softmax, the k largest, renormalised, each chosen
    expert's SwiGLU MLP (LoRA folded into its kernels) weighted and summed."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    scale = config.lora_alpha / max(config.lora_rank, 1)

    def kernel(name, e):
        w = p[name]["kernel"][e]
        if f"{name}_lora" in p:
            w = w + p[f"{name}_lora"]["a"][e] @ p[f"{name}_lora"]["b"][e] * scale
        return w

    out = np.zeros_like(x_nd, np.float64)
    for n, x in enumerate(np.asarray(x_nd, np.float64)):
        logits = x @ p["router"]["kernel"]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        chosen = np.argsort(-probs, kind="stable")[: config.num_experts_per_tok]
        weights = probs[chosen] / (probs[chosen].sum() if config.norm_topk_prob else 1.0)
        for e, w in zip(chosen, weights, strict=True):
            gate, up = x @ kernel("gate_proj", e), x @ kernel("up_proj", e)
            hidden = gate / (1 + np.exp(-gate)) * up
            out[n] += w * (hidden @ kernel("down_proj", e))
    return out


@pytest.mark.parametrize("rank", [0, 3])
def test_block_equals_a_per_token_loop(rank):
    """Dropless dispatch gives every token its own k experts, with and without LoRA
    adapters on the experts."""
    config, params = _block_params(_CONFIG, rank=rank)
    x = np.random.default_rng(1).normal(size=(3, 5, config.hidden_size)).astype(np.float32)
    got = jax.jit(moe.MoeMlp(config).apply)({"params": params}, x)
    want = _numpy_block(params, config, np.asarray(x).reshape(-1, config.hidden_size))
    # (float32 sums of values up to ~100: tolerances relative to the largest)
    np.testing.assert_allclose(np.asarray(got).reshape(want.shape), want,
                               atol=1e-6 * np.abs(want).max(), rtol=1e-5)
    if rank == 0:
        # The sampler's layout: gate and up joined into one `[E, D, 2F]` kernel, one
        # grouped matmul (`transformer.fuse_projections`), the same block.
        attn = {n: {"kernel": np.zeros((2, 1, 2), np.float32)}
                for n in ("q_proj", "k_proj", "v_proj")}
        layer = {"attn": attn, "mlp": params}
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(moe, "JOIN_GATE_UP", False)
            assert transformer.fuse_projections(layer, config)["mlp"] == params
        # Not where the mesh splits the experts' width F (8 over tensor=2; an abstract
        # mesh: the rule reads its axes' sizes only).
        mesh = jax.sharding.AbstractMesh((1, 1, 1, 2, 1), sharding.MESH_AXES)
        with sharding.Sharder(mesh).active():
            assert transformer.fuse_projections(layer, config)["mlp"] == params
        joined = transformer.fuse_projections(layer, config)["mlp"]
        assert sorted(joined) == ["down_proj", "gate_up_proj", "router"]
        e, d, f = params["gate_proj"]["kernel"].shape
        kernel = np.asarray(joined["gate_up_proj"]["kernel"])
        assert kernel.shape == (e, d, 2 * f)
        np.testing.assert_array_equal(kernel[..., :f], params["gate_proj"]["kernel"])
        np.testing.assert_array_equal(kernel[..., f:], params["up_proj"]["kernel"])
        got = jax.jit(moe.MoeMlp(config).apply)({"params": joined}, x)
        np.testing.assert_allclose(np.asarray(got).reshape(want.shape), want,
                                   atol=1e-6 * np.abs(want).max(), rtol=1e-5)


def _dense_block(params, config, x_btd):
    """The block computed for every expert on every token, weighted by a dense `[N, E]`
    matrix of the routing weights (zero for experts not chosen)."""
    x = x_btd.reshape(-1, x_btd.shape[-1])
    routed = moe.route(x @ params["router"]["kernel"], config.num_experts_per_tok,
                       config.norm_topk_prob)
    dense_w = jnp.sum(jax.nn.one_hot(routed.experts_nk, config.num_experts)
                      * routed.weights_nk[..., None], axis=1)
    gate = jnp.einsum("nd,edf->nef", x, params["gate_proj"]["kernel"])
    up = jnp.einsum("nd,edf->nef", x, params["up_proj"]["kernel"])
    out = jnp.einsum("nef,efd->ned", jax.nn.silu(gate) * up, params["down_proj"]["kernel"])
    return jnp.einsum("ned,ne->nd", out, dense_w).reshape(x_btd.shape)


def test_block_gradients_equal_the_dense_computation():
    """Gradients through the grouped matmuls, the permutation and the weights: inputs,
    router and every expert kernel."""
    config, params = _block_params(_CONFIG, seed=2)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 6, config.hidden_size)).astype(np.float32)
    cotangent = rng.normal(size=x.shape).astype(np.float32)
    loss = lambda fn: lambda prm, x: jnp.sum(fn(prm, x) * cotangent)
    ours = loss(lambda prm, x: moe.MoeMlp(config).apply({"params": prm}, x))
    dense = loss(functools.partial(lambda prm, x, c: _dense_block(prm, c, x), c=config))
    got = jax.jit(jax.grad(ours, argnums=(0, 1)))(params, x)
    want = jax.jit(jax.grad(dense, argnums=(0, 1)))(params, x)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4), got, want)


def _count_primitives(jaxpr, prefix: str) -> int:
    """Equations whose primitive's name starts with `prefix`, in `jaxpr` and the
    programs inside it (a scan's body counted once)."""
    return sum(eqn.primitive.name.startswith(prefix) for eqn in equations(jaxpr))


def test_spread_and_collect_move_rows_both_ways_by_gathers():
    """`spread` copies each token's row to its k pairs' places in expert order and
    `collect` sums them back (numpy loops here); each one's gradient is the other (the
    transposes autodiff gives the plain gathers), and neither gradient program holds a
    scatter."""
    n, k, d, e = 5, 3, 4, 6
    rng = np.random.default_rng(0)
    experts = np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)
    plan = jax.jit(moe.dispatch, static_argnums=1)(jnp.asarray(experts), e)
    order, inverse = np.asarray(plan.order), np.asarray(plan.inverse)
    assert sorted(experts.reshape(-1)[order]) == list(experts.reshape(-1)[order])
    np.testing.assert_array_equal(order[inverse], np.arange(n * k))
    x_nd = rng.normal(size=(n, d)).astype(np.float32)
    x_md = rng.normal(size=(n * k, d)).astype(np.float32)
    want_spread = np.stack([x_nd[order[r] // k] for r in range(n * k)])
    want_collect = np.zeros((n, d), np.float32)
    for r in range(n * k):
        want_collect[order[r] // k] += x_md[r]
    spread = functools.partial(moe.spread, order=plan.order, inverse=plan.inverse, k=k)
    collect = functools.partial(moe.collect, order=plan.order, inverse=plan.inverse, k=k)
    plain_spread = lambda x: jnp.take(x, plan.order // k, axis=0)
    plain_collect = lambda x: jnp.zeros((n, d)).at[plan.order // k].add(x)
    cot_md, cot_nd = x_md[::-1].copy(), x_nd[::-1].copy()
    vjp = lambda f, x, cot: jax.vjp(f, x)[1](cot)[0]

    @jax.jit  # (one program rather than one per operation)
    def outputs(x_nd, x_md):
        return (spread(x_nd), collect(x_md), vjp(spread, x_nd, cot_md),
                vjp(plain_spread, x_nd, cot_md), vjp(collect, x_md, cot_nd),
                vjp(plain_collect, x_md, cot_nd))

    got_spread, got_collect, *vjps = outputs(x_nd, x_md)
    np.testing.assert_array_equal(got_spread, want_spread)
    np.testing.assert_allclose(got_collect, want_collect, rtol=1e-6)
    np.testing.assert_allclose(vjps[0], vjps[1], rtol=1e-6)
    np.testing.assert_allclose(vjps[2], vjps[3], rtol=1e-6)
    for ours, x, cot in ((spread, x_nd, cot_md), (collect, x_md, cot_nd)):
        grad = jax.make_jaxpr(jax.grad(lambda x, f=ours, c=cot: jnp.sum(f(x) * c)))(x).jaxpr
        assert _count_primitives(grad, "scatter") == 0


def _unwritten_past_the_groups(x_md, w_gkn, group_sizes, impl="auto", rows_per_group=None):
    """`lax.ragged_dot` with what the Mosaic kernels leave in rows past the groups (they
    do not write them: NaN here) and the input gradient they give there (zero)."""
    grouped = jnp.arange(x_md.shape[0]) < jnp.sum(group_sizes)

    @jax.custom_vjp
    def kernel(x, w):
        return jnp.where(grouped[:, None], lax.ragged_dot(x, w, group_sizes), jnp.nan)

    def kernel_fwd(x, w):
        return kernel(x, w), (x, w)

    def kernel_bwd(residuals, d_out):
        d_x, d_w = jax.vjp(lambda x, w: lax.ragged_dot(x, w, group_sizes), *residuals)[1](d_out)
        return jnp.where(grouped[:, None], d_x, 0), d_w

    kernel.defvjp(kernel_fwd, kernel_bwd)
    return kernel(x_md, w_gkn)


@pytest.mark.parametrize("rank", [0, 2])
def test_rows_past_the_groups_reach_no_gradient(rank, monkeypatch):
    """Rows past the groups' sum (other devices' pairs under expert parallelism) hold
    what the kernels leave there; neither the output's grouped rows nor any gradient
    (inputs, kernels, adapters, routing weights) sees it."""
    monkeypatch.setattr(moe.grouped_matmul, "grouped_matmul", _unwritten_past_the_groups)
    rng = np.random.default_rng(0)
    e, d, f, m, sizes = 3, 4, 6, 9, np.array([2, 3, 1], np.int32)  # 6 of 9 rows grouped
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
    kernels = {"gate_proj": normal(e, d, f), "up_proj": normal(e, d, f),
               "down_proj": normal(e, f, d)}
    adapters = ({name: (normal(e, *w.shape[1:2], rank), normal(e, rank, w.shape[2]))
                 for name, w in kernels.items()} if rank else {})

    def loss(x, kernels, adapters, weights):
        out = moe.experts_mlp(x, kernels, adapters, sizes, dtype="float32",
                              row_weights_m=weights)
        return jnp.sum(out[:6] * jnp.arange(6 * d, dtype=jnp.float32).reshape(6, d))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(normal(m, d), kernels, adapters,
                                                          normal(m))
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    assert not [jax.tree_util.keystr(p) for p, g in leaves if not np.isfinite(g).all()]
    assert not np.asarray(grads[3][6:]).any()  # the weights of rows past the groups


@pytest.mark.parametrize("rank", [0, 2])
def test_dots_saveable_runs_no_grouped_matmul_of_the_forward_again(rank, monkeypatch):
    """Under `model.remat=dots_saveable` the backward of an MoE layer recomputes none of
    its grouped matmuls or its sort, as without remat; under `full` it runs again those
    whose outputs the backward reads: gate and up, and with LoRA gate's and up's `a` (as
    one), their two `b`s and down's `a` (its product is what the gradient of down's `b`
    reads). Down's own output is read by no gradient: the routing weights are applied
    before it. Counted as `lax.ragged_dot` equations in the adapters' (with LoRA) or all
    parameters' gradient program."""
    monkeypatch.setattr(moe.grouped_matmul, "choose_impl", lambda impl, x, w: "xla")
    config = dataclasses.replace(_CONFIG, num_layers=2, lora_rank=rank)
    # (shapes only: the programs are traced, not built)
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    base, trained = lora.split(params) if rank else ({}, params)
    tokens = jax.ShapeDtypeStruct((2, 4), jnp.int32)

    def counts(remat):
        cfg = dataclasses.replace(config, remat=remat)

        def loss(trained, base, tokens):
            logits, _ = transformer.forward_logits(
                lora.combine(base, trained) if rank else trained, tokens,
                jnp.broadcast_to(jnp.arange(4), (2, 4)), jnp.ones((2, 4), jnp.int32),
                config=cfg)
            return jnp.sum(logits)

        jaxpr = jax.make_jaxpr(jax.grad(loss))(trained, base, tokens).jaxpr
        return tuple(_count_primitives(jaxpr, p) for p in ("ragged_dot", "sort"))

    recomputed = 2 + (4 if rank else 0)
    none, saved, full = counts("none"), counts("dots_saveable"), counts("full")
    assert saved == none
    assert full[0] == none[0] + recomputed
    assert full[1] > none[1]  # the dispatch's sort again


def test_load_balancing_loss_equals_transformers(hf_checkpoint, ragged_batch):
    """`load_balancing_loss` over the layers' statistics of a left-padded batch equals the
    `aux_loss` transformers returns with `output_router_logits` (padding left out)."""
    for case in ("qwen3_moe", "mixtral"):
        path, model = hf_checkpoint(case)
        config, params = load_pretrained(path)
        with torch.no_grad():
            want = model(
                input_ids=torch.as_tensor(ragged_batch["tokens"], dtype=torch.long),
                attention_mask=torch.as_tensor(ragged_batch["mask"], dtype=torch.long),
                position_ids=torch.as_tensor(ragged_batch["positions"], dtype=torch.long),
                output_router_logits=True,
            ).aux_loss.item()
        _, stats = _forward_with_router(
            params, *(jnp.asarray(ragged_batch[k]) for k in ("tokens", "positions", "mask")),
            config=config)
        np.testing.assert_allclose(moe.load_balancing_loss(stats), want, rtol=1e-5,
                                   err_msg=case)
        assert float(jnp.sum(stats.tokens)) == config.num_layers * ragged_batch["mask"].sum()


def test_load_metrics_by_hand():
    stats = moe.RouterStats(assigned_e=np.array([[6.0, 2.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]]),
                            probs_e=np.zeros((2, 4)), tokens=np.array([4.0, 4.0]))
    got = {k: float(v) for k, v in jax.jit(moe.load_metrics)(stats).items()}
    assert got == {"moe/tokens_per_expert_min": 0.0, "moe/tokens_per_expert_mean": 2.0,
                   "moe/tokens_per_expert_max": 6.0,
                   # layer 0: 6 / 2; layer 1: 2 / 2.
                   "moe/max_over_mean_load": 2.0}


@pytest.mark.parametrize("group", [1, 2])
def test_actor_loss_adds_the_router_loss_of_the_plain_layout(group):
    """The actor loss gains `coef x` the load-balancing loss of every sequence's tokens
    (prompt and response) as one forward per row computes it, also when rows share their
    prompt's forward (`group`), with the load metrics beside it."""
    config = dataclasses.replace(_CONFIG, vocab_size=40, num_layers=1)
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(0))
    ids, pmask, resp, rmask = _grouped_batch(0, groups=2, k=2, p=4, r=5)
    rng = np.random.default_rng(0)
    micro = {"prompt_ids": ids, "prompt_mask": pmask, "responses": resp, "response_mask": rmask,
             "old_log_probs": jnp.asarray(-rng.random(rmask.shape), jnp.float32),
             "ref_log_probs": jnp.asarray(-rng.random(rmask.shape), jnp.float32),
             "advantages": jnp.asarray(rng.normal(size=rmask.shape), jnp.float32)}
    normalizer = masks.loss_normalizer(rmask)

    def loss(coef):
        actor = dataclasses.replace(_actor_settings(4), router_aux_loss_coef=coef)
        return jax.jit(functools.partial(
            update.actor_loss, model_config=config, actor=actor, temperature=1.0, chunk_size=4,
            group=group))(params, micro, normalizer, jax.random.key(0))

    (without, _), (with_aux, (sums, means, _)) = loss(0.0), loss(0.5)
    tokens, mask, positions = logprobs.sequence_inputs(ids, pmask, resp, rmask)
    _, stats = _forward_with_router(params, tokens, positions, mask, config=config)
    want = moe.load_balancing_loss(stats)
    np.testing.assert_allclose(sums["router_aux_loss"], want, rtol=1e-5)
    np.testing.assert_allclose(with_aux - without, 0.5 * want, rtol=1e-4)
    assert float(means["moe/tokens_per_expert_mean"]) == pytest.approx(
        float(mask.sum()) * config.num_experts_per_tok / config.num_experts)


def test_expert_adapters_merge_into_the_kernels():
    """`lora.merge` folds each expert's adapter into its kernel: the merged model computes
    what the adapted one does."""
    config = dataclasses.replace(_CONFIG, vocab_size=40, lora_rank=4)
    base, _ = lora.split(jax.jit(init_params, static_argnums=0)(config, jax.random.key(0)))
    rng = np.random.default_rng(1)
    adapters = jax.tree.map(lambda a: np.asarray(a) + 0.3 * rng.normal(size=a.shape),
                            jax.jit(lora.init_adapters, static_argnums=0)(config,
                                                                         jax.random.key(2)))
    params = lora.combine(base, jax.tree.map(lambda a: a.astype(np.float32), adapters))
    tokens = rng.integers(3, 40, (2, 6)).astype(np.int32)
    mask = np.ones_like(tokens)
    positions = np.cumsum(mask, 1) - 1
    adapted, _ = _forward(params, tokens, positions, mask, config=config)
    merged_config, merged = lora.merge(params, config)
    plain, _ = _forward(merged, tokens, positions, mask, config=merged_config)
    bare, _ = _forward(base, tokens, positions, mask, config=merged_config)
    np.testing.assert_allclose(plain, adapted, atol=2e-5)
    assert float(jnp.abs(bare - adapted).max()) > 1e-2  # the adapters do change the output
    with pytest.raises(ValueError, match="experts of an MoE model .*gate_proj"):
        lora.save_peft(params, config, "/nonexistent")


def test_route_to_recorded_experts_weighs_them_by_the_training_router():
    logits = np.array([[1.0, 3.0, 2.0, 0.0], [0.5, -1.0, 0.0, 4.0]], np.float32)
    e = np.exp(np.asarray(logits, np.float64))
    probs = e / e.sum(-1, keepdims=True)
    # Token 0 replays experts 0 and 3 (not its own top 2); token 1 has no record.
    forced = np.array([[0, 3], [moe.NOT_RECORDED, moe.NOT_RECORDED]], np.int32)
    routed = _route(logits, 2, normalize=True, forced_nk=forced)
    np.testing.assert_array_equal(routed.experts_nk, [[0, 3], [3, 0]])
    want0 = probs[0, [0, 3]] / probs[0, [0, 3]].sum()
    want1 = probs[1, [3, 0]] / probs[1, [3, 0]].sum()
    np.testing.assert_allclose(routed.weights_nk, [want0, want1], rtol=1e-6)


def test_sampler_records_the_experts_the_training_forward_chooses():
    """In float32 the rollout's record is each token's own top k in the full forward
    (prompt and fed response tokens; none for padding and each row's last token), and
    replaying it leaves the training forward unchanged, while replaying other experts
    changes it."""
    config = dataclasses.replace(_CONFIG, vocab_size=40)
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(0))
    prompt_mask = np.ones((2, 5), np.int32)
    prompt_mask[0, :2] = 0
    prompt_ids = np.random.default_rng(1).integers(3, 40, (2, 5)).astype(np.int32) * prompt_mask
    sampling = SamplingConfig(n=2, max_new_tokens=6, stop_token_ids=(7, 11, 13, 17, 19, 23),
                              record_routing=True, decode_buckets=2)
    out = generate(params, prompt_ids, prompt_mask, jax.random.key(2), sampling, config=config)
    tokens, mask, positions = jax.jit(logprobs.sequence_inputs)(
        out.prompt_ids, out.prompt_mask, out.responses, out.response_mask)
    recorded = np.concatenate([out.prompt_routing, out.response_routing], axis=1)
    assert recorded.shape == (4, 11, config.num_layers, config.num_experts_per_tok)

    _, _, own = jax.jit(transformer.forward_recording, static_argnames="config")(
        params, tokens, positions, mask, init_cache(config, 4, 11), 0, config=config)
    fed = np.asarray(mask, bool).copy()
    lengths = np.asarray(out.response_lengths)
    # Each row's last response token (its stop token, or the last column) is sampled,
    # never fed back.
    fed[np.arange(4), out.prompt_ids.shape[1] + lengths - 1] = False
    np.testing.assert_array_equal(np.asarray(recorded)[fed], np.asarray(own)[fed])
    assert np.all(np.asarray(recorded)[~fed] == moe.NOT_RECORDED)
    assert lengths.min() < 6  # a row stopped early: its padding has no record

    plain, _ = _forward(params, tokens, positions, mask, config=config)
    replayed, _ = _forward(params, tokens, positions, mask, config=config, routing=recorded)
    valid = np.asarray(mask, bool)
    np.testing.assert_allclose(np.asarray(replayed)[valid], np.asarray(plain)[valid],
                               atol=1e-5)
    other = np.where(recorded >= 0, (recorded + 1) % config.num_experts, recorded)
    moved, _ = _forward(params, tokens, positions, mask, config=config, routing=other)
    assert np.abs(np.asarray(moved) - np.asarray(plain))[valid].max() > 1e-2


@pytest.mark.parametrize("group", [1, 2])
def test_old_log_prob_pass_records_the_experts_it_chooses(group):
    """`actor.router_replay="old_log_prob"` (verl's R2): the log-prob pass over micro-batches
    of response-length buckets (here with shared prompts and odd lengths, so the layouts
    add columns) records each prompt and response token's own top k, the record the
    layer-by-layer cached forward makes of the same sequences, and its log-probs are the
    unrecorded pass's; replaying the record leaves them unchanged."""
    config = dataclasses.replace(_CONFIG, vocab_size=40)
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(0))
    batch = _grouped_batch(0, groups=2, k=2, p=5, r=7)
    kwargs = dict(config=config, chunk_size=4, with_entropy=True)

    def run(record, *routing):
        fn = functools.partial(logprobs.response_log_probs, **kwargs, record=record)
        passes = logprobs.in_micro_batches(fn, 2, (4, 7), group)
        return jax.jit(passes)(params, *batch, *routing)

    out = run(True)
    assert out.prompt_routing.shape == (4, 5, config.num_layers, 2)
    assert out.response_routing.shape == (4, 7, config.num_layers, 2)
    tokens, mask, positions = jax.jit(logprobs.sequence_inputs)(*batch)
    _, _, own = jax.jit(transformer.forward_recording, static_argnames="config")(
        params, tokens, positions, mask, init_cache(config, 4, 12), 0, config=config)
    recorded = np.concatenate([out.prompt_routing, out.response_routing], axis=1)
    valid = np.asarray(mask, bool)
    np.testing.assert_array_equal(recorded[valid], np.asarray(own)[valid])
    plain = run(False)
    replayed = run(False, out.prompt_routing, out.response_routing)
    for got, again, want in zip(out.outputs, replayed, plain, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
        np.testing.assert_allclose(np.asarray(again), np.asarray(want), atol=1e-5)


_EXPERT_PARALLEL_SCRIPT = """
import json
import jax, jax.numpy as jnp, numpy as np
from jrl import sharding
from jrl.models import ModelConfig, forward_with_router, init_params, moe, param_logical_axes
config = ModelConfig.preset("tiny-moe", vocab_size=40, lora_rank=4)
params = init_params(config, jax.random.key(0))
params = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(9), x.shape), params)
tokens = jax.random.randint(jax.random.key(1), (8, 6), 3, 40)
mask = jnp.ones((8, 6), jnp.int32).at[0, :2].set(0).at[5, :4].set(0)
positions = jnp.maximum(jnp.cumsum(mask, 1) - 1, 0)
weights = jax.random.normal(jax.random.key(2), (8, 6, config.hidden_size))

def loss(params):
    hidden, stats = forward_with_router(params, tokens, positions, mask, config=config)
    return jnp.sum(hidden * weights) + moe.load_balancing_loss(stats), hidden

out = {}
for expert in (1, 4):
    sharder = sharding.Sharder(sharding.make_mesh(sharding.MeshSettings(data=-1, expert=expert)))
    with sharder.active():
        placed = jax.device_put(params, sharder.params(param_logical_axes(config), params))
        (value, hidden), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(placed)
    kernel = placed["layers"]["mlp"]["gate_proj"]["kernel"]
    out[expert] = dict(value=float(value), hidden=np.asarray(hidden).tolist(),
                       grads=[np.asarray(g).ravel().tolist() for g in jax.tree.leaves(grads)],
                       expert_shards=len({str(s.index) for s in kernel.addressable_shards}))
print(json.dumps(out))
"""


def test_expert_parallel_forward_and_gradients_equal_one_device():
    """On 8 CPU devices with the experts split over 4 (`mesh.expert=4`, each device 2 of
    the 8 experts, with LoRA adapters), the forward, the load-balancing loss and every
    gradient equal the unsplit model's."""
    from tests.eight_devices import run_script

    out = run_script(_EXPERT_PARALLEL_SCRIPT)
    one, split = out["1"], out["4"]
    assert (one["expert_shards"], split["expert_shards"]) == (1, 4)
    np.testing.assert_allclose(split["value"], one["value"], rtol=1e-5)
    np.testing.assert_allclose(split["hidden"], one["hidden"], atol=1e-5)
    for got, want in zip(split["grads"], one["grads"], strict=True):
        want = np.asarray(want)
        np.testing.assert_allclose(got, want, atol=1e-5 * max(1.0, np.abs(want).max()))


def test_active_size_counts_a_tokens_k_experts():
    """The MFU's parameter count of an MoE model: tiny-moe (E 8, k 2, D 64, F 64, 2 layers)
    has 2 x 3 x 8 x 64 x 64 = 196,608 expert weights, of which a token runs 2/8."""
    config = ModelConfig.preset("tiny-moe")
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    total = sum(x.size for x in jax.tree.leaves(shapes))
    experts = 2 * 3 * 8 * 64 * 64
    assert moe.active_size(shapes, config) == total - experts + experts * 2 / 8
    dense = ModelConfig.preset("tiny")
    dense_shapes = jax.eval_shape(lambda: init_params(dense, jax.random.key(0)))
    assert moe.active_size(dense_shapes, dense) == sum(
        x.size for x in jax.tree.leaves(dense_shapes))
