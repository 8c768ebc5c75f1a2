"""The rule scorers (arithmetic, GSM8K, MATH): hand-worked responses and ground truths."""

import pytest

from jrl.data import synthetic
from jrl.rewards import arithmetic, default_compute_score, gsm8k, math_answers

GSM = "openai/gsm8k"


@pytest.mark.parametrize(("response", "truth", "method", "expected"), [
    ("3 + 4 = 7 apples.\n#### 7", "7", "strict", 1.0),
    ("#### 1,234", "1234", "strict", 1.0),
    ("#### $12", "12", "strict", 0.0),  # "$" before the number: no "#### <number>" match
    ("first #### 5 then #### 6", "6", "strict", 1.0),  # the last marker counts
    ("first #### 5 then #### 6", "5", "strict", 0.1),  # found, wrong: format score
    ("####7", "7", "strict", 0.0),  # no space after the marks: nothing found
    ("the answer is 7", "7", "strict", 0.0),
    ("####7", "7", "flexible", 1.0),
    ("12 apples and then 15 .", "15", "flexible", 1.0),  # a lone "." is skipped
    ("The answer is 42.", "42", "flexible", 0.1),  # "42." is kept verbatim, as in verl
    ("so 1,000 in total", "1000", "flexible", 0.1),  # commas kept in flexible mode
    ("no digits here", "7", "flexible", 0.0),
    ("-3 degrees", "-3", "flexible", 1.0),
])
def test_gsm8k_extraction_and_scores(response, truth, method, expected):
    out = gsm8k.compute_score(GSM, response, truth, method=method, format_score=0.1)
    assert out == {"score": expected, "acc": float(expected == 1.0)}


def test_gsm8k_reads_only_the_last_300_characters():
    inside = "#### 8" + "x" * 294  # marker starts exactly 300 characters from the end
    outside = "#### 8" + "x" * 295
    assert gsm8k.extract_answer(inside) == "8"
    assert gsm8k.extract_answer(outside) is None
    assert gsm8k.compute_score(GSM, outside, "8") == {"score": 0.0, "acc": 0.0}


def test_gsm8k_defaults_and_dispatch():
    # Default: strict, no format credit; reached through the data_source registry.
    assert default_compute_score(GSM, "#### 5", "6") == {"score": 0.0, "acc": 0.0}
    assert default_compute_score(GSM, "#### 6", "6") == {"score": 1.0, "acc": 1.0}
    with pytest.raises(ValueError, match="'loose'.*strict"):
        gsm8k.extract_answer("1", method="loose")


@pytest.mark.parametrize(("response", "truth", "correct"), [
    (r"so \boxed{\frac{1}{2}}", "0.5", True),
    (r"\boxed{\dfrac12}", r"\frac{1}{2}", True),
    (r"\boxed{\tfrac{3}{4}}", r"\frac34", True),
    (r"\boxed{1/2}", r"\frac{1}{2}", True),
    (r"\boxed{.5}", r"\frac12", True),
    (r"\boxed{\left( 3, 4 \right)}", "(3,4)", True),
    (r"\boxed{10\text{ inches}}", "10", True),
    (r"\boxed{90^\circ}", "90", True),
    (r"\boxed{90^{\circ}}", "90", True),
    (r"\boxed{x = 5}", "5", True),
    (r"\boxed{50\%}", "50", True),
    (r"\boxed{\$5}", "5", True),
    (r"\boxed{\sqrt2}", r"\sqrt{2}", True),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}", True),
    (r"\boxed{1} at first, finally \boxed{2}", "2", True),
    (r"\boxed{1} at first, finally \boxed{2}", "1", False),
    (r"The answer is $\boxed 5$.", "5", True),
    (r"\fbox{7}", "7", True),
    (r"the answer is 5", "5", False),
    (r"\boxed{5", "5", False),  # never closed
    (r"\boxed{\frac{2}{4}}", r"\frac{1}{2}", False),  # no algebra
    (r"\boxed{5.}", "5", False),  # a trailing period is not removed
    (r"\boxed{03/4}", r"\frac{3}{4}", False),  # only canonical integers form a fraction
    (r"\boxed{\text{ a}\text{ b}}", r"\text{ a}\text{ b}", True),  # compared verbatim
    (r"\boxed{\text{ a}\text{ b}}", r"\text{ a}", False),
])
def test_math_scores(response, truth, correct):
    for source in math_answers.DATA_SOURCES:
        out = default_compute_score(source, response, truth)
        assert out == {"score": float(correct), "acc": float(correct)}


@pytest.mark.parametrize(("answer", "normal"), [
    (r"\left(1, 2\right)", "(1,2)"),
    (r"\frac1{72}", r"\frac{1}{72}"),
    (r"\frac{72}1", r"\frac{72}1"),
    ("k = 3", "3"),
    ("xyz = 3", "xyz=3"),  # a left-hand side of three characters stays
    ("3\n.5", "3.5"),
    (r"a \! b", "ab"),
    ("0.5", r"\frac{1}{2}"),
    ("-3/4", r"\frac{-3}{4}"),
    ("", ""),
])
def test_math_normalization(answer, normal):
    assert math_answers.normalize_answer(answer) == normal


def test_math_last_boxed():
    assert math_answers.last_boxed(r"x \boxed{a{b}c} y") == "a{b}c"
    assert math_answers.last_boxed(r"\boxed{1} and \fbox{2}") == "1"  # \boxed wins over \fbox
    assert math_answers.last_boxed(r"\boxed\frac12") is None
    assert math_answers.last_boxed("nothing") is None
    with pytest.raises(math_answers.UnparsableAnswer):
        math_answers.normalize_answer("2\\sqrt")


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
