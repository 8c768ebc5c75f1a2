"""RewardModel against transformers' AutoModelForSequenceClassification (float32, CPU).

The reference runs each conversation alone and unpadded through transformers,
with the conversation rendered and tokenized by transformers' own tokenizer.
"""

import string

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models

from jrl.rewards.reward_model import RewardModel

SPECIALS = ["<pad>", "<s>", "<|im_end|>", "<unk>", "<|im_start|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ROWS = [
    {"prompt": [{"role": "system", "content": "Be kind."},
                {"role": "user", "content": "What is 2+2?"}]},
    {"prompt": "Name a color."},
]
TEXTS = ["4", "It is 4, of course.", "Blue", "green!", ""]  # n is 2 for the first rows


def _character_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """One token per character (vocabulary < 128, the tiny model's), special tokens first."""
    chars = string.ascii_letters + string.digits + " \n.,!?+=:"
    vocab = {token: i for i, token in enumerate(SPECIALS + list(chars))}
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    raw.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>",
        unk_token="<unk>", additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random Qwen2ForSequenceClassification with its tokenizer in one directory."""
    path = tmp_path_factory.mktemp("reward_model")
    tokenizer = _character_tokenizer()
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2, num_labels=1, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False)
    model = transformers.Qwen2ForSequenceClassification(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, tokenizer


def _reference_ids(tokenizer, row, text):
    prompt = row["prompt"]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    rendered = tokenizer.apply_chat_template(
        [*messages, {"role": "assistant", "content": text}], tokenize=False,
        add_generation_prompt=False)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def _reference_score(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, 0].item()


@pytest.mark.parametrize(("padding", "micro_batch_size"), [("right", None), ("left", 4)])
def test_scores_match_transformers(checkpoint, padding, micro_batch_size):
    path, model, tokenizer = checkpoint
    rows = [ROWS[0], ROWS[1], ROWS[0]]
    texts = TEXTS + ["x"]  # 6 samples, n = 2
    expected = [_reference_score(model, _reference_ids(tokenizer, rows[i // 2], t))
                for i, t in enumerate(texts)]
    rm = RewardModel.from_pretrained(path, max_length=96, padding=padding,
                                     micro_batch_size=micro_batch_size)
    scores = rm.score(rows, texts, n=2)
    assert scores.dtype == np.float32 and scores.shape == (6,)
    np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=1e-5)
    assert len(set(np.round(scores, 4))) > 1  # the samples are not all scored alike


def test_conversation_uses_the_reward_models_template(checkpoint):
    path, _, tokenizer = checkpoint
    rm = RewardModel.from_pretrained(path, max_length=64)
    ids = rm.conversation_ids(ROWS[1], "Blue")
    assert tokenizer.decode(ids) == (
        "<|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\nBlue<|im_end|>\n")
    assert ids == _reference_ids(tokenizer, ROWS[1], "Blue")


@pytest.mark.parametrize("truncation", ["left", "right"])
def test_truncation_policies(checkpoint, truncation):
    path, model, tokenizer = checkpoint
    short = _reference_ids(tokenizer, ROWS[0], TEXTS[0])
    full = _reference_ids(tokenizer, ROWS[0], TEXTS[1])
    max_length = len(short) + 5
    assert len(full) > max_length
    kept = full[-max_length:] if truncation == "left" else full[:max_length]
    rm = RewardModel.from_pretrained(path, max_length=max_length, truncation=truncation)
    tokens, mask = rm.encode(ROWS[:1], TEXTS[:2], n=2)
    assert mask.sum(1).tolist() == [len(short), max_length]
    np.testing.assert_array_equal(tokens[1], kept)
    np.testing.assert_allclose(rm.score(ROWS[:1], TEXTS[:2], n=2)[1],
                               _reference_score(model, kept), rtol=1e-4, atol=1e-5)


def test_errors(checkpoint, tmp_path):
    path, _, tokenizer = checkpoint
    rm = RewardModel.from_pretrained(path, max_length=60, truncation="error")
    with pytest.raises(ValueError, match="sample 1 has 70 tokens, more than max_length=60"):
        rm.encode(ROWS[:1], TEXTS[:2], n=2)
    with pytest.raises(ValueError, match="truncation='middle'"):
        RewardModel.from_pretrained(path, max_length=40, truncation="middle")
    with pytest.raises(ValueError, match="3 responses for 1 prompts with n=2"):
        rm.encode(ROWS[:1], TEXTS[:3], n=2)
    torch.manual_seed(0)
    lm = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1))
    lm.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="causal LM checkpoint"):
        RewardModel.from_pretrained(tmp_path, max_length=40)
