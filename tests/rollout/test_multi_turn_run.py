"""The tool task around multi-turn rollouts: its data, its scorer, the warm start's
encoding of multi-turn demonstrations, the `rollout.multi_turn.*` settings, and a tiny
RL run with the calculator (and its resume)."""

import itertools
import math
import os
import re

import chex
import jax
import numpy as np
import pytest

from jrl import tools as tools_lib
from jrl.config import settings
from jrl.data import synthetic
from jrl.data.tokenizers import CHAR_ALPHABET, CharTokenizer
from jrl.errors import ConfigError
from jrl.metrics import read_jsonl
from jrl.models import ModelConfig, init_params
from jrl.rewards import tool_arithmetic
from jrl.rl import logprobs
from jrl.sft import encode_examples, sft_loss
from jrl.train import run
from tests.tiny import apply_overrides, tiny_config

CHAR = CharTokenizer()
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CALCULATOR_YAML = os.path.join(REPO, "configs", "tools", "calculator.yaml")


def _call(expression):
    """The hermes calculator call, written out by hand."""
    return ('<tool_call>{"name":"calculator","arguments":{"expression":"' + expression
            + '"}}</tool_call>')


def _char_ids(text):
    """The char tokenizer's ids by hand: pad, bos, eos are 0, 1, 2, then the alphabet."""
    return [3 + CHAR_ALPHABET.index(ch) for ch in text]


# ----------------------------------------------------------------------- synthetic data

def test_calculator_call_is_the_hermes_markup():
    assert synthetic.calculator_call("123*456") == _call("123*456")
    assert synthetic.calculator_call("123*456") == (
        '<tool_call>{"name":"calculator","arguments":{"expression":"123*456"}}</tool_call>')


def test_tool_multiplication_rows():
    train, val = synthetic.tool_multiplication(digits=3, num_val=256, num_train=4096, seed=0,
                                               tool_rate=0.3)
    assert len(train) == 4096 and len(val) == 256
    pairs = lambda rows: [(r["extra_info"]["a"], r["extra_info"]["b"]) for r in rows]
    train_pairs, val_pairs = pairs(train), pairs(val)
    assert len(set(train_pairs)) == 4096 and len(set(val_pairs)) == 256
    assert not set(train_pairs) & set(val_pairs)
    with_tool = 0
    for row in train + val:
        a, b = row["extra_info"]["a"], row["extra_info"]["b"]
        assert 100 <= a <= 999 and 100 <= b <= 999
        assert row["prompt"] == [{"role": "user", "content": f"{a}*{b}"}]
        assert row["data_source"] == "synthetic/tool_multiplication"
        product = a * b
        assert row["reward_model"]["ground_truth"] == str(product)
        # verl's place for a tool's per-row state, as its GSM8K rows give their answer.
        assert row["extra_info"]["tools_kwargs"] == {
            "calculator": {"create_kwargs": {"ground_truth": str(product)}}}
        shown = row["extra_info"]["demonstration"]
        if len(shown) == 3:
            with_tool += 1
            assert shown == [{"role": "assistant", "content": _call(f"{a}*{b}")},
                             {"role": "tool", "content": str(product)},
                             {"role": "assistant", "content": str(product)}]
        else:
            [message] = shown
            assert message["role"] == "assistant"
            match = re.fullmatch(r"The answer is ([1-9]\d*)\.", message["content"])
            assert match, message
            assert len(match.group(1)) == len(str(product))
    # Every tool demonstration is a training row; the held-out rows only guess.
    assert all(len(r["extra_info"]["demonstration"]) == 1 for r in val)
    assert abs(with_tool / 4096 - 0.3) <= 0.03


def test_tool_multiplication_ground_truth_by_hand():
    by_hand = {(12, 34): "408", (99, 99): "9801", (10, 10): "100", (25, 40): "1000",
               (87, 65): "5655"}
    train, val = synthetic.tool_multiplication(digits=2, num_val=1000, num_train=7100,
                                               seed=3, tool_rate=0.5)
    assert len(train) + len(val) == 90 * 90  # every two-digit pair, once
    truth = {(r["extra_info"]["a"], r["extra_info"]["b"]): r["reward_model"]["ground_truth"]
             for r in train + val}
    for pair, product in by_hand.items():
        assert truth[pair] == product


