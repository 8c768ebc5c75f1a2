"""GSM8K end to end on the CPU: verl-schema parquet files, a HF-format Qwen2 checkpoint
with its own tokenizer, the GSM8K rule scorer, overlong prompts, failing reward
functions, and the GSM8K experiment configs.

Everything is written by the tests: a character-level `tokenizer.json` (plus a
"####" token) with a Qwen-style chat template, a random 1-layer Qwen2 of width 32,
and a few GSM8K-style rows in the schema `python -m jrl.data.preprocess gsm8k` writes.
"""

import dataclasses
import importlib
import json
import math
import re
import string
from pathlib import Path

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models

from jrl.config import settings
from jrl.config.defaults import base_config
from jrl.data.files import write_parquet
from jrl.data.tokenizers import HFTokenizer
from jrl.metrics import read_jsonl
from jrl.models import ModelConfig, init_params, save_pretrained
from jrl.train import run
from tests.tiny import apply_overrides

REPO = Path(__file__).resolve().parents[2]
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# (question, ground truth); the first is GSM8K's first training problem, shortened.
TRAIN = [
    ("Natalia sold 48 clips in April and half as many in May. How many clips did she sell "
     "in all?", "72"),
    ("Weng earns $12 an hour. She babysat for 50 minutes. How much did she earn?", "10"),
    ("Betty has $50. Her parents give her $15 and her grandparents $30. How much more does "
     "she need for a $100 wallet?", "5"),
    ("James writes a 3-page letter to 2 friends twice a week. How many pages does he write "
     "in a year?", "624"),
]
VAL = [
    ("A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts does "
     "it take?", "3"),
    ("Tina makes $18 an hour. How much does she make in 3 hours?", "54"),
]
OVERLONG = ("Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and "
            "bakes muffins for her friends every day with four. She sells the remainder at the "
            "farmers' market daily for $2 per fresh duck egg. How much in dollars does she make "
            "every day at the farmers' market?", "18")
MAX_PROMPT = 200
N = 2
RESPONSE_LENGTH = 16
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Tokens the template adds around a user message: "<|im_start|>", "user", "\n" (6 tokens),
# "<|im_end|>\n" (2) and "<|im_start|>assistant\n" (11); "####" is one token, not four.
TEMPLATE_TOKENS = 6 + 2 + 11 - 3

# Reward functions for reward.custom_fn. Every call is appended to the JSON lines file
# named by $JRL_TEST_REWARD_LOG, so the tests can recompute what the trainer logged.
REWARD_FILE = '''
import json
import os

from jrl.rewards import gsm8k


def _log(**record):
    with open(os.environ["JRL_TEST_REWARD_LOG"], "a") as f:
        f.write(json.dumps(record) + "\\n")


def half_correct(data_source, solution_str, ground_truth, extra_info=None):
    """GSM8K's scorer on the response plus a final answer: the right one when the
    response has an even number of characters, a wrong one otherwise."""
    answer = ground_truth if len(solution_str) % 2 == 0 else ground_truth + "1"
    result = gsm8k.compute_score(data_source, solution_str + "\\n#### " + answer, ground_truth,
                                 extra_info)
    _log(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
         extra_info=extra_info, result=result)
    return result


def always_raises(data_source, solution_str, ground_truth, extra_info=None):
    raise ValueError("no parser for this response")


def raises_on_odd_index(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] % 2:
        raise ValueError(f"cannot score row {extra_info['index']}")
    return half_correct(data_source, solution_str, ground_truth, extra_info)
'''


# --------------------------------------------------------------------------- fixtures


def _row(question: str, answer: str, split: str, index: int) -> dict:
    """A row as `python -m jrl.data.preprocess gsm8k` writes it (verl's schema)."""
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "answer": f"#### {answer}",
                       "question": question},
    }


def _prompt_tokens(question: str) -> int:
    return len(question + " " + INSTRUCTION) + TEMPLATE_TOKENS


