"""Rotary position embeddings (RoPE) with optional Llama 3 or linear frequency scaling.

Uses the "rotate half" layout of the HF Llama/Qwen checkpoints: the head vector is
split into a first and a second half, and pair i is (x[i], x[i + H/2]), rotated by
angle `position * inv_freq[i]` (Su et al. 2021, https://arxiv.org/abs/2104.09864).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jrl.models import gemma
from jrl.models.config import LinearRopeScaling, ModelConfig, RopeScaling


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """Per-pair rotation speeds `theta ** (-2i / H)`, Llama-3- or linearly scaled if
    configured.

    Returns:
      float32 array `[H/2]`.
    """
    exponents = np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if isinstance(config.rope_scaling, LinearRopeScaling):
        inv_freq = inv_freq / config.rope_scaling.factor
    elif config.rope_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, config.rope_scaling)
    return inv_freq.astype(np.float32)


def _llama3_scale(inv_freq: np.ndarray, scaling: RopeScaling) -> np.ndarray:
    """Llama 3 scaling: slow down long wavelengths, keep short ones, blend between."""
    wavelength = 2 * math.pi / inv_freq
    old_len = scaling.original_max_position_embeddings
    long_wavelength = old_len / scaling.low_freq_factor
    short_wavelength = old_len / scaling.high_freq_factor
    # 0 at the long-wavelength edge of the band, 1 at the short-wavelength edge.
    smooth = (old_len / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = np.where(wavelength > long_wavelength, inv_freq / scaling.factor, inv_freq)
    in_band = (wavelength >= short_wavelength) & (wavelength <= long_wavelength)
    return np.where(in_band, blended, scaled)


def sin_cos(positions_bt: jax.Array, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Rotation sines and cosines for integer positions, in float32.

    Args:
      positions_bt: int `[B, T]`, the RoPE position of each token.
      config: supplies head_dim, theta and scaling.

    Returns:
      (sin_btk, cos_btk), each float32 `[B, T, H/2]`.
    """
    angles_btk = positions_bt.astype(jnp.float32)[..., None] * inverse_frequencies(config)
    return jnp.sin(angles_btk), jnp.cos(angles_btk)


def apply_rope(x_btnh: jax.Array, sin_btk: jax.Array, cos_btk: jax.Array) -> jax.Array:
    """Rotates each head vector of `x_btnh` `[B, T, N, H]`; returns the same shape and dtype."""
    x1, x2 = jnp.split(x_btnh.astype(jnp.float32), 2, axis=-1)
    sin, cos = sin_btk[:, :, None, :], cos_btk[:, :, None, :]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_btnh.dtype)


def sin_cos_by_layer_type(positions_bt: jax.Array, config: ModelConfig):
    """`sin_cos`, or where sliding layers have a RoPE base of their own (Gemma 3's
    `rope_local_base_freq`, never scaled) a `gemma.LayerTypes` pair of each table."""
    sin_btk, cos_btk = sin_cos(positions_bt, config)
    if config.rope_local_base_freq is None:
        return sin_btk, cos_btk
    local = dataclasses.replace(config, rope_theta=config.rope_local_base_freq,
                                rope_scaling=None)
    local_sin_btk, local_cos_btk = sin_cos(positions_bt, local)
    return (gemma.LayerTypes(sin_btk, local_sin_btk), gemma.LayerTypes(cos_btk, local_cos_btk))
