"""The supervised warm start: what it imitates."""


from jrl.data import synthetic


def test_sft_imitates_the_demonstration_when_given():
    from jrl.sft import demonstration

    row = synthetic.arithmetic_row(7, "+", 5, width=2)
    assert demonstration(row) == "12"
    row["extra_info"]["demonstration"] = "012"
    assert demonstration(row) == "012" and row["reward_model"]["ground_truth"] == "12"
