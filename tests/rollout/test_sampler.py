"""Rollout: cached greedy decoding vs a no-cache reference, sampling statistics, stops, n > 1,
and identical samples on 1 and 8 (CPU) devices."""

import dataclasses
import functools
import os
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.kernels import mosaic_backend
from jrl.models import ModelConfig, forward_logits, init_params, positions_from_mask
from jrl.rollout import sampler
from jrl.rollout.sampler import SamplingConfig
from tests.eight_devices import run_script
from tests.markers import NEEDS_MOSAIC
from tests.tracing import decode_masks, retrace

# A small Qwen2-style model whose random logits are spread out (large init), so that
# greedy argmaxes are not near-ties and cached vs uncached rounding cannot flip them.
SMALL = ModelConfig(
    family="qwen2", vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True, initializer_range=0.5,
)
# A 12-token vocabulary with a flat-ish next-token distribution, for the statistics.
STATS = ModelConfig(
    family="qwen2", vocab_size=12, hidden_size=16, intermediate_size=32, num_layers=1,
    num_heads=2, num_kv_heads=1, head_dim=8, qkv_bias=True, initializer_range=0.12,
)
# Chi-square critical values at p = 0.001 by degrees of freedom.
CHI2_CRITICAL_0001 = {
    1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322,
    8: 26.124, 9: 27.877, 10: 29.588, 11: 31.264, 12: 32.909, 13: 34.528, 14: 36.123,
}