@pytest.mark.parametrize("rate", [0.0, 0.25, 1.0])
def test_tool_share_follows_tool_rate(rate):
    train, val = synthetic.tool_multiplication(digits=3, num_val=64, num_train=4096, seed=1,
                                               tool_rate=rate)
    share = np.mean([len(r["extra_info"]["demonstration"]) == 3 for r in train])
    assert abs(share - rate) <= 0.03
    assert not any(len(r["extra_info"]["demonstration"]) == 3 for r in val)


def test_tool_multiplication_is_seeded():
    a = synthetic.tool_multiplication(digits=2, num_val=8, num_train=32, seed=5)
    assert a == synthetic.tool_multiplication(digits=2, num_val=8, num_train=32, seed=5)
    assert a != synthetic.tool_multiplication(digits=2, num_val=8, num_train=32, seed=6)


@pytest.mark.parametrize("rate", [-0.1, 1.5])
def test_bad_tool_rate(rate):
    with pytest.raises(ConfigError, match=r"data\.tool_rate"):
        synthetic.tool_multiplication(digits=2, num_val=4, num_train=4, tool_rate=rate)


def test_too_many_problems():
    with pytest.raises(ConfigError, match=r"data\.num_val \+ data\.num_train = 82 exceeds the 81"):
        synthetic.tool_multiplication(digits=1, num_val=2, num_train=80)


# ----------------------------------------------------------------------------- scorer

def _score(response, truth="56088"):
    return tool_arithmetic.compute_score(synthetic.TOOL_DATA_SOURCE, response, truth)


def test_score_of_a_two_turn_answer():
    call = _call("123*456")
    assert _score(call + "\nTool: 56088\nAssistant: 56088\n") == {
        "score": 1.0, "acc": 1.0, "tool_used": 1.0}
    # The calculator's output is right but the last turn is not: no credit.
    assert _score(call + "\nTool: 56088\nAssistant: 56089\n") == {
        "score": 0.0, "acc": 0.0, "tool_used": 1.0}
    # A response cut before the last turn says nothing.
    assert _score(call + "\nTool: 56088\nAssistant: ")["score"] == 0.0


def test_score_of_a_direct_answer():
    assert _score("The answer is 56088.") == {"score": 1.0, "acc": 1.0, "tool_used": 0.0}
    assert _score("The answer is 56080.")["score"] == 0.0
    assert _score("") == {"score": 0.0, "acc": 0.0, "tool_used": 0.0}
    assert _score("The answer is 56088.", truth=" 56088\n")["score"] == 1.0


def test_the_tool_task_is_scored_by_default():
    from jrl.rewards import default_compute_score

    assert default_compute_score(synthetic.TOOL_DATA_SOURCE, "The answer is 408.",
                                 "408")["score"] == 1.0


# ------------------------------------------------------------------- SFT encoding / loss

def _row(demonstration, a=12, b=34):
    return {"prompt": [{"role": "user", "content": f"{a}*{b}"}],
            "data_source": synthetic.TOOL_DATA_SOURCE,
            "reward_model": {"ground_truth": str(a * b), "style": "rule"},
            "extra_info": {"a": a, "b": b, "demonstration": demonstration}}


_TOOL_DEMO = [{"role": "assistant", "content": _call("12*34")},
              {"role": "tool", "content": "408"},
              {"role": "assistant", "content": "408"}]


