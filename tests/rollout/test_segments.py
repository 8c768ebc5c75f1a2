"""Sampling in cache segments (`rollout.cache_segments`): the single program's rollout,
bit for bit, with a peak cache that follows the tokens generated; on 1 device and on a
4-device mesh."""

import dataclasses
import os
import textwrap

import jax
import numpy as np
import pytest

from jrl.models import ModelConfig
from jrl.rollout import sampler, segments
from jrl.rollout.sampler import SamplingConfig
from tests.eight_devices import run_script
from tests.rollout.test_sampler import SMALL, assert_well_formed, ragged_prompts, random_params

# Near-flat logits over 176 tokens: with one stop token a row stops with probability
# about 1/176 a step, so 504-token responses average about a third of their maximum.
FLAT = ModelConfig(
    family="qwen2", vocab_size=176, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True, initializer_range=0.02,
)
ROLLOUT_FIELDS = ("prompt_ids", "prompt_mask", "responses", "response_mask",
                  "response_lengths", "rollout_log_probs")

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def assert_same_rollout(single, segmented):
    """Every field the same bits, the log-probs too."""
    for field in ROLLOUT_FIELDS:
        np.testing.assert_array_equal(getattr(segmented, field), getattr(single, field),
                                      err_msg=field)


def single_and_segmented(params, ids, mask, key, sampling, num_segments, config=SMALL):
    """The single program's rollout and the rollout in `num_segments` segments (same key),
    checked to be the same bits, and the segments' `Report`."""
    single = sampler.generate(params, ids, mask, key, sampling, config=config)
    report = segments.Report()
    segmented = segments.generate(
        params, ids, mask, key, dataclasses.replace(sampling, cache_segments=num_segments),
        config=config, report=report)
    assert_same_rollout(single, segmented)
    return single, segmented, report


@pytest.fixture(scope="module")
def small_params():
    return random_params(SMALL, 0)


@pytest.mark.parametrize(("decode_buckets", "seed", "top_k", "top_p"), [
    (1, 1, -1, 1.0), (1, 2, -1, 1.0), (4, 1, -1, 1.0), (4, 2, -1, 1.0), (1, 1, 5, 0.9),
    (4, 2, 5, 0.9)])
def test_segments_give_the_single_programs_rollout(small_params, decode_buckets, seed, top_k,
                                                   top_p):
    ids, mask = ragged_prompts([5, 2, 7, 1, 4, 6], 7, SMALL.vocab_size, seed=4)
    single_config = SamplingConfig(n=2, max_new_tokens=248, temperature=1.2, top_k=top_k,
                                   top_p=top_p, stop_token_ids=(3,),
                                   decode_buckets=decode_buckets)
    segmented_config = dataclasses.replace(single_config, cache_segments=4)
    key = jax.random.key(seed)
    single, segmented, report = single_and_segmented(small_params, ids, mask, key,
                                                     single_config, 4)
    assert_well_formed(segmented, segmented_config)
    # Rows stopped at varied steps, and the segments shrank the cache as they did.
    lengths = np.asarray(single.response_lengths)
    assert len(set(lengths)) > 4 and lengths.min() < 10, lengths
    assert len(report.stages) > 1 and report.stages[-1][0] < 12, report.stages
    # ... and the caches grew from 127 slots (P + R = 255) as rows ran on.
    assert report.stages[0] == (12, 127) and report.stages[-1][1] > 127, report.stages
    # The single program's entry point sends segments to this module.
    with pytest.raises(ValueError, match=r"rollout\.cache_segments=4: .* "
                                         r"jrl\.rollout\.segments\.generate"):
        sampler.generate(small_params, ids, mask, key, segmented_config, config=SMALL)


def test_the_segments_caches_alone_change_no_bit(small_params, monkeypatch):
    """With the cache held at every row, the segments' shorter caches (64-slot blocks
    less than the single program's) give its log-probs bit for bit."""
    monkeypatch.setattr(segments, "segment_sizes", lambda rows, groups, s: (rows,))
    ids, mask = ragged_prompts([5, 2, 7, 1, 4, 6], 7, SMALL.vocab_size, seed=4)
    sampling = SamplingConfig(n=2, max_new_tokens=248, temperature=1.2, stop_token_ids=(10,))
    key = jax.random.key(1)
    _, _, report = single_and_segmented(small_params, ids, mask, key, sampling, 4)
    assert report.stages == [(12, 127), (12, 191), (12, 255)], report.stages


