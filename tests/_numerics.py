"""Distances in units of the last place, for comparing stored values against a reference forward."""

from __future__ import annotations

import numpy as np


def _ordered(bits: np.ndarray, sign: int) -> np.ndarray:
    """Map IEEE bit patterns to integers whose order and spacing follow the represented values."""
    x = bits.astype(np.int64)
    return np.where(x & sign, sign - (x & (sign - 1)), sign + x)


def bf16_ulps(a_bits: np.ndarray, b_bits: np.ndarray) -> np.ndarray:
    """|a - b| in bf16 ulps, for uint16 arrays holding bfloat16 bits."""
    return np.abs(_ordered(a_bits, 0x8000) - _ordered(b_bits, 0x8000))


def fp16_ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| in fp16 ulps, for float16 arrays."""
    return np.abs(_ordered(a.view(np.uint16), 0x8000) - _ordered(b.view(np.uint16), 0x8000))


def bf16_close(stored_bits: np.ndarray, ref_bits: np.ndarray) -> np.ndarray:
    """Elementwise: within 1 bf16 ulp of the reference value (relative spacing 2**-8), or within
    2**-8 of the row's RMS for values near zero, where ulps shrink and count meaningless steps."""
    a = (stored_bits.astype(np.uint32) << 16).view(np.float32)
    b = (ref_bits.astype(np.uint32) << 16).view(np.float32)
    rms = np.sqrt((b.astype(np.float64) ** 2).mean(axis=-1, keepdims=True))
    return np.abs(a - b) <= 2.0**-8 * np.abs(b) + 2.0**-8 * rms
