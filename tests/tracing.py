"""Fresh traces for tests that patch a function into a jitted program."""

import functools


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