def test_segments_with_the_decode_kernel_give_its_bits(monkeypatch, xla_default_emitters):
    """The Mosaic GPU decode-attention kernel (fused, in GPU interpret mode off a GPU) on
    the cache's rows, in bf16: the single program's bits too. Its blocks are 64 or 128
    slots by the cache's length, so the segments' caches differ by whole 128-slot blocks
    (`slot_block`); with the kernel's blocks set to 64 slots (a shorter run: interpreted,
    each (row, head) program of a step takes tens of ms), P7 + R120: the single
    program's 128 slots, a first of three segments of 64."""
    from jrl.kernels import decode_attention as da
    from jrl.kernels import mosaic_backend

    if not mosaic_backend.available():
        pytest.skip("needs Pallas' Mosaic GPU backend")
    if jax.default_backend() == "gpu" and not mosaic_backend.on_hopper():
        pytest.skip("the Mosaic GPU kernel compiles for Hopper GPUs only")
    config = dataclasses.replace(SMALL, num_layers=1, num_kv_heads=1, head_dim=32,
                                 dtype="bfloat16", decode_attention_impl="mosaic")
    assert segments.slot_block(config, 256) == 128
    assert segments.segment_slots(config, 8, SamplingConfig(
        max_new_tokens=504, cache_segments=4)) == (256, 384, 512, 512)
    monkeypatch.setattr(da, "MOSAIC_TILES", da.MosaicTiles(64, 2, compact=True, fused=True))
    jax.clear_caches()  # MOSAIC_TILES is read when a program is traced
    assert segments.slot_block(config, 128) == 64
    params = random_params(config, 0)
    ids, mask = ragged_prompts([5, 2, 7], 7, config.vocab_size, seed=4)
    sampling = SamplingConfig(n=2, max_new_tokens=120, temperature=1.2, stop_token_ids=(3,))
    _, _, report = single_and_segmented(params, ids, mask, jax.random.key(1), sampling, 3,
                                        config)
    assert report.stages[0] == (6, 64) and report.stages[-1][1] == 128, report.stages


def test_ignore_stop_runs_every_segment_at_full_batch(small_params):
    ids, mask = ragged_prompts([5, 2, 7], 7, SMALL.vocab_size, seed=1)
    sampling = SamplingConfig(n=2, max_new_tokens=10, stop_token_ids=(2,), ignore_stop=True)
    key = jax.random.key(0)
    _, segmented, report = single_and_segmented(small_params, ids, mask, key, sampling, 2)
    np.testing.assert_array_equal(segmented.response_lengths, 10)
    # P + R = 17 slots: both segments need the single program's 17 (5 + 7 within a block).
    assert report.stages == [(6, 17)], report.stages


def test_segment_shapes_by_hand():
    sampling = SamplingConfig(max_new_tokens=504, stop_token_ids=(5,), cache_segments=4)
    assert segments.segment_ends(sampling) == (126, 252, 378, 504)
    # P = 8: P + R = 512 slots; each segment 512 less whole 64-slot blocks, >= 8 + end.
    assert segments.segment_slots(FLAT, 8, sampling) == (192, 320, 448, 512)
    short = dataclasses.replace(sampling, max_new_tokens=10, cache_segments=3)
    assert segments.segment_ends(short) == (4, 7, 10)
    # Under 64 slots, or P + R = 17 in all: every segment takes the single program's.
    assert segments.segment_slots(FLAT, 7, short) == (17, 17, 17)
    assert segments.segment_slots(
        FLAT, 7, dataclasses.replace(sampling, max_new_tokens=120)) == (127, 127, 127, 127)
    # 32 rows in 4 batch shards: 8 rows each, down to 1 (eighths); decode_buckets=3 adds
    # its own sizes (8, 6, 3 rows a shard).
    assert segments.segment_sizes(32, 4, sampling) == tuple(range(32, 0, -4))
    assert segments.segment_sizes(
        32, 4, dataclasses.replace(sampling, decode_buckets=3)) == (32, 28, 24, 20, 16, 12, 8, 4)
    assert segments.segment_sizes(
        24, 1, dataclasses.replace(sampling, decode_buckets=5)) == (
        24, 21, 20, 18, 15, 12, 10, 9, 6, 5, 3)
    assert segments.segment_sizes(
        32, 4, dataclasses.replace(sampling, ignore_stop=True)) == (32,)
    # 2 layers x (k, v) x 2 kv heads x 8 dims x 4 bytes = 256 bytes a slot.
    assert segments.cache_bytes(FLAT, 32, 512) == 32 * 512 * 256