def ragged_prompts(lengths, prompt_len, vocab_size, seed):
    """Left-padded random prompts `[B, P]` (pad id 0) with the given lengths."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab_size, size=(len(lengths), prompt_len)).astype(np.int32)
    mask = (np.arange(prompt_len)[None] >= prompt_len - np.array(lengths)[:, None])
    return np.where(mask, ids, 0).astype(np.int32), mask.astype(np.int32)


def random_params(config, seed):
    # Jitted: eager Flax init of the scanned layers is several times slower.
    return jax.jit(init_params, static_argnums=0)(config, jax.random.key(seed))


@pytest.fixture(scope="module")
def small_params():
    return random_params(SMALL, 0)


@pytest.fixture(scope="module")
def prompts():
    return ragged_prompts([5, 2, 7, 1, 4, 6], prompt_len=7, vocab_size=SMALL.vocab_size, seed=0)


@pytest.fixture(scope="module")
def greedy_reference(small_params, prompts):
    return reference_greedy(small_params, *prompts, num_new=8, config=SMALL)


def reference_greedy(params, ids, mask, num_new, config):
    """Greedy decoding that re-runs the full forward (no cache) for every new token."""
    batch, prompt_len = ids.shape
    tokens = np.concatenate([ids, np.zeros((batch, num_new), np.int32)], axis=1)
    valid = np.concatenate([mask, np.zeros((batch, num_new), np.int32)], axis=1)

    @jax.jit
    def logits_fn(tokens, valid):
        return forward_logits(params, tokens, positions_from_mask(valid), valid, config=config)[0]

    for i in range(num_new):
        logits = np.asarray(logits_fn(tokens, valid))
        tokens[:, prompt_len + i] = logits[:, prompt_len + i - 1].argmax(-1)
        valid[:, prompt_len + i] = 1
    return tokens[:, prompt_len:]


def assert_well_formed(out, sampling):
    """Invariants of every RolloutOutput: prefix masks, pads, zero log-probs, stop placement."""
    responses, mask = np.asarray(out.responses), np.asarray(out.response_mask)
    log_probs, lengths = np.asarray(out.rollout_log_probs), np.asarray(out.response_lengths)
    rows, num_new = responses.shape
    chex.assert_shape([out.responses, out.response_mask, out.rollout_log_probs], (rows, num_new))
    chex.assert_shape(out.response_lengths, (rows,))
    np.testing.assert_array_equal(mask, np.arange(num_new)[None] < lengths[:, None])
    np.testing.assert_array_equal(responses[mask == 0], sampling.pad_token_id)
    np.testing.assert_array_equal(log_probs[mask == 0], 0.0)
    assert np.all(np.isfinite(log_probs)) and np.all(log_probs <= 0)
    is_stop = np.isin(responses, sampling.stop_token_ids) & (mask == 1)
    if sampling.ignore_stop:
        assert np.all(lengths == num_new)
        return
    # A stop token ends its row: it is the last valid token, and no earlier token is one.
    np.testing.assert_array_equal(is_stop.sum(1), (lengths < num_new) | is_stop[:, -1])
    stopped = lengths < num_new
    np.testing.assert_array_equal(is_stop[stopped, lengths[stopped] - 1], True)


class TestSamplingConfig:
    @pytest.mark.parametrize(
        "key, value",
        [
            ("n", 0), ("max_new_tokens", 0), ("temperature", 0.0), ("temperature", -1.0),
            ("top_k", -2), ("top_k", 2.5), ("top_p", 0.0), ("top_p", 1.5),
            ("stop_token_ids", (3, 99)), ("pad_token_id", -1), ("do_sample", "yes"),
        ],
    )
    def test_bad_key_is_named(self, key, value):
        sampling = SamplingConfig(**{key: value})
        with pytest.raises(ValueError, match=rf"rollout\.{key} must be"):
            sampling.validate(vocab_size=32)

    def test_greedy_allows_zero_temperature_and_hashes(self):
        sampling = SamplingConfig(do_sample=False, temperature=0.0, stop_token_ids=[2, 5])
        assert sampling.validate(vocab_size=32) is sampling
        assert sampling.stop_token_ids == (2, 5)
        assert hash(sampling) == hash(SamplingConfig(do_sample=False, temperature=0.0,
                                                     stop_token_ids=(2, 5)))

    def test_for_validation(self):
        train = SamplingConfig(n=8, temperature=1.0, top_p=0.9, stop_token_ids=(2,))
        val = train.for_validation(do_sample=False, temperature=0, top_p=1.0, top_k=-1, n=1)
        assert (val.n, val.do_sample, val.top_p, val.stop_token_ids) == (1, False, 1.0, (2,))
        assert train.for_validation(n=None, top_p=0.7) == SamplingConfig(
            n=8, temperature=1.0, top_p=0.7, stop_token_ids=(2,))
        with pytest.raises(ValueError, match=r"rollout\.val_kwargs\.temperature must be > 0"):
            train.for_validation(do_sample=True, temperature=0.0)
        with pytest.raises(ValueError, match="unknown key"):
            train.for_validation(max_new_tokens=3)


def test_bad_prompts_are_rejected_before_compiling(small_params, prompts):
    ids, mask = prompts
    sampling = SamplingConfig(max_new_tokens=2)
    run = lambda i, m: sampler.generate(
        small_params, i, m, jax.random.key(0), sampling, config=SMALL)
    right_padded = mask.copy()
    right_padded[1] = right_padded[1, ::-1]
    with pytest.raises(ValueError, match="prompt row 1 is not left-padded"):
        run(ids, right_padded)
    with pytest.raises(ValueError, match="prompt row 0 is empty"):
        run(ids, np.where(np.arange(6)[:, None] == 0, 0, mask))
    with pytest.raises(ValueError, match=r"row 2 has token ids outside \[0, vocab_size=32\)"):
        run(np.where(np.arange(6)[:, None] == 2, 40, ids), mask)
    with pytest.raises(ValueError, match=r"must both be \[B, P\]"):
        run(ids, mask[:, 1:])


def test_greedy_matches_uncached_reference(small_params, prompts, greedy_reference):
    ids, mask = prompts
    sampling = SamplingConfig(max_new_tokens=8, do_sample=False)
    out = sampler.generate(small_params, ids, mask, jax.random.key(0), sampling, config=SMALL)
    np.testing.assert_array_equal(out.responses, greedy_reference)
    np.testing.assert_array_equal(out.prompt_ids, ids)
    np.testing.assert_array_equal(out.prompt_mask, mask)
    np.testing.assert_array_equal(out.response_lengths, 8)
    assert_well_formed(out, sampling)
    full_ids, full_mask = out.sequences()
    chex.assert_shape([full_ids, full_mask], (6, 15))


def pick_stop_tokens(greedy, num_new):
    """Two stop ids that make some row stop at step 0, some in the middle, some never."""
    first = int(greedy[0, 0])
    for second in range(SMALL.vocab_size):
        hits = np.isin(greedy, [first, second])
        lengths = np.where(hits.any(1), hits.argmax(1) + 1, num_new)
        if 1 in lengths and num_new in lengths and np.any((lengths > 1) & (lengths < num_new)):
            return (first, second), lengths
    raise AssertionError("no stop ids give all three cases; change the seed")


def test_stop_tokens(small_params, prompts, greedy_reference):
    ids, mask = prompts
    num_new, greedy = 8, greedy_reference
    stops, lengths = pick_stop_tokens(greedy, num_new)
    run = lambda sampling: sampler.generate(
        small_params, ids, mask, jax.random.key(0), sampling, config=SMALL)

    sampling = SamplingConfig(
        max_new_tokens=num_new, do_sample=False, stop_token_ids=stops, pad_token_id=31)
    out = run(sampling)
    np.testing.assert_array_equal(out.response_lengths, lengths)
    valid = np.arange(num_new)[None] < lengths[:, None]
    np.testing.assert_array_equal(out.response_mask, valid)
    np.testing.assert_array_equal(out.responses, np.where(valid, greedy, 31))
    assert_well_formed(out, sampling)

    forced = SamplingConfig(
        max_new_tokens=num_new, do_sample=False, stop_token_ids=stops, ignore_stop=True)
    out = run(forced)
    np.testing.assert_array_equal(out.responses, greedy)
    np.testing.assert_array_equal(out.response_mask, 1)
    assert_well_formed(out, forced)


def test_finished_rows_attend_to_the_new_slot_alone(small_params, prompts, greedy_reference,
                                                    monkeypatch):
    """A decode step gives a row that has stopped a mask of the new slot alone (so the
    decode kernels read one block of its cache), and a running row its prompt and every
    token up to the new one."""
    ids, mask = prompts
    num_new, prompt_len = 8, ids.shape[1]
    stops, lengths = pick_stop_tokens(greedy_reference, num_new)
    seen = decode_masks(monkeypatch, sampler)
    sampling = SamplingConfig(max_new_tokens=num_new, do_sample=False, stop_token_ids=stops)
    out = sampler.generate(small_params, ids, mask, jax.random.key(0), sampling, config=SMALL)
    jax.effects_barrier()
    np.testing.assert_array_equal(out.response_lengths, lengths)
    assert len(seen) == num_new - 1, len(seen)  # steps 1 .. R-1 (step 0 is the prefill's)
    for slot, key_mask in sorted(seen.items()):
        step = slot - prompt_len + 1  # the response token this step samples
        num_slots = key_mask.shape[1]
        only_new = (np.arange(num_slots) == slot)[None]
        running = np.pad(mask, ((0, 0), (0, num_slots - prompt_len)))
        running[:, prompt_len:slot + 1] = 1
        want = np.where((lengths <= step)[:, None], only_new, running)
        np.testing.assert_array_equal(key_mask, want, err_msg=f"decode step {step}")
    assert any((lengths <= s - prompt_len + 1).any() for s in seen)


@pytest.mark.parametrize("impl", ["xla", pytest.param("mosaic", marks=NEEDS_MOSAIC)])
def test_stopped_rows_mask_changes_no_rollout(monkeypatch, impl):
    """Stopped rows attending to their new slot alone (`decoding_mask`) changes no token,
    log-prob or length against their attending to the whole cache, with and without
    compaction on the XLA path and with it on the Mosaic GPU kernel (GPU interpret mode off a GPU;
    on one it needs a Hopper GPU, a power-of-two head_dim from 32 and a bf16 cache)."""
    if impl == "mosaic" and jax.default_backend() == "gpu" and not mosaic_backend.on_hopper():
        pytest.skip("the Mosaic GPU kernel compiles for Hopper GPUs only")
    # The kernel in one layer: interpreted off a GPU, each of its steps takes tens of ms.
    config = dataclasses.replace(SMALL, head_dim=32, decode_attention_impl=impl,
                                 num_layers=1 if impl == "mosaic" else SMALL.num_layers,
                                 dtype="bfloat16" if impl == "mosaic" else SMALL.dtype)
    params = random_params(config, 0)
    ids, mask = ragged_prompts([5, 2, 7, 1, 4, 6], 7, config.vocab_size, seed=4)
    traced = []

    def whole_cache(key_mask, slot, running):
        traced.append(slot)
        return key_mask

    retrace(monkeypatch, sampler)  # each generate traced anew, through the patch or not
    # The kernel reads the mask the same way with compaction off: it runs with it on.
    for buckets in (1, 3) if impl == "xla" else (3,):
        sampling = SamplingConfig(n=2, max_new_tokens=12, temperature=1.2,
                                  stop_token_ids=tuple(range(2, 9)), decode_buckets=buckets)
        run = lambda sampling=sampling: sampler.generate(params, ids, mask, jax.random.key(1),
                                                         sampling, config=config)
        got = run()
        lengths = np.asarray(got.response_lengths)
        assert len(set(lengths)) > 3 and lengths.min() < 4, lengths  # rows stop early
        with monkeypatch.context() as patch:
            patch.setattr(sampler, "decoding_mask", whole_cache)
            want = run()
        assert traced, "the sampler was not traced with the whole-cache mask"
        traced.clear()
        chex.assert_trees_all_equal(got, want)


def expected_distribution(logits, sampling):
    """Sampling distribution by the sort-based definition (HF / vLLM), in float64."""
    z = logits.astype(np.float64) / sampling.temperature
    order = np.argsort(-z, kind="stable")
    keep = np.ones_like(z, bool)
    if 0 < sampling.top_k < z.size:
        keep[order[sampling.top_k:]] = False
    probs = np.where(keep, np.exp(z - z.max()), 0.0)
    probs /= probs.sum()
    if sampling.top_p < 1.0:
        sorted_probs = probs[order]
        mass_before = np.cumsum(sorted_probs) - sorted_probs
        # Keep the test away from boundaries where float32 rounding could flip a token.
        assert np.min(np.abs(np.cumsum(sorted_probs) - sampling.top_p)) > 1e-3
        keep[order[mass_before >= sampling.top_p]] = False
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum()
    return probs


def chi_square(counts, probs):
    """(statistic, degrees of freedom), bins with expected count < 5 merged into one."""
    expected = counts.sum() * probs
    small = expected < 5
    observed_bins = np.append(counts[~small], counts[small].sum())
    expected_bins = np.append(expected[~small], expected[small].sum())
    if not small.any():
        observed_bins, expected_bins = observed_bins[:-1], expected_bins[:-1]
    statistic = np.sum((observed_bins - expected_bins) ** 2 / expected_bins)
    return statistic, observed_bins.size - 1


@pytest.fixture(scope="module")
def stats_model():
    """(params, prompt ids [1, 4], prompt mask [1, 4], next-token logits [V]) of STATS."""
    params = random_params(STATS, 3)
    ids, mask = np.array([[0, 3, 5, 7]], np.int32), np.array([[0, 1, 1, 1]], np.int32)
    logits_fn = jax.jit(functools.partial(forward_logits, config=STATS))
    logits = logits_fn(params, ids, positions_from_mask(mask), mask)[0]
    return params, ids, mask, np.asarray(logits[0, -1])


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(0.7, -1, 1.0), (1.3, 5, 1.0), (1.0, -1, 0.75), (0.9, 6, 0.8)],
)
def test_first_token_statistics(stats_model, temperature, top_k, top_p):
    params, ids, mask, logits = stats_model
    sampling = SamplingConfig(
        n=20_000, max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
    probs = expected_distribution(logits, sampling)

    out = sampler.generate(params, ids, mask, jax.random.key(7), sampling, config=STATS)
    tokens = np.asarray(out.responses[:, 0])
    counts = np.bincount(tokens, minlength=STATS.vocab_size)
    assert counts[probs == 0].sum() == 0, "a token outside top-k / top-p was sampled"
    statistic, dof = chi_square(counts[probs > 0], probs[probs > 0])
    assert statistic < CHI2_CRITICAL_0001[dof], (statistic, dof, counts, probs)
    np.testing.assert_allclose(out.rollout_log_probs[:, 0], np.log(probs[tokens]), atol=2e-5)


def sort_based_filter(z, top_k, top_p):
    """Reference keep-mask `[N, V]` by sorting: the k best, then keep while mass before < top_p."""
    order = np.argsort(-z, axis=-1)
    sorted_z = np.take_along_axis(z, order, -1)
    keep_sorted = np.ones(z.shape, bool)
    if 0 < top_k < z.shape[-1]:
        keep_sorted[:, top_k:] = False
    probs = np.where(keep_sorted, np.exp(sorted_z - sorted_z[:, :1]), 0.0)
    probs /= probs.sum(-1, keepdims=True)
    keep_sorted &= np.cumsum(probs, -1) - probs < top_p
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, -1)
    return keep


@pytest.mark.parametrize(
    "top_k, top_p",
    [(-1, 0.05), (-1, 0.5), (-1, 0.9), (-1, 0.99), (1, 1.0), (40, 1.0), (40, 0.9), (0, 0.7),
     (999, 1.0)],
)
def test_threshold_search_matches_sorting(top_k, top_p):
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((64, 1000)) * rng.uniform(0.5, 4.0, (64, 1))).astype(np.float32)
    sampling = SamplingConfig(temperature=0.8, top_k=top_k, top_p=top_p)
    processed = jax.jit(sampler.processed_logits, static_argnums=1)(logits, sampling)
    expected = sort_based_filter(logits.astype(np.float64) / 0.8, top_k, top_p)
    np.testing.assert_array_equal(np.isfinite(processed), expected)
    kept = np.where(expected, logits / np.float32(0.8), -np.inf)
    np.testing.assert_allclose(processed, kept, rtol=1e-6)


def test_sampler_log_probs_match_processed_distribution():
    logits = jax.random.normal(jax.random.key(0), (256, 50)) * 3.0
    keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(1), jnp.arange(256))
    sample = jax.jit(sampler.sample_tokens, static_argnums=2)
    process = jax.jit(sampler.processed_logits, static_argnums=1)
    for sampling in (SamplingConfig(temperature=0.6, top_k=7, top_p=0.8),
                     SamplingConfig(temperature=1.2, top_p=0.6),
                     SamplingConfig(temperature=1.0, top_k=50)):  # top_k >= V is off
        tokens, log_probs = sample(logits, keys, sampling)
        log_dist = jax.nn.log_softmax(process(logits, sampling))
        chosen = jnp.take_along_axis(log_dist, tokens[:, None], 1)[:, 0]
        assert jnp.all(jnp.isfinite(chosen))
        chex.assert_trees_all_close(log_probs, chosen, atol=1e-5)
    greedy_tokens, greedy_log_probs = sampler.sample_tokens(
        logits, keys, SamplingConfig(do_sample=False))
    np.testing.assert_array_equal(greedy_tokens, jnp.argmax(logits, -1))
    np.testing.assert_array_equal(greedy_log_probs, 0.0)


def test_filters_keep_ties_and_the_argmax():
    top_p = SamplingConfig(top_p=0.5)
    flat = sampler.processed_logits(jnp.zeros((1, 8)), top_p)
    assert jnp.all(jnp.isfinite(flat))  # all tied: kept together
    peaked = sampler.processed_logits(jnp.array([[0.0, 9.0, 1.0, -jnp.inf]]), top_p)
    np.testing.assert_array_equal(jnp.isfinite(peaked), [[False, True, False, False]])
    top_2 = sampler.processed_logits(jnp.array([[1.0, 3.0, 2.0, 2.0, 0.0]]),
                                     SamplingConfig(top_k=2))
    np.testing.assert_array_equal(jnp.isfinite(top_2), [[False, True, True, True, False]])


def test_n_samples_are_adjacent_distinct_and_deterministic(small_params, prompts):
    ids, mask = prompts[0][:3], prompts[1][:3]
    sampling = SamplingConfig(n=4, max_new_tokens=6, temperature=1.0, top_p=0.95,
                              stop_token_ids=(3, 7), pad_token_id=0)
    run = lambda ids, key: sampler.generate(
        small_params, ids, mask, jax.random.key(key), sampling, config=SMALL)
    out = run(ids, 0)
    assert_well_formed(out, sampling)
    np.testing.assert_array_equal(out.prompt_ids, np.repeat(ids, 4, axis=0))
    np.testing.assert_array_equal(out.prompt_mask, np.repeat(mask, 4, axis=0))
    for group in np.asarray(out.responses).reshape(3, 4, 6):
        assert len({tuple(row) for row in group}) > 1, group
    chex.assert_trees_all_equal(out, run(ids, 0))
    assert not np.array_equal(out.responses, run(ids, 1).responses)
    # A row's samples depend on its own prompt and index only, not on other rows.
    other = run(np.where(np.arange(3)[:, None] == 0, (ids + 1) % SMALL.vocab_size, ids), 0)
    assert not np.array_equal(out.responses[:4], other.responses[:4])
    chex.assert_trees_all_equal(out.responses[4:], other.responses[4:])


_SHARDED_SCRIPT = textwrap.dedent("""
    import dataclasses, json, sys
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    sys.path.insert(0, {tests_dir!r})
    from test_sampler import SMALL, ragged_prompts, random_params
    from jrl import sharding
    from jrl.rollout import paged, sampler

    assert jax.device_count() == 8, jax.devices()
    params = random_params(SMALL, 0)
    ids, mask = ragged_prompts([5, 2, 7, 1, 4, 6, 3, 7], 7, SMALL.vocab_size, seed=2)
    sampling = sampler.SamplingConfig(n=2, max_new_tokens=6, temperature=0.9, top_p=0.9,
                                      stop_token_ids=(2,))
    key = jax.random.key(5)
    single = sampler.generate(params, ids, mask, key, sampling, config=SMALL)
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    rows = NamedSharding(mesh, PartitionSpec("batch"))
    replicated = NamedSharding(mesh, PartitionSpec())
    sharded = sampler.generate(
        jax.device_put(params, replicated), jax.device_put(ids, rows),
        jax.device_put(mask, rows), key, sampling, config=SMALL)
    # Rows continued over two calls on the 8 devices (the mesh's rules active, so the
    # decode loop compacts within each device's rows), against one call on one.
    row_ids, row_mask = np.repeat(ids, 2, axis=0), np.repeat(mask, 2, axis=0)
    one_row = dataclasses.replace(sampling, n=1, decode_buckets=2)
    once = sampler.generate(params, row_ids, row_mask, key, one_row, config=SMALL)
    sharder = sharding.Sharder(sharding.make_mesh(
        sharding.MeshSettings(data=8, fsdp=1, tensor=1), jax.devices()))
    prefix, carried = sampler.new_rows(key, 16), None
    sampler.PREFILL_COLUMNS = 2  # chunks of 2 columns: the carried rows start late
    with sharder.active():
        put = lambda x: jax.device_put(x, sharder.batch())
        # Two tokens a call, each call's cache carried into the next; the prefix 2 then
        # 6 columns wide (the cache moved past its old end).
        held, running = [], []  # each call's rows in its carried cache, and still running
        for width in (2, 6, 6):
            out = sampler.continue_rows(jax.device_put(params, sharder.replicated),
                                        put(row_ids), put(row_mask), put(prefix), one_row,
                                        config=SMALL, max_steps=2, carried=carried,
                                        keep_cache=True)
            rows = np.asarray(out.carried.rows)
            held.append(sorted(rows[rows < 16].tolist()))
            running.append(np.flatnonzero(~np.asarray(out.finished)).tolist())
            prefix = sampler.Prefix(out.responses[:, :width],
                                    out.rollout_log_probs[:, :width], out.response_lengths,
                                    out.finished, prefix.keys, ~out.finished)
            carried = out.carried
        # The paged cache over the 8 devices' rows: 8 decode slots for the 16 rows.
        paged_out = paged.generate(
            jax.device_put(params, sharder.replicated), put(ids), put(mask), key,
            dataclasses.replace(sampling, kv_cache="paged", max_num_seqs=8, page_size=4),
            config=SMALL)
    print(json.dumps(dict(
        paged_same=bool(np.array_equal(paged_out.responses, single.responses)
                        and np.array_equal(paged_out.response_lengths,
                                           single.response_lengths)),
        paged_log_prob_diff=float(np.abs(paged_out.rollout_log_probs
                                         - single.rollout_log_probs).max()),
        continued_devices=len(out.responses.sharding.device_set),
        held=held, running=running,
        continued_same=bool(np.array_equal(out.responses, once.responses)
                            and np.array_equal(out.response_lengths, once.response_lengths)
                            and np.asarray(out.finished).all()),
        single_devices=len(single.responses.sharding.device_set),
        sharded_devices=len(sharded.responses.sharding.device_set),
        same_responses=bool(np.array_equal(single.responses, sharded.responses)),
        same_lengths=bool(np.array_equal(single.response_lengths, sharded.response_lengths)),
        log_prob_diff=float(np.abs(single.rollout_log_probs - sharded.rollout_log_probs).max()),
        some_stopped=bool(np.any(np.asarray(single.response_lengths) < 6)),
    )))
