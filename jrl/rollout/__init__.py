"""The sampler: prefill and `lax.while_loop` decode with a KV cache (`sampler`), the same
over a paged cache refilled as rows stop (`paged`), the response decoded in cache
segments (`segments`) and multi-turn rollouts with tools (`multi_turn`)."""
