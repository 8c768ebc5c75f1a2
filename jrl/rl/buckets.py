"""Response-length buckets: a micro-batch costs what its longest response needs.

Responses are right-padded to `R = rollout.response_length` columns, and a forward
or backward over `[b, P + R]` pays for every padded column. Rows that stop early
leave their columns after the stop unused. With buckets, the rows of a pass are
sorted by their used length (the last attended response column + 1), cut into
micro-batches, and each micro-batch runs on the first `r` response columns only,
where `r` is the smallest of a few static lengths (the buckets, evenly spaced up
to `R`) that holds its longest row. A `lax.switch` picks the bucket at run time,
so the pass stays one compiled program with static shapes; each bucket is one
more compiled copy of the micro-batch's body. Columns after a row's last attended
one never influence the columns before them (causal attention), so the outputs
are those of the full-length pass, up to floating-point summation order, and the
per-token outputs are padded back to `R` columns with zeros.

This is jrl's counterpart of verl's `use_remove_padding` + `use_dynamic_bsz` for
the padding after the responses: static shapes instead of a varying token count.
Prompt padding (left) is not trimmed. Where the rows of a prompt share its forward
(`jrl.rl.logprobs`, `group`), they are sorted and bucketed as one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

Array = jax.Array

# Bucket lengths are multiples of this (whole tiles for the matmuls; even lengths for
# cuDNN's attention backward), except the last, which is R.
_MULTIPLE = 16
# Arrays of a micro-batch dict that are not response-aligned.
PROMPT_KEYS = ("prompt_ids", "prompt_mask", "prompt_routing")


def sizes(response_length: int, num_buckets: int) -> tuple[int, ...]:
    """The bucket lengths: `num_buckets` evenly spaced lengths up to `response_length`,
    rounded up to multiples of 16, duplicates dropped; `(R,)` for one bucket."""
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
    out = []
    for k in range(1, num_buckets + 1):
        size = min(-(-response_length * k // num_buckets // _MULTIPLE) * _MULTIPLE,
                   response_length)
        if size > 0 and size not in out:
            out.append(size)
    out[-1] = response_length
    return tuple(out)


def used_lengths(attention_mask_br: Array) -> Array:
    """int32 `[B]`: one past each row's last attended response column (0 if none)."""
    r = attention_mask_br.shape[-1]
    cols = jnp.arange(1, r + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(attention_mask_br > 0, cols, 0), axis=-1)


def sort_order(lengths_b: Array, group: int = 1) -> Array:
    """A permutation of the rows by used length (stable), so micro-batches of
    consecutive rows hold similar lengths. With `group` k > 1, runs of k consecutive
    rows (the samples of one prompt) move together, ordered by their longest row."""
    if group == 1:
        return jnp.argsort(lengths_b, stable=True)
    order = jnp.argsort(jnp.max(lengths_b.reshape(-1, group), axis=1), stable=True)
    return expand_groups(order, group)


def expand_groups(group_order: Array, group: int) -> Array:
    """A permutation of runs of `group` rows as a permutation of the rows."""
    return (group_order[:, None] * group + jnp.arange(group)).reshape(-1)


def trim(tree, r: int, prompt_keys: Sequence[str] = PROMPT_KEYS):
    """A micro-batch dict with every response-aligned array (`[b, R, ...]`, all but
    `prompt_keys` and per-row vectors) cut to its first `r` columns."""
    return {k: v if k in prompt_keys or v is None or v.ndim < 2 else v[:, :r]
            for k, v in tree.items()}


def pad_columns(tree, response_length: int, value=0):
    """Per-token outputs `[b, r, ...]` padded with `value` (zeros) to `[b, R, ...]`."""
    def pad(x):
        widths = [(0, 0)] * x.ndim
        widths[1] = (0, response_length - x.shape[1])
        return jnp.pad(x, widths, constant_values=value)

    return jax.tree.map(pad, tree)


def switch(length: Array, bucket_sizes: Sequence[int], branch: Callable[[int], Callable],
           *operands):
    """`branch(r)(*operands)` for the smallest bucket `r >= length` (a `lax.switch`).

    Args:
      length: int scalar, the longest used length among the rows the operands hold.
      bucket_sizes: increasing static lengths, the last the full R.
      branch: maps a static length to the function to run at that length; every
        branch must return the same structure and shapes.
      *operands: passed to the chosen branch.
    """
    if len(bucket_sizes) == 1:
        return branch(bucket_sizes[0])(*operands)
    index = jnp.searchsorted(jnp.asarray(bucket_sizes, jnp.int32), length, side="left")
    index = jnp.minimum(index, len(bucket_sizes) - 1)
    return jax.lax.switch(index, [branch(r) for r in bucket_sizes], *operands)