def test_encode_multi_turn_demonstration():
    rows = [_row(_TOOL_DEMO), _row("The answer is 407.")]
    prompt_ids, prompt_mask, responses, response_mask, attention = encode_examples(
        CHAR, rows, 24, 128, apply_chat_template=True)
    prompt = _char_ids("User: 12*34\nAssistant: ")  # 23 characters
    assert prompt_ids.shape == (2, 24) and responses.shape == (2, 128)
    for i in range(2):
        assert prompt_ids[i].tolist() == [0] + prompt
        assert prompt_mask[i].tolist() == [0] + [1] * 23

    call = _char_ids(_call("12*34") + "\n")  # the turn and its end-of-turn newline
    block = _char_ids("Tool: 408\nAssistant: ")  # context only
    answer = _char_ids("408\n")
    assert len(call) == 80 and len(block) == 21 and len(answer) == 4
    length = 80 + 21 + 4
    assert responses[0, :length].tolist() == call + block + answer
    assert (responses[0, length:] == 0).all()
    assert response_mask[0].tolist() == [1] * 80 + [0] * 21 + [1] * 4 + [0] * (128 - length)
    assert attention[0].tolist() == [1] * length + [0] * (128 - length)

    plain = _char_ids("The answer is 407.") + [2]  # answer + eos
    assert responses[1, :19].tolist() == plain and (responses[1, 19:] == 0).all()
    assert response_mask[1].tolist() == attention[1].tolist() == [1] * 19 + [0] * 109


def test_encode_names_a_too_long_demonstration():
    rows = [_row("The answer is 407."), _row(_TOOL_DEMO)]
    with pytest.raises(ConfigError, match=r"training row 2 \(its demonstration and the end "
                                          r"token\) needs 105 tokens, more than "
                                          r"rollout\.response_length=104; set "
                                          r"--config\.rollout\.response_length=105 or more"):
        encode_examples(CHAR, rows, 24, 104, apply_chat_template=True)
    encode_examples(CHAR, rows, 24, 105, apply_chat_template=True)  # fits exactly


def test_sft_loss_trains_only_the_assistant_turns():
    model = ModelConfig.preset("tiny", vocab_size=CHAR.vocab_size, hidden_size=32,
                               intermediate_size=64, num_layers=1, head_dim=8)
    params = init_params(model, jax.random.key(0))
    demo_2 = [{"role": "assistant", "content": _call("56*78")},
              {"role": "tool", "content": "4368"},
              {"role": "assistant", "content": "4368"}]
    rows = [_row(_TOOL_DEMO), _row("The answer is 407."), _row(demo_2, 56, 78)]
    keys = ("prompt_ids", "prompt_mask", "responses", "response_mask", "attention_mask")
    batch = dict(zip(keys, encode_examples(CHAR, rows, 24, 112, apply_chat_template=True),
                     strict=True))
    loss = float(jax.jit(sft_loss, static_argnames="model")(params, batch, model=model))
    response_log_probs = jax.jit(lambda context: logprobs.response_log_probs(
        params, batch["prompt_ids"], batch["prompt_mask"], batch["responses"], context,
        config=model)[0])

    def nll(context, counted):
        lp = np.asarray(response_log_probs(context), np.float64)
        return -lp[counted > 0].mean()

    assert loss == pytest.approx(nll(batch["attention_mask"], batch["response_mask"]),
                                 rel=1e-5)
    # The tool blocks are context: without them the answers' log-probs differ.
    assert abs(loss - nll(batch["response_mask"], batch["response_mask"])) > 1e-4
    # Counting the tool tokens in the loss would give another value.
    assert abs(loss - nll(batch["attention_mask"], batch["attention_mask"])) > 1e-4


# ----------------------------------------------------------------------------- settings

def _settings(**overrides):
    return settings.from_config(tiny_config(**overrides), stop_token_ids=CHAR.eos_token_ids,
                                pad_token_id=CHAR.pad_token_id, num_train_rows=90)


_ON = {"rollout.multi_turn.enable": True,
       "rollout.multi_turn.tool_config_path": CALCULATOR_YAML}


