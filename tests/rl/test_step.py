"""`step.generate`, `step.forward` and `step.learn` on hand-made batches: the numbers
`learn` reports (advantages, rewards with the KL penalty, the adaptive KL
coefficient, lengths, the learning rate) are worked by hand below; `forward` equals
the log-prob functions it fuses; the actor waits out the critic warm-up as data."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.algos.kl_control import init_kl_controller
from jrl.app import experiment
from jrl.config import settings
from jrl.models.heads import init_critic_params
from jrl.optim import make_optimizer
from jrl.rl import logprobs, step, update
from jrl.rl.types import Experience, Rollout, TrainState
from jrl.rollout import sampler
from tests.tiny import tiny_config

# 4 prompts x 2 samples; prompts of 4 tokens (left-padded), responses of 3 (right-padded).
PROMPT_LENGTHS = [4, 4, 3, 3, 2, 2, 4, 4]
RESPONSE_LENGTHS = [3, 2, 3, 1, 3, 3, 2, 3]
# Group scores: (1, 0), (1, 1), (0, 0), (0, 1).
SCORES = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]


def _setup(**overrides):
    config = tiny_config(**overrides)
    experiment_settings = settings.experiment_from_config(config)
    tokenizer = experiment.build_tokenizer(experiment_settings)
    s = settings.from_config(config, stop_token_ids=tokenizer.eos_token_ids,
                             pad_token_id=tokenizer.pad_token_id, num_train_rows=64)
    model, params = experiment.build_model(experiment_settings, tokenizer)
    return config, s, model, params


def _rollout() -> Rollout:
    rng = np.random.default_rng(0)
    n, p, r = len(PROMPT_LENGTHS), 4, 3
    prompt_mask = np.array([[0] * (p - k) + [1] * k for k in PROMPT_LENGTHS], np.int32)
    response_mask = np.array([[1] * k + [0] * (r - k) for k in RESPONSE_LENGTHS], np.int32)
    # The samples of a prompt are consecutive rows with the same prompt (the Rollout contract).
    prompt_ids = np.repeat(rng.integers(3, 20, (n // 2, p)), 2, axis=0) * prompt_mask
    return Rollout(prompt_ids=jnp.asarray(prompt_ids, jnp.int32),
                   prompt_mask=jnp.asarray(prompt_mask),
                   responses=jnp.asarray(rng.integers(3, 20, (n, r)) * response_mask, jnp.int32),
                   response_mask=jnp.asarray(response_mask))


def _experience(rollout: Rollout, **fields) -> Experience:
    r = rollout.responses.shape[1]
    last = np.array(RESPONSE_LENGTHS) - 1
    scores = np.zeros((len(SCORES), r), np.float32)
    scores[np.arange(len(SCORES)), last] = SCORES
    zeros = jnp.zeros(rollout.responses.shape, jnp.float32)
    defaults = dict(old_log_probs=zeros - 1.0, entropy=zeros + 2.0,
                    token_level_scores=jnp.asarray(scores),
                    uid=jnp.repeat(jnp.arange(4, dtype=jnp.int32), 2))
    return Experience.of(rollout, **{**defaults, **fields})


def _state(s, params, critic_params=None, step_=0, beta=0.001) -> TrainState:
    actor_opt = make_optimizer(s.actor.optim)
    critic = None
    if critic_params is not None:
        critic_opt = make_optimizer(s.critic.optim)
        critic = update.ModelState(critic_params, critic_opt.init(critic_params))
    actor = update.ModelState(params, actor_opt.init(params))
    return TrainState(step=jnp.int32(step_), actor=actor, critic=critic,
                      kl=init_kl_controller(beta))


def _learn(s, model, state, exp, critic_warmup=0):
    critic_opt = None if s.critic is None else make_optimizer(s.critic.optim)
    fn = jax.jit(lambda st, e, k: step.learn(
        st, e, k, settings=s, model_config=model, actor_opt=make_optimizer(s.actor.optim),
        critic_opt=critic_opt, critic_warmup=critic_warmup))
    new, metrics = fn(state, exp, jax.random.key(0))
    return new, {k: float(v) for k, v in metrics.items()}


def test_grpo_metrics_worked_by_hand():
    _, s, model, params = _setup()
    exp = _experience(_rollout())
    new, m = _learn(s, model, _state(s, params), exp)
    # Group (1, 0): mean 0.5, unbiased std sqrt(0.5) -> advantages +-0.5 / 0.70711 = +-0.70711
    # on every response token of the row; groups (1, 1) and (0, 0): 0.
    assert m["critic/advantages/max"] == pytest.approx(0.70711, abs=1e-4)
    assert m["critic/advantages/min"] == pytest.approx(-0.70711, abs=1e-4)
    # Token mean over the 20 response tokens: rows 0/1 give 3 x 0.70711 - 2 x 0.70711, rows
    # 6/7 give -2 x 0.70711 + 3 x 0.70711: 2 x 0.70711 / 20.
    assert m["critic/advantages/mean"] == pytest.approx(2 * 0.70711 / 20, abs=1e-5)
    assert m["critic/score/mean"] == 0.5 and m["critic/rewards/mean"] == 0.5
    assert m["response_length/mean"] == 2.5 and m["response_length/min"] == 1.0
    assert m["response_length/clip_ratio"] == 5 / 8  # rows that reached 3 tokens
    assert m["prompt_length/mean"] == 3.25 and m["prompt_length/clip_ratio"] == 0.5
    # token-mean of the entropy, 2.0 everywhere.
    assert m["actor/entropy"] == pytest.approx(2.0)
    assert m["actor/lr"] == pytest.approx(1e-3) and m["actor/updated"] == 1.0
    assert int(new.step) == 1
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), new.actor.params, params)
    assert any(jax.tree.leaves(changed))


def test_adaptive_kl_in_reward_worked_by_hand():
    overrides = {"algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.type": "adaptive",
                 "algorithm.kl_ctrl.kl_coef": 0.1, "algorithm.kl_ctrl.target_kl": 0.1,
                 "algorithm.kl_ctrl.horizon": 10.0}
    _, s, model, params = _setup(**overrides)
    rollout = _rollout()
    zeros = jnp.zeros(rollout.responses.shape, jnp.float32)
    exp = _experience(rollout, old_log_probs=zeros, ref_log_probs=zeros - 0.5)
    new, m = _learn(s, model, _state(s, params, beta=0.1), exp)
    # kl = old - ref = 0.5 on every token: the batch's KL is 0.5.
    assert m["actor/reward_kl_penalty"] == pytest.approx(0.5)
    assert m["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)
    # Rewards: score - 0.1 x 0.5 per response token: (4 - 0.05 x 20) / 8 rows.
    assert m["critic/rewards/mean"] == pytest.approx(0.375, abs=1e-6)
    # beta x (1 + clip(0.5 / 0.1 - 1, +-0.2) x 8 sequences / horizon 10) = 0.1 x 1.16.
    assert float(new.kl.value) == pytest.approx(0.116, rel=1e-6)


def test_learning_rate_follows_the_schedule_at_state_step():
    _, s, model, params = _setup(**{"actor.optim.lr_warmup_steps": 4})
    _, m = _learn(s, model, _state(s, params, step_=3), _experience(_rollout()))
    assert m["actor/lr"] == pytest.approx(1e-3 * 3 / 4)


def test_actor_waits_out_the_critic_warmup_as_data():
    _, s, model, params = _setup(**{"algorithm.adv_estimator": "gae"})
    critic_params = init_critic_params(params, jax.random.key(1))
    rollout = _rollout()
    exp = _experience(rollout, values=jnp.zeros(rollout.responses.shape, jnp.float32))
    # verl counts steps from 1: with critic_warmup=2 the actor first updates at step 2,
    # i.e. state.step == 1. The same compiled program decides from state.step.
    for step_, updated in ((0, False), (1, True)):
        state = _state(s, params, critic_params, step_=step_)
        new, m = _learn(s, model, state, exp, critic_warmup=2)
        assert m["actor/updated"] == float(updated)
        same = jax.tree.map(lambda a, b: bool(jnp.all(a == b)), new.actor.params, params)
        assert all(jax.tree.leaves(same)) != updated
        assert "critic/vf_loss" in m
        moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), new.critic.params,
                             critic_params)
        assert any(jax.tree.leaves(moved))


def test_forward_equals_the_log_prob_functions():
    _, s, model, params = _setup(**{"algorithm.adv_estimator": "gae"})
    critic_params = init_critic_params(params, jax.random.key(1))
    ref_params = jax.tree.map(lambda x: x * 0.9, params)
    rollout = _rollout()
    fn = jax.jit(lambda st, r, ro: step.forward(st, r, ro, settings=s,
                                                          model_config=model))
    exp = fn(_state(s, params, critic_params), ref_params, rollout)
    seq = (rollout.prompt_ids, rollout.prompt_mask, rollout.responses, rollout.response_mask)
    kw = dict(config=model, temperature=s.rollout.temperature, chunk_size=s.logprob_chunk_size)
    old, entropy = logprobs.response_log_probs(params, *seq, with_entropy=True, **kw)
    ref, _ = logprobs.response_log_probs(ref_params, *seq, **kw)
    values = logprobs.response_values(critic_params, *seq, config=model)
    chex.assert_trees_all_close((exp.old_log_probs, exp.entropy, exp.ref_log_probs, exp.values),
                                (old, entropy, ref, values), rtol=1e-5, atol=1e-6)
    assert not np.allclose(exp.ref_log_probs, exp.old_log_probs)
    assert exp.token_level_scores is None and exp.uid is None
    without = fn(_state(s, params), None, rollout)
    assert without.ref_log_probs is None and without.values is None


def test_generate_samples_from_the_actor_in_the_compute_dtype():
    _, s, model, params = _setup(**{"model.dtype": "bfloat16"})
    prompt_mask = np.array([[0, 1, 1], [1, 1, 1]], np.int32)
    prompt_ids = np.array([[0, 5, 6], [7, 8, 9]], np.int32)
    key = jax.random.key(3)
    out = jax.jit(lambda st, i, m, k: step.generate(st, i, m, k, sampling=s.rollout,
                                                    model_config=model))(
        _state(s, params), prompt_ids, prompt_mask, key)
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    want = sampler.generate(bf16, prompt_ids, prompt_mask, key, s.rollout, config=model)
    n = s.rollout.n
    assert out.responses.shape == (2 * n, s.rollout.max_new_tokens)
    chex.assert_trees_all_equal(
        (out.prompt_ids, out.prompt_mask, out.responses, out.response_mask),
        (want.prompt_ids, want.prompt_mask, want.responses, want.response_mask))
    np.testing.assert_array_equal(out.prompt_ids[:n], np.repeat(prompt_ids[:1], n, 0))


def test_init_builds_the_first_state():
    _, s, model, params = _setup(**{"algorithm.adv_estimator": "gae",
                                    "algorithm.kl_ctrl.kl_coef": 0.05})
    key = jax.random.key(7)
    state = jax.jit(lambda p, k: step.init(
        p, k, settings=s, actor_opt=make_optimizer(s.actor.optim),
        critic_opt=make_optimizer(s.critic.optim)))(params, key)
    assert int(state.step) == 0 and float(state.kl.value) == pytest.approx(0.05)
    chex.assert_trees_all_equal(state.actor.params, params)
    chex.assert_trees_all_close(state.critic.params, init_critic_params(params, key), rtol=1e-6)
    adam = jax.tree.leaves(state.actor.opt_state)
    assert adam and all(not np.any(np.asarray(x)) for x in adam)  # count 0, moments 0
    grpo = _setup()[1]
    no_critic = step.init(params, key, settings=grpo,
                          actor_opt=make_optimizer(grpo.actor.optim))
    assert no_critic.critic is None


_ON_POLICY = {"actor.ppo_mini_batch_size": 4}  # 4 prompts x n=2: the whole batch, one update


def test_on_policy_applies_only_where_the_update_is_on_policy():
    assert _setup(**_ON_POLICY)[1].actor.on_policy
    assert not _setup()[1].actor.on_policy  # two mini-batches
    for off in ({"actor.reuse_update_log_probs": False}, {"actor.ppo_epochs": 2},
                {"algorithm.use_kl_in_reward": True}):
        assert not _setup(**_ON_POLICY, **off)[1].actor.on_policy, off
    s = _setup()[1]
    with pytest.raises(ValueError, match=r"^actor\.reuse_update_log_probs: applies only"):
        dataclasses.replace(s, actor=dataclasses.replace(s.actor, on_policy=True))


def test_on_policy_update_equals_the_update_from_recomputed_log_probs():
    """Skipping the old-log-prob pass changes nothing but float noise: the update's own
    log-probs, detached, are the old ones (ratio 1), and it reports the same entropy."""
    _, s, model, params = _setup(**_ON_POLICY)
    _, s_pass, _, _ = _setup(**_ON_POLICY, **{"actor.reuse_update_log_probs": False})
    rollout = _rollout()
    forward = lambda s_: jax.jit(lambda st, ro: step.forward(
        st, None, ro, settings=s_, model_config=model))
    exp = forward(s)(_state(s, params), rollout)
    assert exp.old_log_probs is None and exp.entropy is None
    recomputed = forward(s_pass)(_state(s_pass, params), rollout)
    fields = dict(token_level_scores=_experience(rollout).token_level_scores,
                  uid=_experience(rollout).uid)
    new, m = _learn(s, model, _state(s, params), exp.replace(**fields))
    new_pass, m_pass = _learn(s_pass, model, _state(s_pass, params),
                              recomputed.replace(**fields))
    assert m["actor/ppo_kl"] == 0.0 and m["actor/pg_clipfrac"] == 0.0
    assert abs(m_pass["actor/ppo_kl"]) < 1e-6
    for key in ("actor/entropy", "actor/pg_loss", "actor/grad_norm"):
        assert m[key] == pytest.approx(m_pass[key], rel=1e-5, abs=1e-7), key
    chex.assert_trees_all_close(new.actor.params, new_pass.actor.params, rtol=1e-5, atol=1e-6)


def _long_rollout(r=40, seed=3) -> Rollout:
    """4 prompts x 2 samples with responses of 0 to 40 tokens: long enough for 3 buckets."""
    rng = np.random.default_rng(seed)
    n, p = len(PROMPT_LENGTHS), 4
    prompt_mask = np.array([[0] * (p - k) + [1] * k for k in PROMPT_LENGTHS], np.int32)
    prompt_ids = np.repeat(rng.integers(3, 20, (n // 2, p)), 2, axis=0) * prompt_mask
    lengths = np.array([40, 7, 0, 33, 12, 19, 40, 1])
    response_mask = (np.arange(r)[None] < lengths[:, None]).astype(np.int32)
    return Rollout(prompt_ids=jnp.asarray(prompt_ids, jnp.int32),
                   prompt_mask=jnp.asarray(prompt_mask),
                   responses=jnp.asarray(rng.integers(3, 20, (n, r)) * response_mask, jnp.int32),
                   response_mask=jnp.asarray(response_mask))


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_shared_prompts_learn_what_the_plain_layout_learns(estimator):
    """`forward` and `learn` (actor, and the critic with GAE) with shared prompts and 3
    response buckets give the plain layout's log-probs, values, loss terms and
    parameters."""
    over = {"algorithm.adv_estimator": estimator, "actor.response_buckets": 3,
            "actor.use_kl_loss": True, "rollout.response_length": 40}
    _, s, model, params = _setup(**over)
    _, plain, _, _ = _setup(**over, **{"actor.share_prompts": False})
    assert step.prompt_group(s, s.actor.update.micro_batch) == 2
    critic_params = init_critic_params(params, jax.random.key(1)) if s.critic else None
    ro = _long_rollout()
    inside = np.asarray(ro.response_mask) > 0
    ref = jax.tree.map(lambda x: x * 0.9, params)
    outs = {}
    for name, st in (("shared", s), ("plain", plain)):
        exp = jax.jit(lambda sta, r, o, st=st: step.forward(
            sta, r, o, settings=st, model_config=model))(
            _state(st, params, critic_params), ref, ro)
        scores = np.zeros(ro.responses.shape, np.float32)
        scores[np.arange(8), np.maximum(np.asarray(ro.response_mask).sum(1) - 1, 0)] = SCORES
        exp = exp.replace(token_level_scores=jnp.asarray(scores),
                          uid=jnp.repeat(jnp.arange(4, dtype=jnp.int32), 2))
        outs[name] = (exp, *_learn(st, model, _state(st, params, critic_params), exp))
    (e1, n1, m1), (e0, n0, m0) = outs["shared"], outs["plain"]
    for field in ("ref_log_probs", "values"):
        a, b = getattr(e1, field), getattr(e0, field)
        if b is not None:
            np.testing.assert_allclose(np.asarray(a)[inside], np.asarray(b)[inside], atol=2e-5)
    chex.assert_trees_all_close(n1.actor.params, n0.actor.params, atol=2e-6, rtol=0)
    if s.critic:
        chex.assert_trees_all_close(n1.critic.params, n0.critic.params, atol=2e-6, rtol=0)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"):
        np.testing.assert_allclose(m1[key], m0[key], rtol=2e-5, atol=1e-7, err_msg=key)
    assert m0["actor/grad_norm"] > 0


@pytest.mark.parametrize("estimator,remat", [("grpo", "dots_saveable"), ("gae", "full")])
def test_unrolled_update_learns_what_the_scanned_one_learns(estimator, remat):
    """`model.scan_unroll` unrolls the update's layers (actor, and the critic with GAE)
    and leaves `forward` rolled: the same parameters and loss terms as the scan."""
    over = {"algorithm.adv_estimator": estimator, "actor.use_kl_loss": True,
            "model.remat": remat, "model.num_layers": 3}
    _, s, model, params = _setup(**over)
    unrolled = dataclasses.replace(model, scan_unroll=True)
    assert model.num_layers == 3 and not model.scan_unroll
    critic_params = init_critic_params(params, jax.random.key(1)) if s.critic else None
    ro, ref = _rollout(), jax.tree.map(lambda x: x * 0.9, params)
    outs = {}
    for name, m in (("scan", model), ("unrolled", unrolled)):
        exp = jax.jit(lambda sta, r, o, m=m: step.forward(
            sta, r, o, settings=s, model_config=m))(
            _state(s, params, critic_params), ref, ro)
        exp = exp.replace(token_level_scores=_experience(ro).token_level_scores,
                          uid=jnp.repeat(jnp.arange(4, dtype=jnp.int32), 2))
        outs[name] = _learn(s, m, _state(s, params, critic_params), exp)
    (n1, m1), (n0, m0) = outs["unrolled"], outs["scan"]
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in
                zip(jax.tree.leaves(n0.actor.params), jax.tree.leaves(params), strict=True))
    assert moved > 1e-4  # the update did something for the two to agree on
    chex.assert_trees_all_close(n1.actor.params, n0.actor.params, atol=1e-6, rtol=0)
    if s.critic:
        chex.assert_trees_all_close(n1.critic.params, n0.critic.params, atol=1e-6, rtol=0)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        np.testing.assert_allclose(m1[key], m0[key], rtol=1e-5, atol=1e-8, err_msg=key)


_CRITIC_ON_POLICY = {"algorithm.adv_estimator": "gae", "critic.ppo_mini_batch_size": 4}


def test_critic_on_policy_applies_only_where_its_update_is_on_policy():
    assert _setup(**_CRITIC_ON_POLICY)[1].critic.on_policy
    assert not _setup(**{"algorithm.adv_estimator": "gae"})[1].critic.on_policy  # 2 minis
    for off in ({"critic.reuse_update_values": False}, {"critic.ppo_epochs": 2}):
        assert not _setup(**_CRITIC_ON_POLICY, **off)[1].critic.on_policy, off
    assert _setup(**{**_CRITIC_ON_POLICY, "algorithm.adv_estimator": "grpo"})[1].critic is None
    s = _setup(**{"algorithm.adv_estimator": "gae"})[1]
    with pytest.raises(ValueError, match=r"^critic\.reuse_update_values: applies only"):
        dataclasses.replace(s, critic=dataclasses.replace(s.critic, on_policy=True))


def _holed(ro: Rollout) -> Rollout:
    """`ro` with every third response token out of the loss but still attended to (a
    multi-turn row's tool outputs)."""
    holes = (np.arange(ro.responses.shape[1]) % 3 == 1)[None, :]
    return ro.replace(response_mask=jnp.where(holes, 0, ro.response_mask),
                      response_attention_mask=ro.response_mask)


@pytest.mark.parametrize("over,layout", [
    # The actor on-policy too (one mini-batch), no KL in the reward.
    ({"actor.ppo_mini_batch_size": 4}, "plain"),
    # GAE with gamma, lam < 1 (returns then depend on the values), the KL penalty in the
    # reward, 3 response buckets over 40 columns, tokens out of the loss mid-row.
    ({"algorithm.use_kl_in_reward": True, "algorithm.gamma": 0.9, "algorithm.lam": 0.8,
      "actor.response_buckets": 3, "rollout.response_length": 40}, "long, holed"),
])
def test_on_policy_critic_learns_what_the_value_pass_gives(over, layout):
    """Skipping the value pass changes nothing but float noise: the critic's update values
    the batch with the parameters the pass would use, its micro-batches take their GAE
    returns from those values, and the advantages, the actor's update and every metric
    follow as from the pass."""
    over = {**_CRITIC_ON_POLICY, "actor.use_kl_loss": True, "critic.optim.lr": 1e-3, **over}
    _, s, model, params = _setup(**over)
    _, s_pass, _, _ = _setup(**over, **{"critic.reuse_update_values": False})
    assert s.critic.on_policy and not s_pass.critic.on_policy
    assert s.actor.on_policy == (layout == "plain")
    critic_params = init_critic_params(params, jax.random.key(1))
    ro = _rollout() if layout == "plain" else _holed(_long_rollout())
    ref = jax.tree.map(lambda x: x * 0.9, params)
    scores = np.zeros(ro.responses.shape, np.float32)
    scores[np.arange(8), np.maximum(np.asarray(ro.response_mask).sum(1) - 1, 0)] = SCORES
    outs = {}
    for name, st in (("update", s), ("pass", s_pass)):
        exp = jax.jit(lambda sta, r, o, st=st: step.forward(
            sta, r, o, settings=st, model_config=model))(
            _state(st, params, critic_params), ref, ro)
        assert (exp.values is None) == (name == "update")
        exp = exp.replace(token_level_scores=jnp.asarray(scores),
                          uid=jnp.repeat(jnp.arange(4, dtype=jnp.int32), 2))
        outs[name] = _learn(st, model, _state(st, params, critic_params), exp)
    (n1, m1), (n0, m0) = outs["update"], outs["pass"]
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in
                zip(jax.tree.leaves(n0.critic.params), jax.tree.leaves(critic_params),
                    strict=True))
    assert moved > 1e-4 and m0["critic/vf_loss"] > 0
    # Adam's first step divides each gradient by its own size: a component near zero
    # turns float noise of the values into up to ~1e-5 here (lr 1e-3).
    chex.assert_trees_all_close(n1.critic.params, n0.critic.params, atol=1e-5, rtol=0)
    chex.assert_trees_all_close(n1.actor.params, n0.actor.params, atol=1e-5, rtol=0)
    assert m1["critic/vf_clipfrac"] == 0.0  # old values = this pass's
    assert set(m1) == set(m0)
    for key in m0:
        np.testing.assert_allclose(m1[key], m0[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_old_log_prob_replay_hands_the_pass_s_experts_to_the_update():
    """`actor.router_replay="old_log_prob"` (verl's R2) with two mini-batches: `forward`
    records the experts its old-log-prob pass chose, as that pass records them alone, in
    the batch the update replays; disabled, the batch carries none."""
    overrides = {"model.preset": "tiny-moe", "actor.router_replay": "old_log_prob"}
    _, s, model, params = _setup(**overrides)
    # Experts of a larger scale than the init's, so that which ones a token takes shows.
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 8 if "mlp" in jax.tree_util.keystr(path) else x, params)
    assert "old_log_probs" in step.forward_passes(s, False)
    rollout = _rollout()
    exp = jax.jit(lambda st, ro: step.forward(st, None, ro, settings=s, model_config=model))(
        _state(s, params), rollout)
    seq = (rollout.prompt_ids, rollout.prompt_mask, rollout.responses, rollout.response_mask)
    want = logprobs.response_log_probs(params, *seq, config=model, chunk_size=s.logprob_chunk_size,
                                       temperature=s.rollout.temperature, with_entropy=True,
                                       record=True)
    assert exp.prompt_routing.shape == (8, 4, model.num_layers, model.num_experts_per_tok)
    np.testing.assert_array_equal(exp.prompt_routing, want.prompt_routing)
    np.testing.assert_array_equal(exp.response_routing, want.response_routing)
    chex.assert_trees_all_close((exp.old_log_probs, exp.entropy), want.outputs, atol=1e-6)
    shifted = lambda x, shift: jnp.where(x >= 0, (x + shift) % model.num_experts, x)
    replayed = lambda shift: _learn(s, model, _state(s, params), _experience(
        rollout, old_log_probs=exp.old_log_probs).replace(
        prompt_routing=shifted(exp.prompt_routing, shift),
        response_routing=shifted(exp.response_routing, shift)))[1]
    # The update routes as told: with its own experts the policy moves from the old one
    # only by the first mini-batch's step (the second's KL); others make it another
    # policy from the start.
    own, other = replayed(0), replayed(1)
    assert abs(other["actor/ppo_kl"]) > 3 * abs(own["actor/ppo_kl"])
    assert abs(other["actor/pg_loss"] - own["actor/pg_loss"]) > 5e-3

    _, off, model, params = _setup(**{"model.preset": "tiny-moe"})
    exp = jax.jit(lambda st, ro: step.forward(st, None, ro, settings=off, model_config=model))(
        _state(off, params), rollout)
    assert exp.prompt_routing is None and exp.response_routing is None
