"""A GGUF file's rotary scaling, as the `rope_scaling` dict of a Hugging Face config.

llama.cpp keeps rope scaling in two places. Linear and YaRN scaling are
metadata (`{arch}.rope.scaling.type`, `.factor`, `.original_context_length`).
Llama 3.1 scaling is not: its converter writes the per-frequency divisors
themselves as a tensor, `rope_freqs.weight` (llama.cpp divides each rotary
frequency by its entry). Those divisors are a function of four parameters,
which are recovered here and checked by recomputing every divisor, so that
kvserve's own Llama 3 rope (kvserve.model.layers.common) runs exactly what the file
says. Anything else is passed on by its name and refused there
(ModelConfig.from_dict lists the supported types).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

from kvserve.model.checkpoint.errors import ModelLoadError
from kvserve.model.checkpoint.gguf_file import field

ROPE_FREQS = "rope_freqs.weight"
RTOL = 1e-4
"""Divisors are float32 in the file: recomputed ones must agree to this relative tolerance."""


def rope_scaling(reader: GGUFReader, arch: str, theta: float, head_dim: int) -> dict | None:
    """The HF `rope_scaling` dict of the file, or None for plain rope."""
    kind = field(reader, f"{arch}.rope.scaling.type")
    factor = field(reader, f"{arch}.rope.scaling.factor")
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:
        if kind not in (None, "none"):
            raise ModelLoadError(
                f"{ROPE_FREQS} together with rope scaling {kind!r} is not supported"
            )
        divisors = dequantize(freqs.data, freqs.tensor_type).astype(np.float64).reshape(-1)
        return llama3_from_divisors(divisors, theta, head_dim)
    if kind in (None, "none"):
        legacy = field(reader, f"{arch}.rope.scale_linear")  # written before scaling.type existed
        if legacy is None or legacy == 1.0:
            return None
        kind, factor = "linear", legacy
    scaling: dict[str, Any] = {"rope_type": kind}
    if factor is not None:
        scaling["factor"] = float(factor)
    original = field(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    if kind == "yarn":
        for key, hf_key in (
            ("attn_factor", "attention_factor"),
            ("yarn_beta_fast", "beta_fast"),
            ("yarn_beta_slow", "beta_slow"),
        ):
            value = field(reader, f"{arch}.rope.scaling.{key}")
            if value is not None:
                scaling[hf_key] = float(value)
    return scaling


def llama3_divisors(
    theta: float, head_dim: int, factor: float, low: float, high: float, original: float
) -> np.ndarray:
    """What llama.cpp's converter writes to rope_freqs for Llama 3.1 scaling (one per pair)."""
    inv_freq = theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    divisors = 1.0 / ((1 - smooth) / factor + smooth)
    divisors = np.where(wavelen < original / high, 1.0, divisors)
    return np.where(wavelen > original / low, factor, divisors)


def llama3_from_divisors(divisors: np.ndarray, theta: float, head_dim: int) -> dict | None:
    """Llama 3.1 rope parameters that give exactly these divisors (None: all ones).

    Only the two band edges (wavelengths original / high_freq_factor and
    original / low_freq_factor) and the factor shape the divisors, so the
    original context length is taken as an integer near the fitted one and
    the two frequency factors follow from it.
    """
    if divisors.shape != (head_dim // 2,):
        raise ModelLoadError(
            f"{ROPE_FREQS} has {divisors.size} entries; head_dim {head_dim} needs {head_dim // 2}"
        )
    if np.allclose(divisors, 1.0, rtol=RTOL):
        return None
    factor = float(divisors.max())
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ones = np.isclose(divisors, 1.0, rtol=RTOL)
    full = np.isclose(divisors, factor, rtol=RTOL)
    band = ~(ones | full)
    edges = _band_edges(divisors, wavelen, factor, ones, full, band)
    if edges is not None:
        high_wavelen, low_wavelen = edges
        original = max(1, round(low_wavelen))
        low_freq_factor, high_freq_factor = original / low_wavelen, original / high_wavelen
        params = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": original,
        }
        again = llama3_divisors(
            theta, head_dim, factor, low_freq_factor, high_freq_factor, original
        )
        if np.allclose(again, divisors, rtol=RTOL):
            return params
    raise ModelLoadError(
        f"{ROPE_FREQS} holds rotary frequency divisors that are not Llama 3 scaling; "
        "only Llama 3 rope_freqs are supported"
    )


def _band_edges(
    divisors: np.ndarray,
    wavelen: np.ndarray,
    factor: float,
    ones: np.ndarray,
    full: np.ndarray,
    band: np.ndarray,
) -> tuple[float, float] | None:
    """(high-frequency edge, low-frequency edge) as wavelengths, or None when none fits.

    In the band, s = (original / wavelen - low) / (high - low) is a straight
    line in 1 / wavelen: two points fix it, and the edges are where s is 1
    and 0. With fewer points the edges only need to fall between the
    neighbouring wavelengths, and any choice there gives the same divisors.
    """
    smooth = (1.0 / divisors[band] - 1.0 / factor) / (1.0 - 1.0 / factor)
    if band.sum() >= 2:
        slope, intercept = np.polyfit(1.0 / wavelen[band], smooth, 1)
        if slope <= 0 or intercept >= 0:
            return None
        # s = slope / w + intercept: 1 at w = slope / (1 - intercept), 0 at w = -slope / intercept
        return slope / (1.0 - intercept), -slope / intercept
    last_one = wavelen[ones].max() if ones.any() else wavelen.min() / 2
    first_full = wavelen[full].min() if full.any() else wavelen.max() * 2
    if not band.any():
        ratio = first_full / last_one
        return last_one * ratio ** (1 / 3), last_one * ratio ** (2 / 3)
    # One point inside the band: put the low edge halfway (geometrically) to the next
    # wavelength, then the high edge where the line through that point says.
    w = float(wavelen[band][0])
    low_wavelen = math.sqrt(w * first_full)
    high_wavelen = low_wavelen / (1 + (low_wavelen / w - 1) / float(smooth[0]))
    return high_wavelen, low_wavelen