""")


def test_sharded_over_8_devices_matches_one_device():
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    result = run_script(_SHARDED_SCRIPT.format(tests_dir=tests_dir))
    assert result["single_devices"] == 1 and result["sharded_devices"] == 8, result
    assert result["same_responses"] and result["same_lengths"], result
    assert result["log_prob_diff"] < 1e-5, result
    assert result["some_stopped"], result
    assert result["continued_devices"] == 8 and result["continued_same"], result
    # Each call's carried cache holds every row still running, past the compaction to 8.
    assert result["held"] == result["running"] and len(result["running"][0]) > 8, result
    assert result["paged_same"] and result["paged_log_prob_diff"] < 1e-5, result


def test_decode_compaction_gives_the_same_rollout(small_params, buckets=3):
    """Compacting unfinished rows into smaller batches changes no token or length (a
    row's sample depends on its own key and prompt only); log-probs agree to float32
    rounding (the matmuls run at other batch sizes)."""
    ids, mask = ragged_prompts([5, 2, 7, 1, 4, 6], 7, SMALL.vocab_size, seed=4)
    base = SamplingConfig(n=2, max_new_tokens=12, temperature=1.2,
                          stop_token_ids=tuple(range(2, 9)))
    full = sampler.generate(small_params, ids, mask, jax.random.key(1), base, config=SMALL)
    lengths = np.asarray(full.response_lengths)
    # Rows stop at different steps, so the loop does shrink (sizes 12 -> ... -> 12/buckets).
    assert len(set(lengths)) > 3 and lengths.min() < 4, lengths
    compacting = dataclasses.replace(base, decode_buckets=buckets)
    assert sampler.decode_sizes(12, 1, compacting)[-1] == -(-12 // buckets)
    out = sampler.generate(small_params, ids, mask, jax.random.key(1), compacting, config=SMALL)
    assert_well_formed(out, compacting)
    chex.assert_trees_all_equal(out.replace(rollout_log_probs=None),
                                full.replace(rollout_log_probs=None))
    np.testing.assert_allclose(out.rollout_log_probs, full.rollout_log_probs, atol=1e-5)


def test_decode_sizes_and_compaction_by_hand():
    sampling = SamplingConfig(stop_token_ids=(2,), decode_buckets=4)
    assert sampler.decode_sizes(512, 1, sampling) == (512, 384, 256, 128)
    # 2 shards of 6 rows: 6, 5 (4.5 up), 3, 2 (1.5 up) rows each.
    assert sampler.decode_sizes(12, 2, sampling) == (12, 10, 6, 4)
    for never_stops in (dataclasses.replace(sampling, ignore_stop=True),
                        dataclasses.replace(sampling, stop_token_ids=()),
                        dataclasses.replace(sampling, decode_buckets=1)):
        assert sampler.decode_sizes(512, 1, never_stops) == (512,)
    with pytest.raises(ValueError, match=r"rollout\.decode_buckets must be an integer >= 1"):
        dataclasses.replace(sampling, decode_buckets=0).validate()

    # 8 rows in 2 groups; rows 1, 2, 5 are unfinished. Each group keeps 2 rows: its
    # unfinished ones first (in order), then finished ones.
    done = jnp.asarray([1, 0, 0, 1, 1, 0, 1, 1], bool)
    rows = jnp.arange(8, dtype=jnp.int32)
    state = sampler._DecodeState(
        step=jnp.int32(3), last_tokens=rows + 10, done=done, lengths=rows + 20,
        responses=jnp.stack([rows, rows], 1), log_probs=jnp.zeros((8, 2)),
        cache=sampler.KVCache(k=(jnp.broadcast_to(rows[:, None, None, None], (8, 1, 3, 2)),),
                              v=(jnp.zeros((8, 1, 3, 2)),)),
        key_mask=jnp.ones((8, 3), jnp.int32), keys=sampler.row_keys(jax.random.key(0), 8),
        prompt_lengths=rows, rows=rows)
    small = sampler._compact(state, 4, groups=2)
    np.testing.assert_array_equal(small.rows, [1, 2, 5, 4])
    np.testing.assert_array_equal(small.last_tokens, [11, 12, 15, 14])
    np.testing.assert_array_equal(small.cache.k[0][:, 0, 0, 0], [1, 2, 5, 4])
    np.testing.assert_array_equal(jax.random.key_data(small.keys),
                                  jax.random.key_data(state.keys)[np.array([1, 2, 5, 4])])
    assert int(small.step) == 3
    # Written back: each row's outputs land on its own output row.
    out = (jnp.full((8, 2), -1), jnp.zeros((8, 2)), jnp.zeros(8, jnp.int32))
    responses, _, lengths = sampler._write_rows(out, small.replace(lengths=small.rows * 100),
                                                groups=2)
    np.testing.assert_array_equal(lengths, [0, 100, 200, 0, 400, 500, 0, 0])
    np.testing.assert_array_equal(responses[:, 0], [-1, 1, 2, -1, 4, 5, -1, -1])


def test_the_samplers_compiler_options(small_params, monkeypatch):
    """`SamplingConfig.gemm`: on a GPU "cublas" compiles the sampler's programs without
    Triton GEMM fusions; off a GPU, or with "xla", there are no options. XLA knows the
    option (a CPU compile with it gives the same rollout), and `generate` compiles with
    what `compiler_options` returns (an option XLA does not know stops it)."""
    cublas = SamplingConfig(n=2, max_new_tokens=4)
    xla = dataclasses.replace(cublas, gemm="xla")
    assert sampler.compiler_options(cublas, "gpu") == {"xla_gpu_enable_triton_gemm": False}
    assert sampler.compiler_options(xla, "gpu") == {}
    assert sampler.compiler_options(cublas, "tpu") == {} == sampler.compiler_options(cublas, "cpu")
    with pytest.raises(ValueError, match=r"rollout\.gemm must be one of 'cublas', 'xla'"):
        dataclasses.replace(cublas, gemm="triton").validate()

    ids, mask = ragged_prompts([3, 5], 5, SMALL.vocab_size, seed=0)
    sample = lambda: sampler.generate(small_params, ids, mask, jax.random.key(0), cublas,
                                      config=SMALL)
    plain = sample()
    gpu_options = sampler.compiler_options
    monkeypatch.setattr(sampler, "compiler_options", lambda sampling: gpu_options(sampling, "gpu"))
    chex.assert_trees_all_equal(sample(), plain)
    # Inside a caller's jit (which JAX alone takes options on), `generate` runs unjitted:
    # on a GPU with XLA's own GEMM choice then, which may round the last bits otherwise.
    nested = jax.jit(lambda p, i, m: sampler.generate(p, i, m, jax.random.key(0), cublas,
                                                      config=SMALL))
    if jax.default_backend() == "gpu":
        chex.assert_trees_all_close(nested(small_params, ids, mask), plain, rtol=1e-5, atol=1e-5)
    else:
        chex.assert_trees_all_equal(nested(small_params, ids, mask), plain)
    monkeypatch.setattr(sampler, "compiler_options", lambda sampling: {"xla_no_such_option": 1})
    with pytest.raises(jax.errors.JaxRuntimeError, match="xla_no_such_option"):
        sample()
    jitted = sampler.jit_sampler(sampler.generate_program, cublas,
                                 static_argnames=("sampling", "config"))
    assert jitted is sampler.jit_sampler(sampler.generate_program, cublas,
                                         static_argnames=("sampling", "config"))


@pytest.mark.parametrize("model, columns, slices, carry, buckets, widths", [
    ("small", None, None, False, 2, (0, 4, 8)),
    # The prefix prefilled 3 columns at a time, in slices of 4 rows; its width the
    # response's every call (round 1 through the chunked prefill too), no compaction.
    ("small", 3, 2, False, 1, (12, 12, 12)),
    ("gemma", 3, 2, False, 2, (0, 4, 8)),  # with sliding-window layers (rings of 3 slots)
    # Each call's cache carried into the next: the width growing by more than a call's
    # tokens (the cache moved past its old end), then growing and shrinking.
    ("small", 3, 2, True, 4, (0, 4, 12)),
    ("small", 3, 2, True, 1, (0, 12, 8)),  # no compaction: the batch's own cache
    ("small", 3, 2, True, 4, (12, 12, 12)),
    ("gemma", 3, 2, True, 4, (0, 4, 8)),  # (not used with sliding-window layers)
])
def test_rows_continued_over_calls_draw_the_tokens_of_one_call(small_params, monkeypatch,
                                                               request, model, columns,
                                                               slices, carry, buckets, widths):
    """The partial rollout's primitive: rows generated four tokens a call, each call
    prefilling the tokens so far (a prefix of `widths[call]` columns, as wide as the
    longest row's tokens or wider, like the trainer's power-of-two widths; its keys as
    key data in the second), end as one `generate` call's rows
    (same keys and parameters): the same tokens and lengths, log-probs to float32
    rounding. Between calls a row's length is its tokens so far and it is `finished`
    only once it has stopped; a finished row keeps its tokens, and two rows finished from
    the start with none (the trainer's free decode rows, on another row's prompt) draw
    none. Rows with tokens so far are prefilled longest first, slices of rows each over
    its own columns (`PREFILL_SLICES`, `PREFILL_COLUMNS`), so the rows' unlike lengths
    decide which chunks run. With `carry` each call keeps its cache for the next
    (`keep_cache`), whose rows still running start from it (`Prefix.cached`), but for
    one row each call prefilled in full."""
    config, params = SMALL, small_params
    if model == "gemma":
        config = dataclasses.replace(SMALL, family="gemma2", sliding_window=3,
                                     layer_types=("sliding_attention", "full_attention"))
        params = random_params(config, 0)
    if columns:  # read when the program is traced: traced afresh, and not kept after
        monkeypatch.setattr(sampler, "PREFILL_COLUMNS", columns)
        monkeypatch.setattr(sampler, "PREFILL_SLICES", slices)
        jax.clear_caches()
        request.addfinalizer(jax.clear_caches)
    ids, mask = ragged_prompts([5, 2, 7, 1, 4, 6], 7, config.vocab_size, seed=4)
    sampling = SamplingConfig(n=1, max_new_tokens=12, temperature=1.2,
                              stop_token_ids=(2, 3, 4), decode_buckets=buckets)
    rng = jax.random.key(1)
    whole = sampler.generate(params, ids, mask, rng, sampling, config=config)
    final = np.asarray(whole.response_lengths)
    # Rows stop in each of the three calls, and some run to R.
    assert sorted(set(np.minimum(-(-final // 4), 3))) == [1, 2, 3] and final.max() == 12

    ids, mask = np.concatenate([ids, ids[:2]]), np.concatenate([mask, mask[:2]])
    final = np.concatenate([final, [0, 0]])
    prefix, carried = sampler.new_rows(rng, 8, width=widths[0]), None
    prefix = prefix.replace(finished=np.arange(8) >= 6)
    for call in range(1, 4):
        out = sampler.continue_rows(params, ids, mask, prefix, sampling, config=config,
                                    max_steps=4, carried=carried, keep_cache=carry)
        assert (out.carried is not None) == carry
        lengths, finished = np.asarray(out.response_lengths), np.asarray(out.finished)
        if carry and call < 3:  # every row still running is held (with 4 buckets, more
            # than the 2 rows the decode loop compacts to once the budget is spent), and
            # none that stopped
            assert buckets == 1 or (~finished).sum() > 8 // buckets
            held = np.asarray(out.carried.rows)
            assert sorted(held[held < 8]) == list(np.flatnonzero(~finished))
            keys_nksh = np.asarray(out.carried.cache.k[-1])[held < 8]
            last = keys_nksh[:, :, out.carried.next_slot - 1]  # the last token fed
            assert (np.abs(last).sum(axis=(1, 2)) > 0).all()
        np.testing.assert_array_equal(lengths, np.minimum(final, 4 * call))
        np.testing.assert_array_equal(finished, final <= 4 * call)
        was_finished = np.asarray(prefix.finished)
        width = prefix.responses.shape[1]
        chex.assert_trees_all_equal(np.asarray(out.responses)[was_finished, :width],
                                    np.asarray(prefix.responses)[was_finished])
        keys = jax.random.key_data(prefix.keys) if call == 2 else prefix.keys
        # A running row not marked cached is prefilled in full beside the cached ones.
        cached = ~finished & (np.arange(8) != np.argmax(~finished)) if carry else None
        width = widths[call] if call < 3 else 12
        prefix = sampler.Prefix(out.responses[:, :width], out.rollout_log_probs[:, :width],
                                out.response_lengths, out.finished, keys, cached)
        carried = out.carried
    assert finished.all()
    chex.assert_trees_all_equal(
        jax.tree.map(lambda x: x[:6], out.replace(rollout_log_probs=None, finished=None,
                                                  carried=None)),
        whole.replace(rollout_log_probs=None))
    np.testing.assert_allclose(out.rollout_log_probs[:6], whole.rollout_log_probs, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.responses)[6:], sampling.pad_token_id)


def test_continuing_rows_checks_its_inputs_before_compiling(small_params, prompts):
    ids, mask = prompts
    sampling = SamplingConfig(n=1, max_new_tokens=8)
    prefix = sampler.new_rows(jax.random.key(0), 6, width=4)
    go = lambda prefix=prefix, sampling=sampling, max_steps=2: sampler.continue_rows(
        small_params, ids, mask, prefix, sampling, config=SMALL, max_steps=max_steps)
    with pytest.raises(ValueError, match="rollout.n=2"):
        go(sampling=dataclasses.replace(sampling, n=2))
    with pytest.raises(ValueError, match="max_steps must be an integer >= 1"):
        go(max_steps=0)
    with pytest.raises(ValueError, match=r"prefix.lengths must be \[6\]"):
        go(prefix=prefix.replace(lengths=np.zeros(5, np.int32)))
    with pytest.raises(ValueError, match="12 columns, more than max_new_tokens=8"):
        go(prefix=sampler.new_rows(jax.random.key(0), 6, width=12))
    with pytest.raises(ValueError, match=r"prefix row 2 has length 5, outside \[0, 4\]"):
        go(prefix=prefix.replace(lengths=np.array([0, 1, 5, 0, 0, 0], np.int32)))
