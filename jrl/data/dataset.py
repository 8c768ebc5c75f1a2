"""Prompt datasets in verl's row schema, and a resumable, seeded batch iterator.

A row is a dict with verl's keys::

    {"prompt": str | [{"role": "user", "content": str}, ...],
     "data_source": str,
     "reward_model": {"ground_truth": str, ...},
     "extra_info": {...}}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from jrl.errors import ConfigError

Row = dict


def ground_truth(row: Row):
    """The row's `reward_model.ground_truth`, or None when the row has none."""
    return (row.get("reward_model") or {}).get("ground_truth")


@dataclasses.dataclass
class IteratorState:
    """Where the iterator stands: saved in checkpoints so a resumed run sees the same data."""

    epoch: int = 0
    position: int = 0  # index into the epoch's permutation


class BatchIterator:
    """Yields batches of rows, reshuffled every epoch with `seed + epoch`.

    The last incomplete batch of an epoch is dropped (verl's train loader does the same).
    """

    def __init__(self, rows: Sequence[Row], batch_size: int, seed: int, shuffle: bool = True,
                 state: IteratorState | None = None):
        if len(rows) < batch_size:
            raise ConfigError(
                f"data.train_batch_size={batch_size} is larger than the dataset ({len(rows)} rows)"
            )
        self.rows = rows
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.state = state or IteratorState()

    @property
    def batches_per_epoch(self) -> int:
        return len(self.rows) // self.batch_size

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    def next_batch(self) -> list[Row]:
        if self.state.position + self.batch_size > len(self.rows):
            self.state = IteratorState(epoch=self.state.epoch + 1, position=0)
        order = self._order(self.state.epoch)
        start = self.state.position
        batch = [self.rows[i] for i in order[start : start + self.batch_size]]
        self.state = IteratorState(self.state.epoch, start + self.batch_size)
        return batch


def prompt_text(tokenizer, row: Row, apply_chat_template: bool,
                tools: Sequence[Mapping] | None = None) -> str:
    """A row's prompt as the policy sees it, as text.

    A list of chat messages always goes through the chat template (with the
    generation prompt); a plain string does only when `apply_chat_template` is set,
    as a single user message. `tools` (the multi-turn tool schemas) go to the template
    as its `tools` variable, as verl's agent loop passes them (a template that does not
    use it, such as the character tokenizer's, renders the same text); a plain string
    without the template shows none.
    """
    prompt = row["prompt"]
    if apply_chat_template or not isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        kwargs = {"tools": list(tools)} if tools else {}
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    return prompt


def prompt_token_ids(tokenizer, row: Row, apply_chat_template: bool,
                     tools: Sequence[Mapping] | None = None) -> list[int]:
    """Token ids of a row's prompt, as the policy sees it (`prompt_text`)."""
    return tokenizer.encode(prompt_text(tokenizer, row, apply_chat_template, tools))


def encode_prompts(tokenizer, rows: Sequence[Row], max_prompt_length: int,
                   apply_chat_template: bool, tools: Sequence[Mapping] | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded prompt ids and mask `[B, max_prompt_length]` (`prompt_text`).

    A prompt longer than `max_prompt_length` stops with an error naming the row.
    """
    ids = np.full((len(rows), max_prompt_length), tokenizer.pad_token_id, np.int32)
    mask = np.zeros((len(rows), max_prompt_length), np.int32)
    for i, row in enumerate(rows):
        tokens = prompt_token_ids(tokenizer, row, apply_chat_template, tools)
        if len(tokens) > max_prompt_length:
            raise ConfigError(
                f"prompt of row {i} ({row.get('data_source')}) has {len(tokens)} tokens, more "
                f"than data.max_prompt_length={max_prompt_length}"
            )
        ids[i, max_prompt_length - len(tokens):] = tokens
        mask[i, max_prompt_length - len(tokens):] = 1
    return ids, mask
