"""Partial rollouts (rollout.partial): the rounds' bookkeeping against a scripted
sampler, and runs of the tiny config."""

import math

import jax
import numpy as np
import pytest

from jrl.data.dataset import BatchIterator, encode_prompts
from jrl.errors import ConfigError
from jrl.metrics import read_jsonl
from jrl.rl import partial
from jrl.rollout.sampler import RolloutOutput
from jrl.train import run
from tests.tiny import tiny_config, tiny_trainer

N = 2  # tiny_config's rollout.n
BATCH = 4  # its data.train_batch_size (prompts)
STEPS = 3


# Each round's cache handed to the step's next round (partial_keep_cache); or the rounds
# on the paged cache, four decode slots refilled from the rows that wait.
CACHES = {"keep": {"rollout.partial_keep_cache": True},
          "paged": {"rollout.kv_cache": "paged", "rollout.max_num_seqs": 4,
                    "rollout.page_size": 2}}


@pytest.mark.parametrize("cache", list(CACHES))
def test_rows_carry_across_steps_and_groups_train_whole(tmp_path, cache):
    calls = []

    def reward_fn(data_source, solution_str, ground_truth, extra_info):
        calls.append((extra_info["a"], extra_info["b"], solution_str))
        return 0.5 * (len(calls) % 2)

    config = tiny_config(**{"rollout.partial": True, "rollout.partial_max_tokens": 1,
                            "trainer.total_training_steps": STEPS, **CACHES[cache]})
    run(config, str(tmp_path), reward_fn=reward_fn)
    records = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # Each step scores exactly its batch: BATCH groups, the n samples of a group one
    # after another on the same prompt.
    assert len(calls) == STEPS * BATCH * N
    for i in range(0, len(calls), N):
        assert len({c[:2] for c in calls[i:i + N]}) == 1, calls[i:i + N]
    for step, record in enumerate(records, start=1):
        assert all(math.isfinite(v) for v in record.values()), record
        # A round draws one token a row: a row of up to 3 tokens takes up to 3 rounds,
        # and the first step starts every row (at least one round each).
        assert record["rollout/partial_rounds"] >= (1 if step > 1 else 2), record
        assert 0 <= record["rollout/partial_in_flight_rows"] <= BATCH * N
        assert 0 <= record["rollout/partial_staleness/max"] <= step - 1
        assert record["rollout/partial_staleness/mean"] <= record[
            "rollout/partial_staleness/max"]
    assert records[0]["rollout/partial_staleness/max"] == 0
    assert "training/rollout_probs_diff_mean" in records[-1]
    # The paged cache's metrics, over each step's rounds: pages held, as a share of the
    # pool (every decode slot's at full length, the default), and preemptions (none).
    paged = [(r["rollout/page_usage"], r["rollout/preemptions"]) for r in records
             if "rollout/page_usage" in r]
    assert len(paged) == (STEPS if cache == "paged" else 0)
    assert all(0 < usage <= 1 and preempted == 0 for usage, preempted in paged), paged


R, BUDGET = 8, 3  # response length and tokens a round in the scripted test


def _script(prompt_ids):
    """A prompt's scripted samples: their length (1..R) and token i = (s + i) % 50 + 1."""
    total = int(np.sum(prompt_ids))
    return 1 + total % R, (total + np.arange(R)) % 50 + 1


