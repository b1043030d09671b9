"""How far a stored feature may lie from the target's own, for the checks that compare them
(`verify --content`, `eval --parity`'s train-to-serve check).

The relative L2 error of a stored vector, |stored - fresh| / |fresh|, is bounded by its storage's
rounding (bf16 keeps 8 significant bits: rounding moves an element by at most half a step, 2^-8
of its leading power of two, so at most 2^-8 of it; fp8 e4m3 with its per-token scale: 2^-4 +
2^-12, cache/fp8.py) plus what a forward of other shapes (another batch, a verify block, a
recurrent step) rounds otherwise in its compute dtype; where the two forwards compared ran in
different dtypes (a cache extracted in bf16, an fp32 eval), the coarser one's. No torch here.
"""

from __future__ import annotations

STORAGE_BOUND = {"bfloat16": 2.0 ** -8, "float8_e4m3fn": 2.0 ** -4 + 2.0 ** -12}
COMPUTE_ALLOWANCE = {"float32": 2.0 ** -12, "bfloat16": 2.0 ** -4, "float16": 2.0 ** -6}


def feature_bound(storage: str, *computes: str) -> float:
    """The largest relative L2 error a stored vector may show against a forward, the forwards
    compared having run in `computes` (the coarsest one's allowance counts)."""
    return STORAGE_BOUND[storage] + max(COMPUTE_ALLOWANCE[c] for c in computes)
