"""CharTokenizer, and HFTokenizer against transformers.AutoTokenizer on a local tokenizer."""

import json

import jinja2
import pytest
import transformers
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from jrl.data.tokenizers import CHAR_ALPHABET, CharTokenizer, HFTokenizer, Tokenizer

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXTS = [
    "hello world",
    "What is 12+34? Answer: 46.",
    "  leading spaces and\nnew lines\n",
    "unicode: café, naïve — 数学",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3*3?"},
]


def _train_bpe() -> RawTokenizer:
    raw = RawTokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [" ".join(TEXTS), "the quick brown fox jumps over the lazy dog 0123456789"] * 20
    raw.train_from_iterator(corpus, trainer)
    # A BOS post-processor makes add_special_tokens observable.
    raw.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", raw.token_to_id("<s>"))]
    )
    return raw


@pytest.fixture(scope="module")
def saved_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    wrapped = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(), bos_token="<s>", eos_token="<|im_end|>",
        pad_token="<pad>", unk_token="<unk>", chat_template=CHAT_TEMPLATE,
    )
    wrapped.save_pretrained(path)
    eos_ids = [wrapped.convert_tokens_to_ids(t) for t in ("<|im_end|>", "</s>")]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    return path


@pytest.fixture(scope="module")
def pair(saved_tokenizer):
    return HFTokenizer.from_pretrained(saved_tokenizer), transformers.AutoTokenizer.from_pretrained(
        saved_tokenizer
    )


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_hf_encode_decode_match_transformers(pair, text, add_special_tokens):
    ours, reference = pair
    ids = ours.encode(text, add_special_tokens=add_special_tokens)
    assert ids == reference.encode(text, add_special_tokens=add_special_tokens)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
            ids, skip_special_tokens=skip
        )


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_hf_chat_template_matches_transformers(pair, add_generation_prompt):
    ours, reference = pair
    expected = reference.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt) == (
        expected
    )
    assert expected.startswith("<s><|im_start|>system\n")


def test_hf_special_ids_and_vocab(pair):
    ours, reference = pair
    assert isinstance(ours, Tokenizer)
    assert ours.vocab_size == len(reference)
    assert ours.pad_token_id == reference.pad_token_id
    assert ours.eos_token_id == reference.eos_token_id
    assert ours.bos_token_id == reference.bos_token_id
    # generation_config.json's stop list, in its order.
    assert ours.eos_token_ids == (reference.eos_token_id, reference.convert_tokens_to_ids("</s>"))


def test_hf_template_raise_exception(pair):
    ours, _ = pair
    with pytest.raises(jinja2.TemplateError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_hf_chat_template_in_tokenizer_config(saved_tokenizer, tmp_path, pair):
    """The transformers 4 layout keeps the template inside tokenizer_config.json."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((saved_tokenizer / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = (saved_tokenizer / "chat_template.jinja").read_text()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = HFTokenizer.from_pretrained(tmp_path)
    assert ours.apply_chat_template(MESSAGES) == pair[0].apply_chat_template(MESSAGES)
    # No generation_config.json: the tokenizer's own EOS is the only stop token.
    assert ours.eos_token_ids == (ours.eos_token_id,)


def test_hf_missing_files(saved_tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer directory .*absent.* does not exist"):
        HFTokenizer.from_pretrained(tmp_path / "absent")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="tokenizer.json not found"):
        HFTokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "tokenizer.json").write_bytes((saved_tokenizer / "tokenizer.json").read_bytes())
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json not found"):
        HFTokenizer.from_pretrained(tmp_path)


def test_hf_without_chat_template(saved_tokenizer, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((saved_tokenizer / name).read_bytes())
    ours = HFTokenizer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has no chat template.*chat_template.jinja"):
        ours.apply_chat_template(MESSAGES)


def test_char_tokenizer_round_trip_and_specials():
    tok = CharTokenizer()
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 3 + len(CHAR_ALPHABET) <= 128  # fits the `tiny` preset
    text = "Q: (12+34)*2 = ?\nA: 92."
    ids = tok.encode(text)
    assert len(ids) == len(text) and min(ids) >= 3
    assert tok.decode(ids) == text
    assert tok.encode("ab", add_special_tokens=True) == [tok.bos_token_id, *tok.encode("ab")]
    with_specials = [tok.bos_token_id, *ids, tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(with_specials) == text
    assert tok.decode(with_specials, skip_special_tokens=False) == f"<bos>{text}<eos><pad>"
    assert (tok.pad_token_id, tok.eos_token_id, tok.eos_token_ids) == (0, 2, (2,))


def test_char_tokenizer_chat_template_and_errors():
    tok = CharTokenizer()
    prompt = tok.apply_chat_template(MESSAGES)
    assert prompt == (
        "System: You are terse.\nUser: What is 2+2?\nAssistant: 4\nUser: And 3*3?\nAssistant: "
    )
    assert tok.decode(tok.encode(prompt)) == prompt
    assert not tok.apply_chat_template(MESSAGES[:2], add_generation_prompt=False).endswith(" ")
    with pytest.raises(ValueError, match=r"cannot encode 'é' \(U\+00E9\)"):
        tok.encode("café")
    # Tool results (multi-turn rollouts) have a role of their own.
    assert tok.apply_chat_template([{"role": "tool", "content": "42"}],
                                   add_generation_prompt=False) == "Tool: 42\n"
    with pytest.raises(ValueError, match="unknown chat role 'narrator'"):
        tok.apply_chat_template([{"role": "narrator", "content": "x"}])
