"""Fresh traces for tests that patch a function into a jitted program."""

import functools

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr


def retrace(monkeypatch, module):
    """Makes every program `module.jit_sampler` jits trace afresh at each call (JAX keeps
    traces per function), so that a function patched in takes effect, without clearing
    the caches of the whole test process (`jax.clear_caches`)."""
    jit_sampler = module.jit_sampler

    def fresh(fun, sampling, **jit_kwargs):
        @functools.wraps(fun)
        def call(*args, **kwargs):
            return fun(*args, **kwargs)
        return jit_sampler(call, sampling, **jit_kwargs)

    monkeypatch.setattr(module, "jit_sampler", fresh)


def decode_masks(monkeypatch, module) -> dict:
    """Patches `module.forward` to record the mask of every decode step (one token a
    row; the prefill and multi-turn blocks feed more) in the returned dict, by its write
    slot, as the program runs (read it after `jax.effects_barrier()`); with `retrace`,
    so the programs are traced through the patch."""
    masks, forward = {}, module.forward

    def recording(params, tokens, positions, key_mask, cache, write_index, **kw):
        if tokens.shape[1] == 1:
            jax.debug.callback(lambda m, w: masks.__setitem__(int(w), np.asarray(m)),
                               key_mask, write_index)
        return forward(params, tokens, positions, key_mask, cache, write_index, **kw)

    monkeypatch.setattr(module, "forward", recording)
    retrace(monkeypatch, module)
    return masks


def equations(jaxpr: Jaxpr):
    """Every equation of `jaxpr` and of the programs inside it (a scan's body once)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub
                if isinstance(sub, Jaxpr):
                    yield from equations(sub)
