"""A character-level Hugging Face tokenizer written offline for tests: every printable
character one token, each special token one token, and a chat template of the test's
choosing (so token counts can be worked out by hand)."""

import json
import string

from tokenizers import Tokenizer, decoders, models


def write(path, special_tokens, chat_template: str):
    """Writes `tokenizer.json` and `tokenizer_config.json` to the directory `path`
    (eos `<|im_end|>`, pad `<|endoftext|>`, both among `special_tokens`); returns it."""
    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(["<unk>", *chars])},
                                     merges=[], unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(special_tokens))
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": "<unk>",
        "chat_template": chat_template}))
    return path