def test_row_cache_maps_rows_by_hand():
    """3 batch rows, 2 cache rows: batch row 0 holds cache row 1, row 1 none, row 2
    cache row 0."""
    from jrl.models.cache import RowCache, inverse_rows

    # Index 0 sits at position 1, index 2 at 0; 1 and 3 nowhere (3); 5 is out of range.
    np.testing.assert_array_equal(inverse_rows(np.array([[2, 0, 5]]), 4), [[1, 3, 0, 3]])
    cache_rows = np.array([[1, 2, 0]])
    empty = np.zeros((2, 1, 4, 1), np.float32)
    cache = RowCache(k=(empty,), v=(empty,), cache_rows=cache_rows,
                     batch_rows=inverse_rows(cache_rows, 2))
    np.testing.assert_array_equal(cache.batch_rows, [[2, 0]])
    x = np.array([[10.0], [11.0], [12.0]])
    np.testing.assert_array_equal(cache.to_cache_rows(x, ("batch", None)), [[12.0], [10.0]])
    np.testing.assert_array_equal(cache.to_batch_rows(np.array([[20.0], [21.0]]),
                                                      ("batch", None)),
                                  [[21.0], [0.0], [20.0]])
    # The batch compacted to its rows 2 and 0: they keep their cache rows 0 and 1.
    compacted = cache.with_batch(np.array([[2, 0]]))
    np.testing.assert_array_equal(compacted.cache_rows, [[0, 1]])
    np.testing.assert_array_equal(compacted.batch_rows, [[0, 1]])


@pytest.mark.parametrize("value", [0, -1, 2.0, "4", True, 505])
def test_bad_cache_segments_is_named(value):
    sampling = SamplingConfig(max_new_tokens=504, cache_segments=value)
    with pytest.raises(ValueError, match=r"rollout\.cache_segments must be an integer from 1 "
                                         r"\(one program\) to max_new_tokens"):
        sampling.validate(vocab_size=32)


def test_peak_cache_is_at_most_half_when_rows_average_a_third():
    """Rows stopping at about R/3 on average: the segments' peak cache, counting both
    buffers of every move, is at most half the single program's; so is every compiled
    program's peak memory (`memory_analysis`), against the single program's."""
    params = random_params(FLAT, 0)
    ids, mask = ragged_prompts(np.random.default_rng(0).integers(1, 9, 16), 8,
                               FLAT.vocab_size, seed=1)
    single_config = SamplingConfig(n=2, max_new_tokens=504, stop_token_ids=(5,))
    segmented_config = dataclasses.replace(single_config, cache_segments=4)
    key = jax.random.key(0)
    report = segments.Report()
    segmented = segments.generate(params, ids, mask, key, segmented_config,
                                          config=FLAT, report=report)
    single = sampler.generate(params, ids, mask, key, single_config, config=FLAT)
    assert_same_rollout(single, segmented)
    lengths = np.asarray(single.response_lengths)
    assert 504 / 4 < lengths.mean() < 504 / 2.5, lengths.mean()  # about R/3
    assert report.single_cache_bytes == 32 * 512 * 256
    assert report.stages[0] == (32, 192)
    assert report.peak_cache_bytes <= report.single_cache_bytes / 2, report

    program = sampler.jit_sampler(sampler.generate_program, single_config,
                                  static_argnames=("sampling", "config"))
    single_stats = program.lower(params, ids, mask, key, sampling=single_config,
                                 config=FLAT).compile().memory_analysis()
    single_peak = segments.peak_bytes(single_stats)
    # The single program holds its whole cache: at least 32 x 512 slots.
    assert single_peak >= report.single_cache_bytes
    # Every program of the segments (prefill, decoding, moves) holds at most half that.
    peaks = {name: segments.peak_bytes(stats) for name, stats in report.programs}
    assert {"prefill", "move", "decode 32 rows (32 cached) to step 126"} <= set(peaks), peaks
    assert max(peaks.values()) <= single_peak / 2, (peaks, single_peak)