def _write_tokenizer(path: Path) -> None:
    """Character-level BPE (no merges but "#"+"#" and "##"+"##"), Qwen's special tokens."""
    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {t: i for i, t in enumerate(["<unk>", *chars, "##", "####"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("#", "#"), ("##", "##")],
                               unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": "<unk>",
              "chat_template": CHAT_TEMPLATE, "model_max_length": 512}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _random_params(model: ModelConfig) -> dict:
    """N(0, 0.02) weights, unit norm scales: `init_params`'s layout without compiling it."""
    shapes = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
    rng = np.random.default_rng(0)

    def leaf(path, shape):
        if path[-1].key == "scale":
            return np.ones(shape.shape, shape.dtype)
        return rng.normal(0.0, 0.02, shape.shape).astype(shape.dtype)

    return jax.tree_util.tree_map_with_path(leaf, shapes)


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    """Paths of the checkpoint directory, the parquet files and the reward file."""
    root = tmp_path_factory.mktemp("gsm8k")
    ckpt = root / "qwen2-tiny"
    ckpt.mkdir()
    _write_tokenizer(ckpt)
    tok = HFTokenizer.from_pretrained(ckpt)
    model = ModelConfig(family="qwen2", vocab_size=tok.vocab_size, hidden_size=32,
                        intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                        head_dim=8, rope_theta=1e6, tie_word_embeddings=True, qkv_bias=True,
                        max_position_embeddings=512, eos_token_ids=(tok.eos_token_id,),
                        pad_token_id=tok.pad_token_id)
    save_pretrained(ckpt, model, _random_params(model))
    paths = {"ckpt": ckpt, "train": root / "train.parquet", "val": root / "test.parquet",
             "with_overlong": root / "train_overlong.parquet", "reward": root / "reward.py"}
    train = [_row(q, a, "train", i) for i, (q, a) in enumerate(TRAIN)]
    write_parquet(train, paths["train"])
    write_parquet([_row(q, a, "test", i) for i, (q, a) in enumerate(VAL)], paths["val"])
    # The overlong problem is row 3 of its file (rows numbered from 1).
    write_parquet([*train[:2], _row(*OVERLONG, "train", 99), *train[2:]],
                  paths["with_overlong"])
    paths["reward"].write_text(REWARD_FILE)
    return paths


@pytest.fixture
def reward_log(tmp_path, monkeypatch):
    """`read() -> [call records]` of the reward functions in REWARD_FILE during this test."""
    path = tmp_path / "reward_calls.jsonl"
    monkeypatch.setenv("JRL_TEST_REWARD_LOG", str(path))

    def read():
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines()]

    return read


def _config(fixture, reward_fn="half_correct", **overrides):
    c = base_config()
    c.model.path = str(fixture["ckpt"])
    c.tokenizer.name = "hf"
    c.data.train_files = str(fixture["train"])
    c.data.max_prompt_length = MAX_PROMPT
    c.data.train_batch_size = len(TRAIN)
    c.data.val_batch_size = len(VAL)
    c.rollout.n = N
    c.rollout.response_length = RESPONSE_LENGTH
    c.actor.optim.lr = 1e-3
    c.actor.ppo_mini_batch_size = 2
    c.actor.ppo_micro_batch_size = 4
    c.reward.custom_fn = f"{fixture['reward']}:{reward_fn}"
    c.trainer.total_training_steps = 2
    c.trainer.val_before_train = False
    c.trainer.logger = ("jsonl",)
    return apply_overrides(c, overrides)


def _metrics(workdir) -> list[dict]:
    return read_jsonl(str(Path(workdir) / "metrics.jsonl"))


def test_fixture_prompt_lengths(fixture):
    """The hand-counted prompt lengths agree with the tokenizer and the template."""
    tok = HFTokenizer.from_pretrained(fixture["ckpt"])
    for question, answer in [*TRAIN, *VAL, OVERLONG]:
        messages = _row(question, answer, "train", 0)["prompt"]
        ids = tok.encode(tok.apply_chat_template(messages))
        assert len(ids) == _prompt_tokens(question)
        assert ids[-1] == tok.encode("\n")[0] and tok.decode(ids).endswith("assistant\n")
    assert max(_prompt_tokens(q) for q, _ in [*TRAIN, *VAL]) <= MAX_PROMPT
    assert _prompt_tokens(OVERLONG[0]) > MAX_PROMPT


# --------------------------------------------------------------------------- (a) end to end


