"""DAPO dynamic sampling: group filter, accumulation across rounds, the round limit."""

import numpy as np
import pytest

from jrl.data.dynamic_sampling import GroupAccumulator, check_gen_batches, groups_with_variance


def test_groups_with_variance_golden():
    metric = np.array([1, 1, 0, 1, 0, 0, 0.5, 0.5, 0.1, 0.1 + 1e-9])
    np.testing.assert_array_equal(groups_with_variance(metric, 2), [False, True, False, False,
                                                                    True])
    np.testing.assert_array_equal(groups_with_variance(np.array([0.0, 0, 0, 1, 1, 1]), 3),
                                  [False, False])
    # Equal values drop a group even where a float std is not exactly 0 (std of three
    # 0.1s is 1.4e-17, which a `std > 0` test would keep).
    np.testing.assert_array_equal(groups_with_variance(np.full(3, 0.1), 3), [False])
    # Groups of one are always kept (verl keeps them too).
    np.testing.assert_array_equal(groups_with_variance(np.array([1.0, 1.0]), 1), [True, True])
    with pytest.raises(ValueError, match=r"shape \(5,\) .* n=2"):
        groups_with_variance(np.zeros(5), 2)


def _round(start_group, num_groups, n):
    """Arrays and rows of one generation round; group g's samples carry the value g."""
    groups = np.arange(start_group, start_group + num_groups)
    arrays = {"group": np.repeat(groups, n),
              "tokens": np.repeat(groups, n)[:, None] * np.ones((1, 3), np.int32)}
    rows = [{"id": int(g)} for g in groups]
    return arrays, rows


def test_accumulator_keeps_first_groups_in_order():
    acc = GroupAccumulator(target_groups=4, n=2)
    arrays, rows = _round(0, 4, 2)
    acc.add(arrays, rows, np.array([True, False, False, True]))  # groups 0, 3
    assert acc.num_groups == 2 and not acc.is_full
    arrays, rows = _round(10, 4, 2)
    acc.add(arrays, rows, np.array([True, True, False, True]))  # groups 10, 11, 13
    assert acc.is_full
    batch = acc.take()
    assert [r["id"] for r in batch.rows] == [0, 3, 10, 11]
    np.testing.assert_array_equal(batch.arrays["group"], [0, 0, 3, 3, 10, 10, 11, 11])
    assert batch.arrays["tokens"].shape == (8, 3)
    np.testing.assert_array_equal(batch.arrays["tokens"][:, 0], [0, 0, 3, 3, 10, 10, 11, 11])
    assert (batch.num_gen_batches, batch.num_filtered_groups, batch.num_surplus_groups) == (2, 3, 1)
    # take() starts the next step afresh.
    assert acc.num_groups == 0 and acc.num_gen_batches == 0 and acc.num_filtered_groups == 0


def test_accumulator_errors():
    acc = GroupAccumulator(target_groups=2, n=2)
    arrays, rows = _round(0, 2, 2)
    with pytest.raises(ValueError, match=r"keep must be bool \[2\]"):
        acc.add(arrays, rows, np.array([1, 1]))
    with pytest.raises(ValueError, match=r"array 'tokens' has shape \(3, 3\).*2 rows \* n=2"):
        acc.add({**arrays, "tokens": np.zeros((3, 3))}, rows, np.array([True, False]))
    acc.add(arrays, rows, np.array([True, False]))
    with pytest.raises(ValueError, match=r"\['group'\] differ .*\['group', 'tokens'\]"):
        acc.add({"group": arrays["group"]}, rows, np.array([True, True]))
    with pytest.raises(RuntimeError, match="only 1 of 2 groups"):
        acc.take()
    with pytest.raises(ValueError, match="target_groups=0"):
        GroupAccumulator(0, 2)


def test_check_gen_batches():
    check_gen_batches(3, 3, num_groups=4, target_groups=4, n=2)  # full: fine
    check_gen_batches(9, 0, num_groups=1, target_groups=4, n=2)  # no limit
    check_gen_batches(2, 3, num_groups=1, target_groups=4, n=2)  # rounds left
    with pytest.raises(RuntimeError) as err:
        check_gen_batches(3, 3, num_groups=1, target_groups=4, n=2)
    message = str(err.value)
    for part in ("collected 1 of the 4 prompt groups", "in 3 generation batches",
                 "algorithm.filter_groups.max_num_gen_batches=3", "data.gen_batch_size",
                 "rollout.n=2", "data.train_batch_size"):
        assert part in message
