"""Rotary position embeddings (Su et al. 2021) as Llama, Mistral and Qwen2 apply them: each head's
features rotated in pairs (i, i + d/2) by an angle of position x frequency, on the heads each
device holds, so the model axis adds nothing. The frequencies are fixed numbers of the config,
with the context-extension rules Llama 3.1 (`llama3`) and others (`linear`) use; they are
computed in float32 as transformers computes them, so imported models give its logits."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from megajax.model_config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """(head_dim / 2,) float32 angular frequencies, after the config's scaling."""
    d = cfg.head_dim
    inv = 1.0 / (
        np.float32(cfg.rope_theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))
    )
    inv = inv.astype(np.float32)
    if cfg.rope_scaling == "linear":
        return (inv / np.float32(cfg.rope_factor)).astype(np.float32)
    if cfg.rope_scaling == "llama3":
        factor, low, high = (
            np.float32(v)
            for v in (cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor)
        )
        context = np.float32(cfg.rope_original_context)
        wavelength = np.float32(2 * np.pi) / inv
        scaled = np.where(wavelength > context / low, inv / factor, inv).astype(np.float32)
        # Between the two wavelengths a blend of the scaled and the original frequency.
        smooth = (context / wavelength - low) / (high - low)
        blended = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
        medium = (wavelength >= context / high) & (wavelength <= context / low)
        return np.where(medium, blended, scaled).astype(np.float32)
    return inv


def rotary_angles(cfg: ModelConfig, positions):
    """(cos, sin) of (positions..., head_dim / 2) angles, float32; `positions` may be traced
    (a KV cache's offset)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inverse_frequencies(cfg))
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x, cos, sin):
    """x (b, heads, s, d) rotated at its positions (cos, sin: (s, d/2)), in float32, returned
    in x's dtype: the halves (x1, x2) become (x1 cos - x2 sin, x2 cos + x1 sin)."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
