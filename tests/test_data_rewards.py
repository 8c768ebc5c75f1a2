"""Synthetic data, the batch iterator, prompt encoding, scoring and validation metrics."""

import numpy as np
import pytest

from jrl import metrics
from jrl.data import synthetic
from jrl.data.dataset import BatchIterator, IteratorState, encode_prompts
from jrl.data.tokenizers import CharTokenizer
from jrl.rewards import arithmetic, default_compute_score
from jrl.trainer import place_scores


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


def test_batch_iterator_resumes_exactly():
    rows = [{"i": i} for i in range(10)]
    it = BatchIterator(rows, 3, seed=1)
    seen = [tuple(r["i"] for r in it.next_batch()) for _ in range(5)]
    # Three batches per epoch (the last incomplete one dropped), reshuffled each epoch.
    assert sorted(sum(seen[:3], ())) == sorted(set(sum(seen[:3], ())))
    assert it.state == IteratorState(epoch=1, position=6)
    resumed = BatchIterator(rows, 3, seed=1, state=IteratorState(epoch=1, position=3))
    assert tuple(r["i"] for r in resumed.next_batch()) == seen[4]
    with pytest.raises(ValueError, match="train_batch_size=11"):
        BatchIterator(rows, 11, seed=0)


def test_encode_prompts_left_pads_and_names_overlong_rows():
    tok = CharTokenizer()
    rows = [{"prompt": "1+2=", "data_source": "s"}, {"prompt": "10+20=", "data_source": "s"}]
    ids, mask = encode_prompts(tok, rows, 6, apply_chat_template=False)
    np.testing.assert_array_equal(mask, [[0, 0, 1, 1, 1, 1], [1] * 6])
    assert tok.decode(ids[0][mask[0] > 0].tolist()) == "1+2="
    assert ids[0, 0] == tok.pad_token_id
    with pytest.raises(ValueError, match="row 1 .* 6 tokens.*max_prompt_length=5"):
        encode_prompts(tok, rows, 5, apply_chat_template=False)


@pytest.mark.parametrize(("response", "answer", "exact", "digits"), [
    ("124", "124", 1.0, 1.0),
    (" 124\n", "124", 1.0, 1.0),
    ("114", "124", 0.0, 2 / 3),  # tens digit wrong
    ("24", "124", 0.0, 2 / 3),  # hundreds digit missing
    ("9124", "124", 0.0, 3 / 4),  # an extra digit
    ("", "124", 0.0, 0.0),
])
def test_arithmetic_scorer(response, answer, exact, digits):
    out = default_compute_score(synthetic.DATA_SOURCE, response, answer)
    assert out == pytest.approx({"score": exact, "acc": exact, "digits": digits})
    assert arithmetic.digit_credit("12", "12") == 1.0


def test_unknown_data_source_is_named():
    with pytest.raises(NotImplementedError, match="data_source='gsm9k'"):
        default_compute_score("gsm9k", "1", "1")


def test_place_scores_at_last_valid_token():
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    out = place_scores(np.array([0.5, 1.0, 2.0]), mask)
    np.testing.assert_array_equal(out, [[0, 0, 0.5, 0], [1, 0, 0, 0], [0, 0, 0, 2]])


def test_validation_metrics_mean_best_maj():
    # Two prompts, n = 3. Prompt 0 answers "7", "7", "8" scoring 0, 0, 1; prompt 1 all "5"
    # scoring 1.
    values = {"reward": [0.1, 0.1, 1.0, 1.0, 1.0, 1.0], "acc": [0, 0, 1, 1, 1, 1]}
    out = metrics.validation_metrics(["s"] * 6, [0, 0, 0, 1, 1, 1], values,
                                     ["7", "7", "8", "5", "5", "5"], n=3)
    assert out["val-core/s/acc/mean@3"] == pytest.approx((1 / 3 + 1) / 2)
    assert out["val-core/s/acc/best@3/mean"] == 1.0
    assert out["val-core/s/acc/maj@3/mean"] == pytest.approx(0.5)
    assert out["val-aux/s/reward/mean@3"] == pytest.approx((0.4 + 1) / 2)



def test_sft_imitates_the_demonstration_when_given():
    from jrl.sft import demonstration

    row = synthetic.arithmetic_row(7, "+", 5, width=2)
    assert demonstration(row) == "12"
    row["extra_info"]["demonstration"] = "012"
    assert demonstration(row) == "012" and row["reward_model"]["ground_truth"] == "12"