def _simulate(stops, steps):
    """Per step, by hand: (rounds, trained groups, their first steps, rows in flight,
    groups waiting) for groups (draw order) whose samples stop at `stops[g]`, BUDGET
    tokens a round, BATCH x N decode rows filled in order."""
    slots, length, began, done = [None] * (BATCH * N), {}, {}, {}
    complete, out, next_group = [], [], 0
    for step in range(steps):
        rounds = 0
        while len(complete) < BATCH:
            free = [i for i, s in enumerate(slots) if s is None]
            for j in range(len(free) // N):
                for m in range(N):
                    slots[free[j * N + m]] = (next_group, m)
                    length[next_group, m] = 0
                began[next_group], done[next_group] = step, 0
                next_group += 1
            for i, s in enumerate(slots):
                if s is None:
                    continue
                length[s] = min(stops[s[0]], length[s] + BUDGET)
                if length[s] == stops[s[0]]:
                    slots[i], done[s[0]] = None, done[s[0]] + 1
                    if done[s[0]] == N:
                        complete.append(s[0])
            rounds += 1
        trained, complete = complete[:BATCH], complete[BATCH:]
        out.append((rounds, trained, [began[g] for g in trained],
                    sum(s is not None for s in slots), len(complete)))
    return out


def test_rounds_refill_free_rows_and_carry_running_ones_across_steps(tmp_path):
    """Against a scripted sampler (the rows of a prompt stop at its scripted length,
    drawing at most BUDGET tokens a round): each step trains the first BATCH groups to
    complete, whole, each sample with its scripted tokens however its rounds fell across
    steps; prompts enter in the iterator's order; rounds, rows in flight, groups
    waiting and staleness are a hand simulation's."""
    trainer = tiny_trainer(tmp_path, {"rollout.partial": True, "rollout.partial_max_tokens":
                                      BUDGET, "rollout.response_length": R})
    source, rollouts = trainer.experience, trainer.rollouts
    assert isinstance(source, partial.PartialExperience)

    keys = {}  # (prompt, tokens so far) -> the row's key data, per live row and round

    def continuer(state, prompt_ids, prompt_mask, prefix, frozen, carried):
        ids, lengths = np.asarray(prompt_ids), np.asarray(prefix.lengths)
        finished = np.asarray(prefix.finished)
        for r in np.flatnonzero(~finished):
            keys.setdefault(ids[r].tobytes(), []).append(
                (int(lengths[r]), tuple(np.asarray(prefix.keys)[r].ravel())))
        responses = np.zeros((len(ids), R), np.int32)
        responses[:, :prefix.responses.shape[1]] = np.asarray(prefix.responses)
        new, stops = lengths.copy(), np.array([_script(i)[0] for i in ids])
        for r in np.flatnonzero(~finished):
            tokens = _script(ids[r])[1]
            new[r] = min(stops[r], lengths[r] + BUDGET)
            responses[r, lengths[r]:new[r]] = tokens[lengths[r]:new[r]]
        columns = np.arange(R)[None, :] < new[:, None]
        return RolloutOutput(ids, np.asarray(prompt_mask), responses, columns.astype(np.int32),
                             np.where(columns, -0.5, 0.0).astype(np.float32), new,
                             finished=finished | (new == stops))

    trainer.programs.continuer = lambda sampling, max_steps, keep_cache: continuer
    order = BatchIterator(trainer.train_rows, BATCH, seed=0)
    drawn = [row for _ in range(12) for row in order.next_batch()]
    ids = encode_prompts(rollouts.tokenizer, drawn, trainer.settings.max_prompt_length,
                         rollouts.chat, rollouts.turns.prompt_schemas)[0]
    steps = 5
    expected = _simulate([_script(i)[0] for i in ids], steps)
    # The script exercises the rounds: rows carried into later steps, groups waiting.
    assert max(e[0] for e in expected) >= 3 and any(min(e[2]) < s for s, e in
                                                    enumerate(expected)), expected
    assert any(e[4] for e in expected), expected

    iterator = BatchIterator(trainer.train_rows, BATCH, seed=0)
    for step, (rounds, groups, began, in_flight, waiting) in enumerate(expected):
        sampled = source.next(None, iterator, jax.random.key(step), step=step,
                              timer=lambda name, fn, *args: fn(*args))
        assert sampled.rows == [drawn[g] for g in groups]
        rollout = jax.tree.map(np.asarray, sampled.rollout)
        for r in range(BATCH * N):
            stop, tokens = _script(rollout.prompt_ids[r])
            assert rollout.response_mask[r].sum() == stop
            np.testing.assert_array_equal(rollout.responses[r, :stop], tokens[:stop])
            np.testing.assert_array_equal(rollout.rollout_log_probs[r, :stop], -0.5)
            np.testing.assert_array_equal(rollout.prompt_ids[r], ids[groups[r // N]])
        lag = step - np.repeat(began, N)
        # A row keeps its key from its first round to its last; rows' keys differ.
        for prompt in map(np.ndarray.tobytes, ids[groups]):
            seen = keys[prompt]
            assert len({k for _, k in seen}) == N, seen  # one key a sample, N samples
            assert sorted(n for n, _ in seen)[:N] == [0] * N  # each began at 0
        assert sampled.metrics == {
            "rollout/partial_rounds": rounds, "rollout/partial_in_flight_rows": in_flight,
            "rollout/partial_waiting_groups": waiting,
            "rollout/partial_continued_fraction": pytest.approx(np.mean(lag > 0)),
            "rollout/partial_staleness/mean": pytest.approx(np.mean(lag)),
            "rollout/partial_staleness/max": np.max(lag)}
    every = [k for seen in keys.values() for _, k in seen]
    assert len(set(every)) == N * len(keys)  # no two samples share a key


@pytest.mark.parametrize("overrides, match", [
    ({"rollout.partial_max_tokens": 3}, r"^rollout.partial_max_tokens: must be an integer "
     r"from 1 to rollout.response_length - 1 = 2 .*got 3$"),
    ({"rollout.partial_max_tokens": 0}, r"^rollout.partial_max_tokens: must be an integer"),
    ({"rollout.partial_max_tokens": None}, r"^rollout.partial_max_tokens: must be set with "
     r"rollout.partial=True"),
    ({"rollout.cache_segments": 3}, r"^rollout.partial: =True is not supported with "
     r"rollout.cache_segments=3"),
    ({"algorithm.filter_groups.enable": True}, r"^rollout.partial: =True is not supported "
     r"with algorithm.filter_groups.enable=True"),
    ({"reward.in_graph_fn": "exact_match"}, r"^reward.in_graph_fn: .*rollout.partial"),
    ({"rollout.partial": False, "rollout.partial_keep_cache": True},
     r"^rollout.partial_keep_cache: =True needs rollout.partial=True"),
    ({"rollout.partial_keep_cache": True, "mesh.tensor": 2},
     r"^rollout.partial_keep_cache: =True is not supported with mesh.tensor=2"),
    ({"rollout.partial_keep_cache": True, "model.preset": "tiny-gemma"},
     r"^rollout.partial_keep_cache: =True is not supported for models with sliding-window "
     r"layers"),
])
def test_bad_partial_settings_stop_before_compiling(tmp_path, overrides, match):
    config = tiny_config(**{"rollout.partial": True, "rollout.partial_max_tokens": 2,
                            **overrides})
    with pytest.raises(ConfigError, match=match):
        run(config, str(tmp_path))
