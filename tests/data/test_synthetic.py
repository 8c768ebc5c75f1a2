"""The synthetic arithmetic task: the split, the rows, carry slips in the warm-start
demonstrations."""

import pytest

from jrl.data import synthetic
from jrl.sft import demonstration


@pytest.mark.parametrize("a, b, expected", [
    (47, 38, 75),  # 7 + 8 = 15 -> 5, 4 + 3 = 7 (the carry dropped)
    (99, 1, 90),  # 9 + 1 -> 0, 9 + 0 -> 9
    (55, 55, 0),  # 5 + 5 -> 0 twice
    (12, 34, 46),  # no carry: the true sum
    (0, 0, 0),
])
def test_add_without_carry(a, b, expected):
    assert synthetic.add_without_carry(a, b) == expected


def test_slips_change_only_carrying_sums_and_keep_the_ground_truth():
    rows = [synthetic.arithmetic_row(a, "+", b, reverse=True, width=2)
            for a, b in [(47, 38), (12, 34), (99, 1)]]
    slipped = synthetic.with_carry_slips(rows, rate=1.0, seed=0)
    # 47 + 38: the slip 75 written least-significant digit first; truth 85 -> "58".
    assert demonstration(slipped[0]) == "57" and slipped[0]["reward_model"]["ground_truth"] == "58"
    # 12 + 34 has no carry: imitated as the truth.
    assert demonstration(slipped[1]) == "64"
    # 99 + 1 = 100 -> "001"; the slip 90 -> "09".
    assert demonstration(slipped[2]) == "09" and slipped[2]["reward_model"]["ground_truth"] == "001"
    assert all("demonstration" not in r["extra_info"] for r in rows)  # inputs untouched
    assert synthetic.with_carry_slips(rows, rate=0.0, seed=0) == rows


def test_slip_rate_is_the_share_of_carrying_sums():
    train, val = synthetic.arithmetic(digits=2, num_val=256, seed=0, reverse=True,
                                      carry_slip_rate=0.8)
    carrying = [r for r in train
                if synthetic.add_without_carry(r["extra_info"]["a"], r["extra_info"]["b"])
                != r["extra_info"]["a"] + r["extra_info"]["b"]]
    share = sum("demonstration" in r["extra_info"] for r in carrying) / len(carrying)
    # About 1 - 0.55**2 ~ 70% of the 9,744 training sums carry (a digit pair sums to 10
    # or more with probability 0.45); the share's binomial sd is sqrt(.16 / 6800) ~ 0.005.
    assert 0.78 < share < 0.82
    assert all("demonstration" not in r["extra_info"] for r in val)


def test_slip_rate_out_of_range_is_an_error():
    with pytest.raises(ValueError, match="data.carry_slip_rate"):
        synthetic.arithmetic(carry_slip_rate=1.5)


def test_arithmetic_split_is_disjoint_and_well_formed():
    train, val = synthetic.arithmetic(digits=2, ops="+-", num_val=50, seed=3)
    assert len(train) + len(val) == 2 * 100 * 100
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    row = next(r for r in val if r["extra_info"]["op"] == "-")
    a, b = row["extra_info"]["a"], row["extra_info"]["b"]
    assert row["prompt"] == f"{a:02d}-{b:02d}="
    assert row["reward_model"]["ground_truth"] == str(a - b)
    assert row["data_source"] == synthetic.DATA_SOURCE


def test_arithmetic_reverse_and_errors():
    assert synthetic.arithmetic_row(47, "+", 8, reverse=True, width=2)["reward_model"][
        "ground_truth"] == "55"[::-1]
    assert synthetic.arithmetic_row(3, "-", 17, reverse=True)["reward_model"][
        "ground_truth"] == "-41"
    with pytest.raises(ValueError, match="data.ops"):
        synthetic.arithmetic(ops="^")
    with pytest.raises(ValueError, match="data.num_val"):
        synthetic.arithmetic(digits=1, num_val=100)