def test_grpo_on_gsm8k_files_end_to_end(fixture, reward_log, tmp_path):
    config = _config(fixture, **{"data.val_files": str(fixture["val"]),
                                 "trainer.test_freq": 2})
    summary = run(config, str(tmp_path / "run"))
    records = _metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert all(math.isfinite(v) for v in record.values()), record
        assert {"critic/score/mean", "critic/rewards/mean", "critic/advantages/mean",
                "response_length/mean", "response_length/clip_ratio", "prompt_length/mean",
                "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy",
                "actor/lr", "actor/grad_norm", "perf/total_num_tokens",
                "timing_s/gen", "timing_s/step"} <= set(record), sorted(record)
        # Every prompt went through the chat template: the batch holds all four rows.
        want = np.mean([_prompt_tokens(q) for q, _ in TRAIN])
        assert record["prompt_length/mean"] == pytest.approx(want)
        assert record["response_length/max"] <= RESPONSE_LENGTH

    # The scorer saw each training row's GSM8K fields: 4 prompts x n per step, then the
    # validation set at the last step (greedy, one sample each).
    calls = reward_log()
    per_step = len(TRAIN) * N
    assert len(calls) == 2 * per_step + len(VAL)
    train_calls, val_calls = calls[:2 * per_step], calls[2 * per_step:]
    for step_calls in (train_calls[:per_step], train_calls[per_step:]):
        assert sorted(c["ground_truth"] for c in step_calls) == sorted(
            a for _, a in TRAIN for _ in range(N))
    assert {c["extra_info"]["split"] for c in train_calls} == {"train"}
    assert sorted(c["ground_truth"] for c in val_calls) == sorted(a for _, a in VAL)
    assert {c["data_source"] for c in calls} == {"openai/gsm8k"}
    for call in train_calls:
        question = call["extra_info"]["question"]
        assert dict(TRAIN)[question] == call["ground_truth"]
    # GSM8K's strict scorer: 1 for the right number after "#### ", else 0.
    for call in calls:
        correct = float(len(call["solution_str"]) % 2 == 0)
        assert call["result"] == {"score": correct, "acc": correct}

    # The logged scores are the scorer's: per step, and on the validation set.
    for record, start in zip(records, (0, per_step), strict=True):
        scores = [c["result"]["score"] for c in train_calls[start:start + per_step]]
        assert record["critic/score/mean"] == pytest.approx(np.mean(scores))
        assert record["critic/score/max"] == max(scores)
        assert record["reward_extra/acc/mean"] == pytest.approx(np.mean(scores))
    val_acc = np.mean([c["result"]["acc"] for c in val_calls])
    assert records[1]["val-core/openai/gsm8k/acc/mean@1"] == pytest.approx(val_acc)
    assert "val-core/openai/gsm8k/acc/mean@1" not in records[0]

    # The trained actor comes back as a checkpoint that transformers loads and runs.
    import torch
    import transformers

    assert summary["hf_export"] == str(tmp_path / "run" / "hf_export")
    exported = transformers.AutoModelForCausalLM.from_pretrained(summary["hf_export"])
    source = transformers.AutoModelForCausalLM.from_pretrained(fixture["ckpt"])
    assert type(exported).__name__ == "Qwen2ForCausalLM"
    before = source.model.layers[0].mlp.up_proj.weight.detach().numpy()
    after = exported.model.layers[0].mlp.up_proj.weight.detach().numpy()
    assert after.shape == before.shape and not np.allclose(after, before)
    tok = HFTokenizer.from_pretrained(fixture["ckpt"])
    ids = torch.tensor([tok.encode(tok.apply_chat_template(_row(*VAL[0], "test", 0)["prompt"]))])
    with torch.no_grad():
        logits = exported(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], tok.vocab_size)
    assert torch.isfinite(logits).all()


# --------------------------------------------------------------------------- (b) overlong


def test_overlong_prompts_filtered(fixture, reward_log, tmp_path, capsys):
    config = _config(fixture, **{"data.train_files": str(fixture["with_overlong"]),
                                 "data.filter_overlong_prompts": True,
                                 "trainer.total_training_steps": 1})
    run(config, str(tmp_path / "run"))
    out = capsys.readouterr().out
    assert re.search(r"data\.train_files: dropped 1 rows? .*max_prompt_length="
                     rf"{MAX_PROMPT}.*"
                     rf"{len(TRAIN)} remain", out), out
    assert [r["step"] for r in _metrics(tmp_path / "run")] == [1]
    # The batch of four is exactly the four rows that fit; the long one was never scored.
    calls = reward_log()
    assert sorted(c["ground_truth"] for c in calls) == sorted(a for _, a in TRAIN for _ in
                                                              range(N))
    assert all(c["extra_info"]["index"] != 99 for c in calls)


