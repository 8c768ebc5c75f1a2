"""Functional key/value cache for decoding, and the attention masks built around it.

The cache contract (what `jrl.rollout.sampler` relies on)
------------------------------------------------

The cache is a pytree (`KVCache`) that `forward` takes and returns; nothing is kept
in Flax collections. It holds one key and one value buffer per layer,
`k[l], v[l]: [B, K, S, H]`, S = `max_len` slots (heads before slots, so a decode
step reads each head's keys as one contiguous `[S, H]` block). Separate buffers,
not one `[L, ...]` stack, let a decode step hand a layer's keys to an attention
kernel in place: slicing a layer out of a stack would copy it at every step.
Slot s of every row holds the token fed at step s, so all rows share one write
position.

Prompts are LEFT-padded to a common length P, so the last prompt token of every
row sits in slot P-1 and decoding writes every row's next token to the same slot:

1. `cache = init_cache(config, B, max_len)`; `key_mask = zeros [B, max_len]`.
2. Prefill: `key_mask[:, :P] = prompt_mask`;
   `hidden, cache = forward(params, prompt_tokens [B,P], positions [B,P], key_mask,
   cache, write_index=0)`. Tokens are written to slots 0..P-1.
3. Decode step i (slot `w = P + i`): `key_mask[:, w] = 1` (or 0 for rows that no
   longer matter); `hidden, cache = forward(params, tokens [B,1], positions [B,1],
   key_mask, cache, write_index=w)`. `write_index` is one scalar for all rows.

Rules:
- `positions` are RoPE positions: the number of valid tokens before the token in
  its row (`positions_from_mask`), so left padding does not shift them. In decode
  step i a row's position is `prompt_len[b] + i`.
- `key_mask [B, S]` marks which slots hold real tokens (1 = valid) and must already
  include the slots being written by this call. Unwritten slots must be 0.
- A query at slot `write_index + t` attends to slots `s <= write_index + t` with
  `key_mask[b, s] == 1` (causal + padding + unwritten slots masked out), and to its
  own slot (which only matters for padding queries, whose outputs are garbage).
- `write_index + T <= max_len`; `lax.dynamic_update_slice` would otherwise clamp the
  write silently (checked when `write_index` is a Python int).
- A row's real tokens fill contiguous slots: its left padding, then every token up
  to the one being written (the sampler's layout). The decode-attention kernel
  (`jrl.kernels.decode_attention`) relies on it: it writes the new token's key and
  value itself and reads the blocks of each row that hold slots `[first valid slot,
  write_index)`, with no `key_mask` (it masks the rest of those blocks by position).

Sliding-window layers (Gemma's local layers) may hold a ring buffer instead
(`init_cache(..., ring=True)`): W = `min(sliding_window, S)` slots, slot s kept at
index `s mod W`, so that such a layer's cache costs its window, not the sequence
(`layer_slots`). `key_mask` still spans all S slots: a layer whose buffer is shorter
than the mask is a ring, and its attention reads the mask's columns of the slots its
entries hold (`ring_slots`). A query's window is counted in tokens of the row, so a
ring holds every key it needs only where a row's tokens fill contiguous slots: the
single-turn sampler's cache, not a multi-turn one (whose rows wait) nor one moved
between segments; those keep full buffers.

A `PagedCache` (the paged sampler's, `jrl.rollout.paged`) keeps the same slots in
fixed-size pages of a shared pool, found through each row's block table, with a write
index per row; attention reads a row's pages gathered back into its `[K, S, H]` slots,
or in place (the paged decode kernels).

Without a cache (training, scoring) `forward` takes `mask [B, T]` over the tokens
themselves and applies the same causal + padding rule within the T tokens.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from jrl.models import gemma
from jrl.models.config import ModelConfig
from jrl.sharding import constrain

# Logical axis names of each layer's cache buffer, for `jrl.sharding`.
CACHE_LOGICAL_AXES = ("batch", "kv_heads", "cache_length", "head_dim")


def write_slots(buffer_bksh: jax.Array, new_bkth: jax.Array, write_index) -> jax.Array:
    """One layer's buffer `[B, K, S, H]` with `new_bkth` (T tokens) written at slots
    `write_index..` in the buffer's dtype; in place under jit, so a decode step's
    memory traffic is one token per layer."""
    return lax.dynamic_update_slice(buffer_bksh, new_bkth.astype(buffer_bksh.dtype),
                                    (0, 0, write_index, 0))


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer.

    Attributes:
      k: L buffers `[B, K, S, H]`, keys after RoPE (and q/k norm), in the cache dtype.
      v: L buffers `[B, K, S, H]`, values.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def max_len(self) -> int:
        """S, the slots of the full-length layers (ring buffers are shorter)."""
        return max(k.shape[2] for k in self.k)

    def write(self, layer: int, write_index: jax.Array, k_btkh, v_btkh) -> KVCache:
        """Writes one layer's new keys/values `[B, T, K, H]` at slots write_index.. ."""
        k_bksh, v_bksh = (write_slots(buffer, jnp.swapaxes(new_btkh, 1, 2), write_index)
                          for buffer, new_btkh in zip(self.layer(layer), (k_btkh, v_btkh),
                                                      strict=True))
        return self.replace_layer(layer, k_bksh, v_bksh)

    def write_ring(self, layer: int, write_index: jax.Array, k_btkh, v_btkh) -> KVCache:
        """`write` for a ring buffer of W slots: slot s goes to index `s mod W`; of T > W
        new tokens only the last W are kept (the others would be overwritten)."""
        slots = self.k[layer].shape[2]
        num = k_btkh.shape[1]
        kept = min(num, slots)

        def put(buffer_bksh, new_btkh):
            new_bksh = jnp.swapaxes(new_btkh[:, num - kept:], 1, 2)
            if kept == 1:  # a decode step: in place
                return write_slots(buffer_bksh, new_bksh, write_index % slots)
            new_bksh = new_bksh.astype(buffer_bksh.dtype)
            index = (write_index + num - kept + jnp.arange(kept)) % slots
            # Distinct, so declared unique (a scatter's elements otherwise go by atomics on
            # a GPU: `PagedCache.write`).
            return buffer_bksh.at[:, :, index].set(new_bksh, unique_indices=True)

        return self.replace_layer(layer, *(put(buffer, new) for buffer, new in
                                           zip(self.layer(layer), (k_btkh, v_btkh),
                                               strict=True)))

    def replace_layer(self, layer: int, k_bksh: jax.Array, v_bksh: jax.Array) -> KVCache:
        """The cache with layer `layer`'s buffers replaced (as a kernel returned them)."""
        put = lambda buffers, new: buffers[:layer] + (new,) + buffers[layer + 1:]
        return self.replace(k=put(self.k, k_bksh), v=put(self.v, v_bksh))

    def layer(self, layer: int) -> tuple[jax.Array, jax.Array]:
        """(k_bksh, v_bksh) of one layer."""
        return self.k[layer], self.v[layer]