_MESH_SCRIPT = textwrap.dedent("""
    import dataclasses, json, sys
    import jax, numpy as np
    sys.path.insert(0, {repo!r})
    from tests.rollout.test_sampler import SMALL, ragged_prompts, random_params
    from jrl import sharding
    from jrl.rollout import sampler
    from jrl.rollout import segments

    assert jax.device_count() == 8, jax.devices()
    params = random_params(SMALL, 0)
    ids, mask = ragged_prompts([5, 2, 7, 1, 4, 6, 3, 7], 7, SMALL.vocab_size, seed=2)
    sharder = sharding.Sharder(sharding.make_mesh(
        sharding.MeshSettings(data=4, fsdp=1, tensor=1), jax.devices()[:4]))
    result = {{}}
    for buckets in (1, 4):
        for seed in (1, 2):
            base = sampler.SamplingConfig(n=2, max_new_tokens=248, temperature=1.2,
                                          stop_token_ids=(3,), decode_buckets=buckets)
            key = jax.random.key(seed)
            with sharder.active():
                rows = sharder.batch()
                args = (jax.device_put(params, sharder.replicated), jax.device_put(ids, rows),
                        jax.device_put(mask, rows), key)
                single = sampler.generate(*args, base, config=SMALL)
                report = segments.Report()
                out = segments.generate(
                    *args, dataclasses.replace(base, cache_segments=4), config=SMALL,
                    report=report)
            name = f"{{buckets}}/{{seed}}"
            result[name] = dict(
                devices=len(out.responses.sharding.device_set),
                differ=[f for f in ("responses", "response_mask", "response_lengths",
                                    "rollout_log_probs")
                        if not np.array_equal(getattr(out, f), getattr(single, f))],
                stage_rows=[rows for rows, _ in report.stages],
                stage_slots=[slots for _, slots in report.stages])
    print(json.dumps(result))
""")


def test_segments_on_a_4_device_mesh_match_the_single_program():
    repo = _REPO
    result = run_script(_MESH_SCRIPT.format(repo=repo))
    for name, run in result.items():
        assert run["devices"] == 4 and run["differ"] == [], (name, run)
        # Every stage keeps a whole number of rows on each of the 4 batch shards.
        assert all(rows % 4 == 0 for rows in run["stage_rows"]), (name, run)
        assert len(run["stage_rows"]) > 1 and run["stage_rows"][-1] < 16, (name, run)
        assert run["stage_slots"][0] == 127 and run["stage_slots"][-1] > 127, (name, run)


def _settings(**overrides):
    from jrl.config import settings
    from jrl.data.tokenizers import CharTokenizer
    from tests.tiny import tiny_config

    tok = CharTokenizer()
    return settings.from_config(tiny_config(**overrides), stop_token_ids=tok.eos_token_ids,
                                pad_token_id=tok.pad_token_id, num_train_rows=90)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"rollout.cache_segments": 0}, "rollout.cache_segments must be an integer from 1"),
    ({"rollout.cache_segments": 4, "rollout.response_length": 3},
     r"rollout.cache_segments must be .* \(rollout.response_length = 3\)"),
    ({"rollout.cache_segments": 2, "rollout.multi_turn.enable": True,
      "rollout.multi_turn.tool_config_path": os.path.join(
          _REPO, "configs", "tools", "calculator.yaml")},
     r"rollout.cache_segments: =2 cannot be combined with rollout.multi_turn.enable=True"),
    ({"rollout.cache_segments": 2, "reward.in_graph_fn": "exact_match"},
     r"reward.in_graph_fn: 'exact_match' scores on the device and cannot be combined with "
     r"rollout.cache_segments=2"),
])
def test_bad_cache_segments_config_is_one_config_error(overrides, message):
    from jrl.errors import ConfigError

    with pytest.raises(ConfigError, match="^" + message):
        _settings(**overrides)


def test_trainer_steps_are_the_same_with_segments(tmp_path, capsys):
    """Two tiny RL steps sample in segments (outside the trainer's jitted sampler) and log
    the single program's metrics: the same rollouts, bit for bit, so the same rewards,
    lengths, log-probs and losses. The start-up memory line names the first segment's
    cache."""
    from jrl.metrics import read_jsonl
    from jrl.train import run
    from tests.tiny import tiny_config

    assert _settings(**{"rollout.cache_segments": 3,
                        "rollout.response_length": 6}).rollout.cache_segments == 3
    records = {}
    for count in (1, 3):
        workdir = tmp_path / str(count)
        run(tiny_config(**{"rollout.cache_segments": count, "rollout.response_length": 6}),
            str(workdir))
        records[count] = read_jsonl(str(workdir / "metrics.jsonl"))
    # 8 rows x (P4 + R6) slots; every segment needs all 10 (under 64 slots).
    printed = capsys.readouterr().out
    assert "KV cache, 8 rows x 10 slots " in printed, printed
    assert ("KV cache, 8 rows x 10 slots (segment 1 of 3; then the rows still running, at "
            "most 8 x 10)") in printed, printed
    assert [r["step"] for r in records[3]] == [1, 2]
    for single, segmented in zip(records[1], records[3], strict=True):
        for key in single:
            if not key.startswith(("timing_s/", "perf/")):
                assert segmented[key] == single[key], key