def test_overlong_prompt_is_an_error_naming_the_row(fixture, tmp_path):
    config = _config(fixture, **{"data.train_files": str(fixture["with_overlong"]),
                                 "data.filter_overlong_prompts": False})
    tokens = _prompt_tokens(OVERLONG[0])
    with pytest.raises(ValueError, match=rf"train_overlong\.parquet: row 3: the prompt .* "
                                         rf"has {tokens} tokens, more than "
                                         rf"data\.max_prompt_length={MAX_PROMPT}"):
        run(config, str(tmp_path / "run"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# --------------------------------------------------------------------------- (c) reward errors


def test_failing_reward_function_stops_the_run(fixture, tmp_path):
    config = _config(fixture, "always_raises", **{"reward.on_error": "raise"})
    with pytest.raises(RuntimeError,
                       match=r"sample 0 \(data_source='openai/gsm8k'\)(.|\n)*no parser"):
        run(config, str(tmp_path / "run"))


def test_failing_reward_function_scored(fixture, reward_log, tmp_path):
    config = _config(fixture, "raises_on_odd_index",
                     **{"reward.on_error": "score", "reward.error_score": -1.0})
    run(config, str(tmp_path / "run"))
    records = _metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    calls = reward_log()
    # Rows 1 and 3 fail: 2 prompts x n samples a step score -1; the others score as usual.
    failing = 2 * N
    assert len(calls) == 2 * (len(TRAIN) * N - failing)
    for step, record in enumerate(records):
        assert record["reward/num_errors"] == failing
        assert record["critic/score/min"] == -1.0
        scored = len(TRAIN) * N - failing
        ok_scores = [c["result"]["score"] for c in calls[step * scored:(step + 1) * scored]]
        want = (sum(ok_scores) - failing) / (len(TRAIN) * N)
        assert record["critic/score/mean"] == pytest.approx(want)


# --------------------------------------------------------------------------- configs


@pytest.mark.parametrize("name", ["grpo_gsm8k", "ppo_gsm8k"])
def test_gsm8k_configs_validate(name, fixture, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    module = importlib.import_module(f"configs.{name}")
    # The docstring says how to get the data and how to launch.
    assert "python -m jrl.data.preprocess gsm8k" in module.__doc__
    assert f"python -m jrl.train --config=configs/{name}.py" in module.__doc__
    config = module.get_config()
    # `~` stays in the config (expanded where the paths are read), so the generated
    # docs/configs.md is the same on every machine.
    assert config.model.path == "~/models/Qwen2.5-0.5B-Instruct"
    assert config.data.train_files == "~/data/gsm8k/train.parquet"
    assert config.data.val_files == "~/data/gsm8k/test.parquet"
    assert config.tokenizer.name == "hf" and config.model.dtype == "bfloat16"
    # The model options are ones the architecture accepts.
    dataclasses.replace(ModelConfig.preset("tiny"), dtype=config.model.dtype,
                        remat=config.model.remat, param_dtype=config.model.param_dtype)
    assert config.model.remat != "none"

    config.model.path = str(fixture["ckpt"])
    config.data.train_files = str(fixture["train"])
    config.data.val_files = str(fixture["val"])
    tok = HFTokenizer.from_pretrained(fixture["ckpt"])
    gsm8k_train_rows = 7473
    s = settings.from_config(config, stop_token_ids=tok.eos_token_ids,
                             pad_token_id=tok.pad_token_id, num_train_rows=gsm8k_train_rows)
    batch = config.data.train_batch_size
    assert s.total_steps == config.trainer.total_epochs * (gsm8k_train_rows // batch)
    assert s.actor.optim.lr == 1e-6 and s.rollout.temperature == 1.0
    assert not s.validation.do_sample
    if name == "grpo_gsm8k":
        assert s.algorithm.adv_estimator == "grpo" and s.critic is None
        assert s.rollout.n == 5
        assert s.actor.use_kl_loss and s.actor.kl_loss_type == "low_var_kl"
        assert s.actor.kl_loss_coef == 0.001 and not s.algorithm.use_kl_in_reward
    else:
        assert s.algorithm.adv_estimator == "gae" and s.critic is not None
        assert s.rollout.n == 1 and s.critic.optim.lr == 1e-5
        assert not s.algorithm.use_kl_in_reward and not s.actor.use_kl_loss



def test_grpo_gsm8k_config_runs_when_shrunk(fixture, monkeypatch, tmp_path):
    """One step of the config as it is (bfloat16, remat, KL loss, the built-in GSM8K
    scorer chosen by data_source) with only the sizes cut down. (PPO's critic costs
    another 20 s of compilation here; tests/rl/test_trainer_smoke.py runs GAE.)"""
    monkeypatch.syspath_prepend(str(REPO))
    config = importlib.import_module("configs.grpo_gsm8k").get_config()
    config.model.path = str(fixture["ckpt"])
    config.data.train_files = str(fixture["train"])
    config.data.val_files = None
    config.data.max_prompt_length = MAX_PROMPT
    config.data.train_batch_size = len(TRAIN)
    config.rollout.response_length = RESPONSE_LENGTH
    config.actor.logprob_chunk_size = 8
    config.actor.ppo_mini_batch_size = 2
    config.actor.ppo_micro_batch_size = 2 * config.rollout.n
    config.trainer.total_training_steps = 1
    config.trainer.logger = ("jsonl",)
    run(config, str(tmp_path))
    (record,) = _metrics(tmp_path)
    assert record["step"] == 1 and all(math.isfinite(v) for v in record.values())
    # The built-in scorer of openai/gsm8k ran (a random model scores 0).
    assert record["reward_extra/acc/mean"] == record["critic/score/mean"] == 0.0
    assert "actor/kl_loss" in record and "critic/vf_loss" not in record