@flax.struct.dataclass
class RowCache(KVCache):
    """A cache of C rows for a batch of B rows that need not be the same rows: the
    rows still running hold a cache row, the others none (`jrl.rollout.segments`).

    A decode step's `forward` takes it in place of a `KVCache`: everything but the
    attention runs on the batch; the attention's per-row operands are gathered into
    the cache's rows (`to_cache_rows`), appended and attended there, and its output
    gathered back to the batch (`to_batch_rows`), zeros for rows with no cache row.
    The rows are split into G groups (the batch shards): a group's batch rows map
    into the same group's cache rows, so no row leaves its shard.

    Attributes:
      cache_rows: int32 `[G, B / G]`, each batch row's cache row within its group;
        C / G where it has none.
      batch_rows: int32 `[G, C / G]`, each cache row's batch row within its group;
        B / G where it has none (`inverse_rows`).
      softmax_slots: the slots the XLA attention's softmax runs over (the cache's when
        fewer; the scores of the slots past the cache's are masked), so that it runs
        at the shape of the single program, whose cache has them
        (`decode_attention.grouped_attention`).
    """

    cache_rows: jax.Array
    batch_rows: jax.Array
    softmax_slots: int = flax.struct.field(pytree_node=False, default=0)

    def to_cache_rows(self, x: jax.Array, axes) -> jax.Array:
        """Rows `[B, ...]` of the batch (logical `axes`, "batch" first) as the cache's
        `[C, ...]`; a cache row with no batch row takes an arbitrary one."""
        return take_rows(x, self.batch_rows, axes, "clip")

    def to_batch_rows(self, x: jax.Array, axes) -> jax.Array:
        """Rows `[C, ...]` of the cache as the batch's `[B, ...]`; zeros for a batch row
        with no cache row."""
        return take_rows(x, self.cache_rows, axes, "fill")

    def with_batch(self, order_gb: jax.Array) -> RowCache:
        """The cache for the batch whose rows within each group are `order_gb`
        (`[G, B' / G]`, indices of the current batch's rows): the same cache rows, each
        mapped to its row's new place (none where its row left the batch)."""
        cache_rows = jnp.take_along_axis(self.cache_rows, order_gb, axis=1)
        return self.replace(cache_rows=cache_rows,
                            batch_rows=inverse_rows(cache_rows, self.batch_rows.shape[1]))