def test_multi_turn_settings():
    s = _settings(**_ON, **{"rollout.multi_turn.turn_stop_ids": (4, 9),
                            "rollout.multi_turn.max_assistant_turns": 2,
                            "rollout.multi_turn.format": "llama3"})
    assert s.multi_turn.tool_config_path == CALCULATOR_YAML
    mt = s.multi_turn.config
    assert (mt.turn_stop_ids, mt.max_assistant_turns, mt.max_user_turns, mt.format) == (
        (4, 9), 2, 4, "llama3")
    assert (mt.max_tool_response_tokens, mt.max_tool_response_length,
            mt.tool_response_truncate_side, mt.tool_timeout_s, mt.max_parallel_calls) == (
        64, 256, "middle", 5.0, 16)
    assert _settings().multi_turn is None
    assert s.multi_turn.add_tool_rewards is False  # verl's: the reward function decides
    assert _settings(**_ON, **{"rollout.multi_turn.add_tool_rewards": True}
                     ).multi_turn.add_tool_rewards is True


def test_multi_turn_off_checks_nothing(tmp_path):
    s = _settings(**{"rollout.multi_turn.tool_config_path": str(tmp_path / "missing.yaml"),
                     "rollout.multi_turn.format": "xml",
                     "rollout.multi_turn.max_assistant_turns": 0,
                     "rollout.multi_turn.turn_stop_ids": (-1,)})
    assert s.multi_turn is None


def _error(**overrides):
    with pytest.raises(ConfigError) as err:
        _settings(**{**_ON, **overrides})
    return str(err.value)


def test_multi_turn_settings_errors(tmp_path):
    message = _error(**{"rollout.multi_turn.tool_config_path": None})
    assert message.startswith("rollout.multi_turn.tool_config_path: is needed")
    missing = str(tmp_path / "missing.yaml")
    assert _error(**{"rollout.multi_turn.tool_config_path": missing}) == (
        f"rollout.multi_turn.tool_config_path: {missing!r} is not a file")
    assert _error(**{"rollout.multi_turn.tool_config_path": str(tmp_path)}) == (
        f"rollout.multi_turn.tool_config_path: {str(tmp_path)!r} is not a file")
    assert _error(**{"rollout.multi_turn.format": "xml"}) == (
        "rollout.multi_turn.format: 'xml' is not valid; choose one of ['hermes', 'llama3']")
    assert _error(**{"rollout.multi_turn.tool_response_truncate_side": "top"}) == (
        "rollout.multi_turn.tool_response_truncate_side: 'top' is not valid; choose one of "
        "['left', 'right', 'middle']")
    assert _error(**{"rollout.multi_turn.turn_stop_ids": (-1,)}).startswith(
        "rollout.multi_turn.turn_stop_ids: must be token ids")
    assert _error(**{"rollout.multi_turn.tool_timeout_s": 0.0}).startswith(
        "rollout.multi_turn.tool_timeout_s: must be a positive number")
    for fraction in (0.0, 1.5, -0.5):
        assert _error(**{"rollout.multi_turn.segment_end_fraction": fraction}) == (
            f"rollout.multi_turn.segment_end_fraction: must be in (0, 1], got {fraction!r}")
    assert _settings(**_ON, **{"rollout.multi_turn.segment_end_fraction": 1}
                     ).multi_turn.config.segment_end_fraction == 1.0


def test_a_bad_tool_class_stops_before_the_warm_start(tmp_path, monkeypatch):
    """The tool config is loaded and checked with the settings: a misspelled class stops the
    run before any model is built, SFT warm start or not."""
    from jrl import sft
    from jrl.app import experiment

    def refuse(*args, **kwargs):
        raise AssertionError("the tool config was not checked before the model was built")

    monkeypatch.setattr(experiment, "build_model", refuse)
    monkeypatch.setattr(sft, "warm_start", refuse)
    tools_yaml = tmp_path / "tools.yaml"
    tools_yaml.write_text("tools:\n  - class_name: jrl.tools.Calculater\n")
    config = tiny_config(**{**_ON, "rollout.multi_turn.tool_config_path": str(tools_yaml),
                            "sft.steps": 5})
    with pytest.raises(ConfigError) as err:
        run(config, str(tmp_path / "run"))
    assert str(err.value).startswith(
        f"rollout.multi_turn.tool_config_path: tool config {tools_yaml}: tools[0]: class_name "
        "'jrl.tools.Calculater' cannot be imported: AttributeError")


