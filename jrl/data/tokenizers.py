"""Tokenizers: one interface, a built-in character tokenizer and HF tokenizers from a directory.

`CharTokenizer` needs no files: a fixed alphabet (digits, letters, space, newline
and common punctuation) plus `<pad>`, `<bos>`, `<eos>`, for synthetic tasks with the
`tiny` model preset (its vocabulary of 128 covers it).

`HFTokenizer.from_pretrained(dir)` reads a saved Hugging Face tokenizer with the
`tokenizers` library (`tokenizer.json`) and `tokenizer_config.json` (special tokens,
chat template), renders chat templates with jinja2 as transformers does, and takes
the stop tokens from `generation_config.json` when present. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import string
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from jrl.errors import ConfigError

Message = Mapping[str, Any]


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline, rollout and reward code need from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included (the model's may be larger)."""
        ...

    @property
    def pad_token_id(self) -> int: ...

    @property
    def eos_token_id(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """All ids that end a response (e.g. Llama 3 Instruct's <|eot_id|> and others)."""
        ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Chat-templated prompts already hold their special tokens,
        so none are added unless asked."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, **kwargs
    ) -> str:
        """The prompt text of a conversation `[{"role": ..., "content": ...}, ...]`."""
        ...


# --------------------------------------------------------------------------- CharTokenizer

CHAR_SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
CHAR_ALPHABET = (
    string.digits + string.ascii_lowercase + string.ascii_uppercase + " \n"
    + "+-*/=()#.,:?!'\"<>%$;_[]{}&|^~@\\`"
)
_CHAR_ROLES = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}


class CharTokenizer(Tokenizer):
    """One token per character of `CHAR_ALPHABET`; ids 0, 1, 2 are pad, bos, eos.

    Chat template: each message becomes "<Role>: <content>\\n" (System/User/Assistant)
    and the generation prompt is "Assistant: ". Template variables (`tools=`, ...) are
    ignored: tool schemas do not appear in its prompts.
    """

    def __init__(self):
        self._tokens = CHAR_SPECIAL_TOKENS + tuple(CHAR_ALPHABET)
        self._ids = {ch: i for i, ch in enumerate(self._tokens) if ch in CHAR_ALPHABET}

    vocab_size = property(lambda self: len(self._tokens))
    pad_token_id = property(lambda self: 0)
    bos_token_id = property(lambda self: 1)
    eos_token_id = property(lambda self: 2)
    eos_token_ids = property(lambda self: (2,))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids of the characters of `text` (with a leading `<bos>` if asked).

        Raises:
          ValueError: a character outside `CHAR_ALPHABET` (named, with its code point).
        """
        unknown = sorted({ch for ch in text if ch not in self._ids})
        if unknown:
            shown = ", ".join(f"{ch!r} (U+{ord(ch):04X})" for ch in unknown)
            raise ConfigError(f"CharTokenizer cannot encode {shown}; its alphabet is "
                              f"{CHAR_ALPHABET!r}")
        ids = [self._ids[ch] for ch in text]
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        num_special = len(CHAR_SPECIAL_TOKENS)
        return "".join(
            self._tokens[i] for i in map(int, ids)
            if not (skip_special_tokens and i < num_special)
        )

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, **kwargs
    ) -> str:
        lines = []
        for message in messages:
            role = message["role"]
            if role not in _CHAR_ROLES:
                raise ConfigError(f"unknown chat role {role!r}; expected one of "
                                  f"{sorted(_CHAR_ROLES)}")
            lines.append(f"{_CHAR_ROLES[role]}: {message['content']}\n")
        return "".join(lines) + ("Assistant: " if add_generation_prompt else "")


# --------------------------------------------------------------------------- HFTokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
# transformers' clean_up_tokenization: drop the space that word-level decoders put
# before punctuation and English contractions.
_CLEANUPS = (
    (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
    (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
)


def _token_content(token: Any) -> str | None:
    """tokenizer_config.json stores a special token as a string or an AddedToken dict."""
    if isinstance(token, Mapping):
        return token.get("content")
    return token


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template compiled the way transformers does (sandboxed, trimmed blocks)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _read_chat_template(path: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja, else tokenizer_config.json's key."""
    if (path / CHAT_TEMPLATE_FILE).is_file():
        return (path / CHAT_TEMPLATE_FILE).read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


