"""How far a stored feature may lie from the target's own, for the checks that compare them
(`verify --content`, `eval --parity`'s train-to-serve check).

The relative L2 error of a stored vector, |stored - fresh| / |fresh|, is bounded by its storage's
rounding (bf16 keeps 8 significant bits: half a step is 2^-9 of each element, 2^-8 is allowed;
fp8 e4m3 with its per-token scale: 2^-4 + 2^-12, cache/fp8.py) plus what a forward of other shapes
(another batch, a verify block, a recurrent step) rounds otherwise in its compute dtype.
No torch here.
"""

from __future__ import annotations

STORAGE_BOUND = {"bfloat16": 2.0 ** -8, "float8_e4m3fn": 2.0 ** -4 + 2.0 ** -12}
COMPUTE_ALLOWANCE = {"float32": 2.0 ** -12, "bfloat16": 2.0 ** -4, "float16": 2.0 ** -6}


def feature_bound(storage: str, compute: str) -> float:
    """The largest relative L2 error a stored vector may show against a forward in `compute`."""
    return STORAGE_BOUND[storage] + COMPUTE_ALLOWANCE[compute]