@pytest.mark.parametrize("name", ["max_assistant_turns", "max_user_turns", "max_parallel_calls",
                                  "max_tool_response_length", "max_tool_response_tokens"])
def test_multi_turn_counts_must_be_positive(name):
    assert _error(**{f"rollout.multi_turn.{name}": 0}) == (
        f"rollout.multi_turn.{name}: must be a positive number, got 0")


# ------------------------------------------------------------------------- a tiny run

_VOLATILE = ("timing_s/", "perf/", "multi_turn/tool_latency_s/")
_NEWLINE = 3 + CHAR_ALPHABET.index("\n")


def _tool_config(**overrides):
    return tiny_config(**{
        "data.task": "tool_multiplication", "data.digits": 2, "data.num_train": 64,
        "data.apply_chat_template": True, "data.max_prompt_length": 24,
        "data.tool_rate": 1.0,
        # The call (80 tokens with its newline), the tool block (21) and the answer (5).
        "rollout.response_length": 112,
        "rollout.multi_turn.max_assistant_turns": 2, "rollout.multi_turn.max_user_turns": 1,
        "rollout.multi_turn.max_tool_response_tokens": 32,
        "rollout.multi_turn.turn_stop_ids": (_NEWLINE,),
        "sft.steps": 30, "sft.batch_size": 16, "sft.lr": 1e-2,
        "algorithm.adv_estimator": "grpo", **_ON, **overrides})


@pytest.fixture
def calls(monkeypatch):
    """30 warm-start steps do not teach the tiny model to write a well-formed call, so a
    first turn without one is read as the call `6*7` (real calls are parsed as usual):
    every row that ends its first turn runs the calculator. Returns the calculator's
    answers, as they are given."""
    parse = tools_lib.parse_tool_calls
    answers = []

    def parse_or_call(text, fmt):
        calls, errors = parse(text, fmt)
        if not calls and not errors:
            calls = [tools_lib.ToolCall("calculator", {"expression": "6*7"})]
        return calls, errors

    execute = tools_lib.Calculator.execute

    def recorded(self, instance_id, arguments):
        out = execute(self, instance_id, arguments)
        answers.append((arguments["expression"], out[0]))
        return out

    monkeypatch.setattr(tools_lib, "parse_tool_calls", parse_or_call)
    monkeypatch.setattr(tools_lib.Calculator, "execute", recorded)
    return answers


def _metrics(workdir):
    return [{k: v for k, v in r.items() if not k.startswith(_VOLATILE)}
            for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))]


def test_tiny_run_with_the_calculator(tmp_path, calls, capsys):
    """Two steps, validation after the second; the samples of each step and of the
    validation are written as verl writes them, and the validation's first two printed
    (`trainer.log_val_generations`)."""
    rollouts, validations = tmp_path / "rollouts", tmp_path / "validations"
    run(_tool_config(**{"trainer.test_freq": 2, "trainer.rollout_data_dir": str(rollouts),
                        "trainer.validation_data_dir": str(validations),
                        "trainer.log_val_generations": 2}), str(tmp_path))
    printed = capsys.readouterr().out
    assert printed.count("step 2: validation sample ") == 2, printed
    assert "step 2: validation sample 2 of 8, score " in printed
    records = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2]
    outputs = _check_samples(rollouts, [1, 2], rows=4 * 2)  # train_batch_size x rollout.n
    _check_samples(validations, [2], rows=8)  # data.num_val, one greedy sample each
    # A multi-turn output is the whole response: turns and the tool blocks between them.
    assert any("\nTool: 42\nAssistant: " in output for output in outputs)
    # Validation reports the multi-turn metrics training logs, under val-aux/.
    val = records[-1]
    for key in ("num_turns/mean", "num_turns/max", "multi_turn/tool_calls/total",
                "multi_turn/tool_calls/mean", "multi_turn/segments"):
        assert f"val-aux/{key}" in val, key
    assert 1 <= val["val-aux/num_turns/mean"] <= val["val-aux/num_turns/max"] <= 3
    assert val["val-aux/multi_turn/tool_calls/total"] == pytest.approx(
        8 * val["val-aux/multi_turn/tool_calls/mean"])
    for r in records:
        assert all(math.isfinite(v) for k, v in r.items() if k != "step"), r
        assert {"num_turns/mean", "num_turns/max", "multi_turn/tool_calls/total",
                "multi_turn/segments", "actor/pg_loss", "reward_extra/tool_used/mean"} <= set(r)
        # At most: turn, tool answer, turn (max_user_turns=1, max_assistant_turns=2).
        assert 0 <= r["num_turns/min"] <= r["num_turns/mean"] <= r["num_turns/max"] <= 3
        assert r["multi_turn/tool_errors"] == 0
    total = sum(r["multi_turn/tool_calls/total"] for r in records)
    assert total > 0 and len(calls) == total
    assert max(r["num_turns/max"] for r in records) == 3
    assert max(r["multi_turn/segments"] for r in records) >= 2  # a turn after a tool block
    for expression, answer in calls:
        if expression == "6*7":
            assert answer == "42"