def _read_generation_eos(path: Path) -> tuple[int, ...]:
    if not (path / GENERATION_CONFIG_FILE).is_file():
        return ()
    eos = json.loads((path / GENERATION_CONFIG_FILE).read_text()).get("eos_token_id")
    if eos is None:
        return ()
    return (eos,) if isinstance(eos, int) else tuple(eos)


class HFTokenizer(Tokenizer):
    """A saved Hugging Face fast tokenizer, read without transformers.

    Attributes beyond the interface: `bos_token_id` (or None), `special_tokens`
    (the special token strings from tokenizer_config.json), `chat_template` source.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        special_tokens: Mapping[str, str | None],
        chat_template: str | None = None,
        generation_eos_ids: Sequence[int] = (),
        clean_up_tokenization_spaces: bool = False,
        source: str = "<memory>",
    ):
        self._tokenizer = tokenizer
        self.special_tokens = dict(special_tokens)
        self.chat_template = chat_template
        self._template = compile_chat_template(chat_template) if chat_template else None
        self._clean_up = clean_up_tokenization_spaces
        self._source = source
        self.bos_token_id = self._id_of("bos_token", required=False)
        self._eos_token_id = self._id_of("eos_token", required=True)
        pad = self._id_of("pad_token", required=False)
        # Many base models have no pad token; padding is always masked, so EOS serves.
        self._pad_token_id = self._eos_token_id if pad is None else pad
        eos_ids = tuple(generation_eos_ids) or (self._eos_token_id,)
        if self._eos_token_id not in eos_ids:
            eos_ids += (self._eos_token_id,)
        self._eos_token_ids = eos_ids

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> HFTokenizer:
        """Loads `tokenizer.json`, `tokenizer_config.json` and, if present,
        `chat_template.jinja` and `generation_config.json` from a local directory.

        Raises:
          FileNotFoundError: the directory, tokenizer.json or tokenizer_config.json is
            missing (named).
        """
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer directory {str(path)!r} does not exist")
        for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
            if not (path / name).is_file():
                raise FileNotFoundError(
                    f"{name} not found in tokenizer directory {str(path)!r} "
                    f"(found: {sorted(p.name for p in path.iterdir())})"
                )
        config = json.loads((path / TOKENIZER_CONFIG_FILE).read_text())
        return cls(
            tokenizers.Tokenizer.from_file(str(path / TOKENIZER_FILE)),
            special_tokens={k: _token_content(config.get(k)) for k in _SPECIAL_TOKEN_KEYS},
            chat_template=_read_chat_template(path, config),
            generation_eos_ids=_read_generation_eos(path),
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces")),
            source=str(path),
        )

    def _id_of(self, key: str, required: bool) -> int | None:
        token = self.special_tokens.get(key)
        token_id = None if token is None else self._tokenizer.token_to_id(token)
        if token is not None and token_id is None:
            raise ConfigError(f"{key} {token!r} of {self._source} is not in its vocabulary")
        if required and token_id is None:
            raise ConfigError(f"{TOKENIZER_CONFIG_FILE} of {self._source} defines no {key}")
        return token_id

    vocab_size = property(lambda self: self._tokenizer.get_vocab_size(with_added_tokens=True))
    pad_token_id = property(lambda self: self._pad_token_id)
    eos_token_id = property(lambda self: self._eos_token_id)
    eos_token_ids = property(lambda self: self._eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self._tokenizer.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for before, after in _CLEANUPS:
                text = text.replace(before, after)
        return text

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, **kwargs
    ) -> str:
        """Renders the checkpoint's jinja chat template.

        Args:
          messages: `[{"role": ..., "content": ...}, ...]`.
          add_generation_prompt: end with the assistant turn's opening.
          **kwargs: extra template variables (e.g. `enable_thinking=False` for Qwen3).

        Raises:
          ValueError: the tokenizer has no chat template.
          jinja2.TemplateError: the template rejected the conversation.
        """
        if self._template is None:
            raise ConfigError(
                f"tokenizer {self._source} has no chat template (neither "
                f"{CHAT_TEMPLATE_FILE} nor 'chat_template' in {TOKENIZER_CONFIG_FILE})"
            )
        return self._template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            **{k: v for k, v in self.special_tokens.items() if v is not None}, **kwargs,
        )