# The page every unused block-table entry names: written by rows that hold no page
# there (padding, slots with no sequence), never attended (their key mask is 0).
TRASH_PAGE = 0


@flax.struct.dataclass
class PagedCache(KVCache):
    """A cache of fixed-size pages shared by B rows through a block table (the paged
    sampler's, `jrl.rollout.paged`).

    Attention sees the contiguous cache's slots (the "logical" layout: left-padded
    prompt, then the response), so a row's keys, values and scores are those of the
    contiguous cache at the same slots. The pages hold each row compactly: logical slot
    s of row b is the row's physical slot `s - shift[b]` (its first real token at
    physical slot 0, padding nowhere), at offset `p mod page` of page
    `block_table[b, p // page]`. A row thus holds pages only for its real tokens, and a
    kernel reads them as a sequence that starts at its first page (`lengths`, with no
    padding to mask). `view` gathers a row's pages back into the logical layout;
    the decode kernels read them in place (`decode_attention.paged_attention`).
    `write_index` is per row, `[B]` (rows written at different slots in one step).

    Attributes:
      k, v: L pools `[K, num_pages, page, H]` (the pages of each key/value head
        together, as Pallas' TPU paged attention takes them).
      block_table: int32 `[B, pages_per_row]`; `TRASH_PAGE` where the row holds none.
      shift: int32 `[B]`, each row's left padding: logical slot of its physical slot 0.
      num_slots: S, the slots of a row (`max_len`); `pages_per_row * page >= S`.
    """

    block_table: jax.Array = None
    shift: jax.Array = None
    num_slots: int = flax.struct.field(pytree_node=False, default=0)

    @property
    def max_len(self) -> int:
        return self.num_slots

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]

    def _pages(self, slots_bt):
        """The pages and offsets `[B, T]` of the rows' logical slots `slots_bt`; the trash
        page for padding (physical slots below 0)."""
        physical = slots_bt - self.shift[:, None]
        pages = jnp.take_along_axis(self.block_table,
                                    jnp.maximum(physical, 0) // self.page_size, axis=1)
        return jnp.where(physical >= 0, pages, TRASH_PAGE), physical % self.page_size

    def write(self, layer: int, write_index: jax.Array, k_btkh, v_btkh) -> PagedCache:
        """Writes one layer's new keys/values `[B, T, K, H]` of row b at its logical slots
        `write_index[b] + t` (padding into the trash page)."""
        num = k_btkh.shape[1]
        slots_bt = jnp.asarray(write_index, jnp.int32).reshape(-1, 1) + jnp.arange(num)
        pages_bt, offsets_bt = self._pages(slots_bt)
        # Declared unique: otherwise XLA's GPU scatter writes each element with an atomic
        # read-modify-write, for 16-bit elements a compare-and-swap loop on their 32-bit
        # word, which neighbouring elements and every row writing the trash page at the
        # same offset (padding, decode slots without a row, rows that sit out a step)
        # contend for. Rows' own slots are distinct; the trash page's writes race, and
        # its contents are never attended.
        put = lambda pool, new: pool.at[:, pages_bt, offsets_bt].set(
            jnp.moveaxis(new, 2, 0).astype(pool.dtype), unique_indices=True)
        return self.replace_layer(layer, put(self.k[layer], k_btkh), put(self.v[layer], v_btkh))

    def view(self, layer: int) -> tuple[jax.Array, jax.Array]:
        """Layer `layer`'s keys and values in the logical layout, `[B, K, S, H]` each:
        every row's slots gathered from its pages (padding slots from the trash page)."""
        slots_bs = jnp.broadcast_to(jnp.arange(self.num_slots, dtype=jnp.int32),
                                    (self.block_table.shape[0], self.num_slots))
        pages_bs, offsets_bs = self._pages(slots_bs)
        gather = lambda pool: jnp.moveaxis(pool[:, pages_bs, offsets_bs], 0, 1)
        # Materialised, as the contiguous cache is: fused into the attention's matmuls as
        # their operand, a gather makes XLA:CPU emit them as its own loops, which sum in
        # another order than the matmul of a materialised cache (other bits).
        return lax.optimization_barrier((gather(self.k[layer]), gather(self.v[layer])))


def init_pool(config: ModelConfig, num_pages: int, page_size: int,
              dtype: str | None = None) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """The zero pools `(k, v)` of a `PagedCache`: L buffers `[K, num_pages, page_size, H]`
    each."""
    shape = (config.num_kv_heads, num_pages, page_size, config.head_dim)
    zeros = lambda: tuple(jnp.zeros(shape, dtype or config.dtype)
                          for _ in range(config.num_layers))
    return zeros(), zeros()


def inverse_rows(rows_gb: jax.Array, size: int) -> jax.Array:
    """int32 `[G, size]`: for each index i of a group, the position of i in that group's
    `rows_gb` (`[G, B]`, distinct values, those >= `size` ignored); B where none."""
    groups, num = rows_gb.shape
    inverse = jnp.full((groups, size), num, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(num, dtype=jnp.int32), rows_gb.shape)
    return jax.vmap(lambda inv, i, p: inv.at[i].set(p, mode="drop"))(inverse, rows_gb,
                                                                      positions)


def take_rows(x: jax.Array, index_gr: jax.Array, axes, mode: str) -> jax.Array:
    """The rows `index_gr` (`[G, R]`, indices within each group) of `x` `[G n, ...]`:
    `[G R, ...]`, each group gathering within its own shard; out of range: clipped or
    zeros (`mode` "clip" or "fill")."""
    groups = index_gr.shape[0]
    grouped = constrain(x.reshape(groups, -1, *x.shape[1:]), (axes[0], None, *axes[1:]))
    fill = {"fill_value": 0} if mode == "fill" else {}
    take = lambda rows, index: jnp.take(rows, index, axis=0, mode=mode, **fill)
    taken = jax.vmap(take)(grouped, index_gr)
    return constrain(taken.reshape(-1, *x.shape[1:]), axes)


def layer_slots(config: ModelConfig, max_len: int, ring: bool = False) -> tuple[int, ...]:
    """Each layer's cache slots: `max_len`, or with `ring` `min(sliding_window, max_len)`
    for the sliding-window layers (`config.layer_types`) of a model that also has
    global layers: the cache's length (`KVCache.max_len`) is its longest buffer's."""
    sliding = [ring and t == gemma.SLIDING for t in config.layer_types or ()]
    sliding += [False] * (config.num_layers - len(sliding))
    if all(sliding):
        sliding = [False] * len(sliding)
    return tuple(min(config.sliding_window, max_len) if s else max_len for s in sliding)


def ring_slots(last_slot, num_slots: int) -> jax.Array:
    """int32 `[W]`: the slot each index of a ring buffer of W = `num_slots` entries holds
    once slots up to `last_slot` are written, `last_slot - ((last_slot - j) mod W)`; < 0
    for an index not written yet."""
    j = jnp.arange(num_slots, dtype=jnp.int32)
    return last_slot - (last_slot - j) % num_slots


def init_cache(
    config: ModelConfig, batch_size: int, max_len: int, dtype: str | None = None,
    ring: bool = False,
) -> KVCache:
    """An empty cache of `max_len` slots per row.

    Args:
      config: supplies L, K and H.
      batch_size: B.
      max_len: S, prompt length plus the most tokens to generate.
      dtype: buffer dtype; defaults to the compute dtype `config.dtype`.
      ring: the sliding-window layers' buffers as rings of their window (module
        docstring); for caches whose rows' tokens fill contiguous slots.

    Returns:
      `KVCache` with L zero buffers `[B, K, S_l, H]` each in `k` and `v`, S_l from
      `layer_slots`.
    """
    dtype = dtype or config.dtype
    shapes = [(batch_size, config.num_kv_heads, slots, config.head_dim)
              for slots in layer_slots(config, max_len, ring)]
    zeros = lambda: tuple(constrain(jnp.zeros(shape, dtype), CACHE_LOGICAL_AXES)
                          for shape in shapes)
    return KVCache(k=zeros(), v=zeros())


def positions_from_mask(mask_bt: jax.Array) -> jax.Array:
    """RoPE positions of left- (or right-) padded tokens: valid tokens before each one.

    Padding gets position 0 (its value does not matter; it is masked out).

    Args:
      mask_bt: `[B, T]`, 1 for real tokens.

    Returns:
      int32 `[B, T]`.
    """
    mask_bt = mask_bt.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(mask_bt, axis=1) - 1, 0)