def _check_samples(directory, steps, rows):
    """`<directory>/<step>.jsonl` for each step: one line per response with verl's fields;
    returns the outputs."""
    assert sorted(os.listdir(directory)) == [f"{step}.jsonl" for step in steps]
    for step in steps:
        samples = read_jsonl(str(directory / f"{step}.jsonl"))
        assert len(samples) == rows
        for sample in samples:
            assert {"input", "output", "gts", "score", "step"} <= set(sample)
            assert sample["step"] == step and isinstance(sample["score"], float)
            assert sample["input"].startswith("User: ") and sample["input"].endswith(
                "Assistant: ")  # the char tokenizer's chat template
            a, b = map(int, re.findall(r"\d+", sample["input"])[:2])
            assert sample["gts"] == str(a * b)
    return [s["output"] for step in steps for s in read_jsonl(str(directory / f"{step}.jsonl"))]


def test_tiny_run_with_the_calculator_resumed_on_the_paged_cache_is_bit_identical(tmp_path,
                                                                                 calls):
    """A run on the paged cache, stopped after its first step and resumed, ends with the
    state and metrics of the straight run on the contiguous cache (whose rollouts the
    paged cache's default pool gives bit for bit), and logs the pool's use."""
    from tests.rl.test_trainer_resume import _final_state

    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    run(_tool_config(**{"trainer.save_freq": 1}), straight)
    paged = _tool_config(**{"trainer.save_freq": 1, "rollout.kv_cache": "paged",
                            "rollout.page_size": 8})
    assert run(paged, resumed, exit_after_steps=1)["step"] == 1
    second = run(paged, resumed)
    assert second["resumed"] and second["step"] == 2
    chex.assert_trees_all_equal(_final_state(straight, 2), _final_state(resumed, 2))
    pages = ("rollout/page_usage", "rollout/preemptions")
    for want, got in zip(_metrics(straight), _metrics(resumed), strict=True):
        assert {k: v for k, v in got.items() if k not in pages} == want
        assert 0 < got["rollout/page_usage"] <= 1 and got["rollout/preemptions"] == 0
    assert sum(r["multi_turn/tool_calls/total"] for r in _metrics(resumed)) > 0


_TOOL_REWARD_FN = '''
from jrl.rewards import tool_arithmetic


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    out = tool_arithmetic.compute_score(data_source, solution_str, ground_truth, extra_info)
    return {**out, "own_score": out["score"],
            "calc_seen": extra_info["rollout_reward_scores"]["calculator"]}
'''


