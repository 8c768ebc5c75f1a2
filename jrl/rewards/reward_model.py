"""A reward model on the device: a HF `*ForSequenceClassification` checkpoint.

The reward model keeps its own tokenizer and chat template. Each response is
scored as the conversation `prompt messages + {"role": "assistant", "content":
response}` rendered by that template (no generation prompt), as verl's reward
model worker re-templates responses; the score is the `score` head's output at
the last real token (HF's readout). A string prompt counts as one user message.

Conversations are padded to `max_length` tokens (right padding by default, as
verl; left padding gives the same scores) and scored by one jitted program over
the whole batch, optionally in micro-batches under `lax.map` to bound memory.
A conversation longer than `max_length` is cut by the `truncation` policy:

* "right": keep the first `max_length` tokens (verl's default);
* "left": keep the last `max_length` tokens, so the end of the response survives;
* "error": stop with an error naming the sample.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jrl import sharding
from jrl.data.dataset import Row
from jrl.data.tokenizers import HFTokenizer, Tokenizer
from jrl.models import forward, load_pretrained, positions_from_mask, sequence_scores
from jrl.models.config import ModelConfig

TRUNCATION = ("right", "left", "error")
PADDING = ("right", "left")


@functools.partial(jax.jit, static_argnames=("config", "micro_batch_size"))
def _score_program(params, tokens_bt, mask_bt, *, config: ModelConfig,
                   micro_batch_size: int):
    """float32 `[B]` scores; B is a multiple of `micro_batch_size`."""

    def micro(batch):
        tokens, mask = batch
        hidden_btd, _ = forward(params, tokens, positions_from_mask(mask), mask, config=config)
        return sequence_scores(params, hidden_btd, mask)

    num_tokens = tokens_bt.shape[1]
    split = (-1, micro_batch_size, num_tokens)
    scores = jax.lax.map(micro, (tokens_bt.reshape(split), mask_bt.reshape(split)))
    return scores.reshape(-1)


class RewardModel:
    """Scores (prompt, response) pairs with a sequence-classification checkpoint.

    Args:
      config: the reward model's architecture.
      params: its parameters, with a `score` head (`kernel [D, 1]`).
      tokenizer: the reward model's tokenizer, with a chat template.
      max_length: tokens per conversation after padding/truncation.
      truncation: "right", "left" or "error" (module docstring).
      padding: "right" or "left".
      micro_batch_size: conversations per forward pass (None: the whole batch).
    """

    def __init__(self, config: ModelConfig, params, tokenizer: Tokenizer, max_length: int, *,
                 truncation: str = "right", padding: str = "right",
                 micro_batch_size: int | None = None):
        if "score" not in params:
            raise ValueError("reward model params have no 'score' head; load a "
                             "*ForSequenceClassification checkpoint with num_labels=1")
        if truncation not in TRUNCATION:
            raise ValueError(f"truncation={truncation!r}; expected one of {TRUNCATION}")
        if padding not in PADDING:
            raise ValueError(f"padding={padding!r}; expected one of {PADDING}")
        if max_length < 1 or (micro_batch_size is not None and micro_batch_size < 1):
            raise ValueError(f"max_length={max_length} and micro_batch_size="
                             f"{micro_batch_size} must be positive")
        self.config, self.params, self.tokenizer = config, params, tokenizer
        self.max_length, self.truncation, self.padding = max_length, truncation, padding
        self.micro_batch_size = micro_batch_size

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, max_length: int, *,
                        tokenizer_path: str | os.PathLike | None = None,
                        dtype: str = "float32", **kwargs) -> RewardModel:
        """Loads weights (safetensors) and tokenizer from local directories.

        Args:
          path: checkpoint directory of a `*ForSequenceClassification` model.
          max_length: tokens per conversation.
          tokenizer_path: tokenizer directory; defaults to `path`.
          dtype: parameter and compute dtype.
          **kwargs: `truncation`, `padding`, `micro_batch_size`.

        Raises:
          ValueError: the checkpoint is not a one-label sequence classifier.
          FileNotFoundError: missing checkpoint or tokenizer files (named).
        """
        config, params = load_pretrained(path, dtype)
        if "score" not in params:
            raise ValueError(f"{path} is a causal LM checkpoint; a reward model must be a "
                             "*ForSequenceClassification checkpoint with num_labels=1")
        tokenizer = HFTokenizer.from_pretrained(tokenizer_path or path)
        return cls(config, params, tokenizer, max_length, **kwargs)

    def conversation_ids(self, row: Row, response: str) -> list[int]:
        """Token ids of the prompt's messages plus the response as the assistant turn."""
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        messages = [*messages, {"role": "assistant", "content": response}]
        return self.tokenizer.encode(
            self.tokenizer.apply_chat_template(messages, add_generation_prompt=False))

    def _fit(self, ids: list[int], index: int) -> list[int]:
        if len(ids) <= self.max_length:
            return ids
        if self.truncation == "error":
            raise ValueError(
                f"reward model input of sample {index} has {len(ids)} tokens, more than "
                f"max_length={self.max_length}; raise max_length or set truncation to "
                "'left' or 'right'")
        return ids[:self.max_length] if self.truncation == "right" else ids[-self.max_length:]

    def encode(self, rows: Sequence[Row], texts: Sequence[str], n: int
               ) -> tuple[np.ndarray, np.ndarray]:
        """Padded token ids and mask, int32 `[N, max_length]`; sample i answers rows[i // n]."""
        if len(texts) != len(rows) * n:
            raise ValueError(f"{len(texts)} responses for {len(rows)} prompts with n={n}")
        tokens = np.full((len(texts), self.max_length), self.tokenizer.pad_token_id, np.int32)
        mask = np.zeros((len(texts), self.max_length), np.int32)
        for i, text in enumerate(texts):
            ids = self._fit(self.conversation_ids(rows[i // n], text), i)
            span = slice(0, len(ids)) if self.padding == "right" else slice(
                self.max_length - len(ids), self.max_length)
            tokens[i, span], mask[i, span] = ids, 1
        return tokens, mask

    def score_tokens(self, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """float32 `[N]` scores of padded conversations (one jitted program)."""
        num = tokens.shape[0]
        if num == 0:
            return np.zeros(0, np.float32)
        micro = min(self.micro_batch_size or num, num)
        pad = -num % micro
        if pad:  # fill the last micro-batch with copies of row 0; their scores are dropped
            tokens = np.concatenate([tokens, np.repeat(tokens[:1], pad, 0)])
            mask = np.concatenate([mask, np.repeat(mask[:1], pad, 0)])
        # The reward model runs unsharded on this process's default device, whatever
        # mesh the trainer has active.
        with sharding.inactive():
            scores = _score_program(self.params, jnp.asarray(tokens), jnp.asarray(mask),
                                    config=self.config, micro_batch_size=micro)
        return np.asarray(scores, np.float32)[:num]

    def score(self, rows: Sequence[Row], texts: Sequence[str], n: int) -> np.ndarray:
        """float32 `[N]` reward-model scores of the responses; sample i answers rows[i // n]."""
        return self.score_tokens(*self.encode(rows, texts, n))