def attention_mask(
    key_mask_bs: jax.Array, num_queries: int, write_index: jax.Array | int | None
) -> jax.Array:
    """Boolean mask `[B, 1, T, S]`: which key slots each query may attend to.

    Args:
      key_mask_bs: `[B, S]` validity of keys (1 = real token).
      num_queries: T.
      write_index: slot of the first query (a scalar, or `[B]` one per row); None when
        there is no cache, in which case S == T and query t sits at slot t.

    Returns:
      bool `[B, 1, T, S]` (broadcast over heads): causal, valid keys only, plus
      each query's own slot.
    """
    first = 0 if write_index is None else write_index
    per_row = jnp.ndim(first) > 0  # a write index per row (a `PagedCache`'s)
    # [B, T, 1] per row, else [T, 1] for every row.
    query_slot_t1 = (first[:, None] + jnp.arange(num_queries))[:, :, None] if per_row else \
        (first + jnp.arange(num_queries))[:, None]
    slot_1s = jnp.arange(key_mask_bs.shape[1])[None, :]
    causal = slot_1s <= query_slot_t1
    allowed_bts = (causal if per_row else causal[None]) & key_mask_bs.astype(bool)[:, None, :]
    # Every query may also see its own slot, so a padding query never has an all-masked
    # row: cuDNN's backward pass returns garbage gradients for such rows. Real queries
    # are unaffected (their own slot is valid anyway).
    own = slot_1s == query_slot_t1
    return (allowed_bts | (own if per_row else own[None]))[:, None]