@pytest.fixture
def graded_calls(monkeypatch):
    """As `calls`, for the graded calculator (configs/tools/graded_calculator.py): a
    first turn without a call is read as a call, in turn `6*7` (wrong: every product of
    two three-digit numbers exceeds 42) and `answer`, which the calculator answers with
    the row's ground truth (right)."""
    parse = tools_lib.parse_tool_calls
    forced = itertools.cycle(["6*7", "answer"])

    def parse_or_call(text, fmt):
        calls, errors = parse(text, fmt)
        if not calls and not errors:
            calls = [tools_lib.ToolCall("calculator", {"expression": next(forced)})]
        return calls, errors

    execute = tools_lib.Calculator.execute

    def answering(self, instance_id, arguments):
        if arguments["expression"] == "answer":
            return self.instances[instance_id]["ground_truth"], 0.0, {}
        return execute(self, instance_id, arguments)

    monkeypatch.setattr(tools_lib, "parse_tool_calls", parse_or_call)
    monkeypatch.setattr(tools_lib.Calculator, "execute", answering)


def _tiny_grpo_tool_calc(**overrides):
    """configs/grpo_tool_calc.py as written (three-digit products, the two-turn response
    budget), with a smaller model, batch and warm start."""
    from configs import grpo_tool_calc

    return apply_overrides(grpo_tool_calc.get_config(), {
        "model.hidden_size": 32, "model.intermediate_size": 64, "model.num_layers": 1,
        "model.head_dim": 8, "data.num_train": 64, "data.num_val": 8,
        "data.train_batch_size": 4, "data.val_batch_size": 8, "rollout.n": 2,
        "rollout.decode_buckets": 1, "actor.ppo_mini_batch_size": 4,
        "actor.ppo_micro_batch_size": 8, "sft.steps": 5, "sft.batch_size": 16,
        "trainer.total_training_steps": 2, "trainer.test_freq": 0,
        "trainer.val_before_train": False, "trainer.logger": ("jsonl",), **overrides})


@pytest.mark.parametrize("add_tool_rewards", [True, False])
def test_graded_calculator_rewards_reach_the_score_in_a_run(tmp_path, graded_calls, monkeypatch,
                                                             add_tool_rewards):
    """configs/grpo_tool_calc.py with configs/tools/graded_calculator.yaml, run from the
    repository root. A custom reward function sees each sample's tool reward (steps plus
    calc_reward) as `extra_info["rollout_reward_scores"]["calculator"]`: -0.05 for a
    wrong call (-0.05 + 0), 1 for a right one (0 + 1), 0 without a call. With
    `add_tool_rewards` the sample's score is the function's plus that reward; without,
    the function's alone."""
    monkeypatch.chdir(REPO)
    fn = tmp_path / "reward.py"
    fn.write_text(_TOOL_REWARD_FN)
    rollouts = tmp_path / "rollouts"
    run(_tiny_grpo_tool_calc(**{
        "rollout.multi_turn.tool_config_path": "configs/tools/graded_calculator.yaml",
        "rollout.multi_turn.add_tool_rewards": add_tool_rewards,
        "reward.custom_fn": f"{fn}:compute_score",
        "trainer.rollout_data_dir": str(rollouts)}), str(tmp_path / "run"))
    samples = [s for step in (1, 2) for s in read_jsonl(str(rollouts / f"{step}.jsonl"))]
    assert len(samples) == 2 * 4 * 2  # steps x train_batch_size x rollout.n
    seen = {round(s["calc_seen"], 6) for s in samples}
    assert seen <= {-0.05, 1.0, 0.0} and {-0.05, 1.0} <= seen, seen
    records = read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))
    assert len(records) == 2
    for r in records:
        added = r["reward_extra/calc_seen/mean"] if add_tool_rewards else 0.0
        assert r["critic/score/mean"] == pytest.approx(r["reward_extra/own_score/mean"] + added,
                                                       abs=1e-6)
        # With the tool rewards added, reward_extra/score/mean is the function's own score.
        if add_tool_rewards:
            assert r["reward_extra/score/mean"] == r["reward_extra/own_score/mean"]
        else:
            assert "reward_extra/score/mean" not in r
    assert sum(r["reward_extra/calc_seen/mean"] for r in records) != 0.0
