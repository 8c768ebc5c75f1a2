"""With multi-turn tools on, every prompt renders the tool schemas through the chat
template's `tools` variable (as verl's agent loop), and every prompt-length check
measures that rendering."""

import json
import os

import numpy as np
import pytest

from jrl import tools as tools_lib
from jrl.app import experiment
from jrl.config import settings
from jrl.data import files
from jrl.data.dataset import encode_prompts, prompt_text, prompt_token_ids
from jrl.data.synthetic import TOOL_DATA_SOURCE
from jrl.data.tokenizers import CharTokenizer, HFTokenizer
from jrl.errors import ConfigError, DataError
from jrl.sft import encode_examples
from tests import char_tokenizer
from tests.tiny import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CALCULATOR_YAML = os.path.join(REPO, "configs", "tools", "calculator.yaml")
SCHEMA = tools_lib.Calculator.default_schema
# Qwen-like: the schemas in a system block, one JSON object a line, when `tools` is given.
TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools:' }}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    """A character-level HF tokenizer (each special token one id) with TOOLS_TEMPLATE."""
    return char_tokenizer.write(tmp_path_factory.mktemp("tools_template"), SPECIAL,
                                TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def tok(tok_path):
    return HFTokenizer.from_pretrained(tok_path)


def _row(question, answer):
    return {"prompt": [{"role": "user", "content": question}], "data_source": TOOL_DATA_SOURCE,
            "reward_model": {"ground_truth": answer}}


PLAIN = "<|im_start|>user\n12*34<|im_end|>\n<|im_start|>assistant\n"
# Characters outside special tokens, plus one id per special token.
PLAIN_LEN = len(PLAIN) - len("<|im_start|>") * 2 - len("<|im_end|>") + 3
WITH_TOOLS = "<|im_start|>system\nTools:\n" + json.dumps(SCHEMA) + "<|im_end|>\n" + PLAIN
WITH_TOOLS_LEN = PLAIN_LEN + 2 + len("system\nTools:\n" + json.dumps(SCHEMA) + "\n")


def test_prompt_renders_the_schemas_through_the_template(tok):
    row = _row("12*34", "408")
    assert prompt_text(tok, row, False) == PLAIN
    assert prompt_text(tok, row, False, tools=[SCHEMA]) == WITH_TOOLS
    # "user\n" 5, "12*34" 5, "\n" 1, "assistant\n" 10, and 3 special tokens.
    assert len(prompt_token_ids(tok, row, False)) == PLAIN_LEN == 24
    assert len(prompt_token_ids(tok, row, False, tools=[SCHEMA])) == WITH_TOOLS_LEN
    assert prompt_text(tok, row, False, tools=[]) == PLAIN  # no tools: no system block
    # A plain-string prompt without the chat template has no place for them.
    assert prompt_text(tok, {"prompt": "12*34"}, False, tools=[SCHEMA]) == "12*34"


def test_char_tokenizer_ignores_the_schemas():
    """The tool task's prompts (char tokenizer) are what they were before tools."""
    char = CharTokenizer()
    row = _row("12*34", "408")
    assert prompt_text(char, row, True, tools=[SCHEMA]) == "User: 12*34\nAssistant: "


def test_length_checks_count_the_schemas(tok):
    """encode_prompts, filter_overlong_prompts and the warm start's encoding measure the
    prompt with its schemas: it fits `WITH_TOOLS_LEN` tokens, not one fewer."""
    rows = [_row("12*34", "408")]
    ids, mask = encode_prompts(tok, rows, WITH_TOOLS_LEN, False, tools=[SCHEMA])
    assert mask.sum() == WITH_TOOLS_LEN
    assert tok.decode(ids[0].tolist(), skip_special_tokens=False) == WITH_TOOLS
    with pytest.raises(ConfigError, match=f"{WITH_TOOLS_LEN} tokens"):
        encode_prompts(tok, rows, WITH_TOOLS_LEN - 1, False, tools=[SCHEMA])
    encode_prompts(tok, rows, WITH_TOOLS_LEN - 1, False)  # without the schemas it fits
    assert files.filter_overlong_prompts(rows, tok, WITH_TOOLS_LEN - 1, False,
                                         tools=[SCHEMA]) == ([], 1)
    assert files.filter_overlong_prompts(rows, tok, WITH_TOOLS_LEN, False,
                                         tools=[SCHEMA]) == (rows, 0)
    prompt_ids, prompt_mask, *_ = encode_examples(tok, rows, WITH_TOOLS_LEN, 8, tools=[SCHEMA])
    np.testing.assert_array_equal(prompt_ids, ids)
    np.testing.assert_array_equal(prompt_mask, mask)


def _files_config(tmp_path, multi_turn, **overrides):
    """Train and val files of one short and one long question; the limit is the short
    prompt with the calculator's schema."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (_row("12*34", "408"),
                                                           _row("123*456", "56088"))))
    return tiny_config(**{
        "data.train_files": str(path), "data.val_files": str(path),
        "data.max_prompt_length": WITH_TOOLS_LEN,
        "rollout.multi_turn.enable": multi_turn,
        "rollout.multi_turn.tool_config_path": CALCULATOR_YAML, **overrides})


def test_settings_keep_the_schemas(tmp_path):
    config = _files_config(tmp_path, multi_turn=True)
    assert settings.experiment_from_config(config).prompt_tools == [SCHEMA]
    without = _files_config(tmp_path, multi_turn=False)
    assert settings.experiment_from_config(without).prompt_tools is None


def test_build_data_measures_prompts_with_the_schemas(tmp_path, tok):
    """"123*456" fits the limit alone (two characters longer than "12*34") but not with
    the schema: reported by row, or dropped with data.filter_overlong_prompts."""
    train, val = experiment.build_data(
        settings.experiment_from_config(_files_config(tmp_path, multi_turn=False)), tok)
    assert len(train) == len(val) == 2
    with pytest.raises(DataError) as err:
        experiment.build_data(
            settings.experiment_from_config(_files_config(tmp_path, multi_turn=True)), tok)
    assert f"row 2: the prompt '123*456' has {WITH_TOOLS_LEN + 2} tokens" in str(err.value)
    train, val = experiment.build_data(settings.experiment_from_config(
        _files_config(tmp_path, multi_turn=True, **{"data.filter_overlong_prompts": True})), tok)
    assert [r["reward_model"]["ground_truth"] for r in train + val] == ["408", "408"]


def test_a_run_renders_the_schemas_into_its_prompts(tmp_path, tok_path):
    """A tiny multi-turn run with the HF tokenizer: every rollout prompt has the
    calculator's schema (`prompt_length/mean` is the rendered length of each question,
    all of the same length), and the written samples show it."""
    from jrl.metrics import read_jsonl
    from jrl.train import run

    questions = [(f"{a}*{b}", str(a * b)) for a in range(11, 19) for b in (21, 22)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(_row(q, a)) + "\n" for q, a in questions))
    config = tiny_config(**{
        "tokenizer.name": "hf", "tokenizer.path": str(tok_path),
        "data.train_files": str(path), "data.val_files": str(path),
        "data.max_prompt_length": WITH_TOOLS_LEN, "rollout.response_length": 8,
        "rollout.multi_turn.enable": True, "rollout.multi_turn.tool_config_path": CALCULATOR_YAML,
        "rollout.multi_turn.max_tool_response_tokens": 8,
        "algorithm.adv_estimator": "grpo", "trainer.total_training_steps": 1,
        "trainer.rollout_data_dir": str(tmp_path / "rollouts")})
    run(config, str(tmp_path / "run"))
    (record,) = read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))
    assert record["prompt_length/mean"] == record["prompt_length/min"] == WITH_TOOLS_LEN
    samples = read_jsonl(str(tmp_path / "rollouts" / "1.jsonl"))
    assert len(samples) == 4 * 2
    for sample in samples:
        question = sample["input"].split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        assert sample["input"] == WITH_TOOLS.replace("12*34", question)
