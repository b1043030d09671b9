"""What `eval`'s decoders feed the drafter when serving, against what it trained on (the cache).

A drafter that validates well and serves badly most often sees other features when serving than
in training: another layer definition, a dtype, a decoder path (a hybrid's recurrent verify forward
against extraction's chunked one). For a cached sample (prompt + completion) decoded teacher-forced,
the drafter receives the prompt's features from a prefill and the completion's from verify
forwards of G-token blocks (the anchor and the drafts) with every token kept. Those are computed
here through each decoder eval can run, in the eval dtype:

  static        targets/static.StaticTarget, the static decoder's own layers (the recurrent state
                of a verify block deferred, then settled at the kept length);
  transformers  evaluate.speculative.TargetSession, transformers' forward with its caches;

and each layer's largest relative L2 error against the stored vectors is held against
cache/bounds.py's bound (the storage's rounding plus the dtype's allowance).
"""

from __future__ import annotations

import numpy as np
import torch

from dflash_offline.evaluate.speculative import TargetSession
from dflash_offline.targets import static
from dflash_offline.targets.static import StaticTarget

PATHS = ("static", "transformers")


def served(model, path: str, layer_ids: list[int], ids: list[int], prompt_len: int, block: int) -> np.ndarray:
    """The features [T, n, H] (float32) `path` gives the drafter for a sequence of T tokens: a
    prefill of its first `prompt_len`, then verify forwards of `block` tokens, every one kept."""
    T, n = len(ids), len(layer_ids)
    device = next(model.parameters()).device
    parts = []
    with torch.inference_mode():
        if path == "static":
            target = StaticTarget(model, layer_ids, rows=1, capacity=T + block)
            target.reset()
            x = torch.tensor([ids], dtype=torch.long, device=device)
            pos = torch.arange(T, device=device)[None]
            one = torch.ones(1, dtype=torch.long, device=device)
            _, f = target.forward(x[:, :prompt_len], pos[:, :prompt_len], features=True, keep=one * prompt_len,
                                  span=prompt_len)
            parts.append(f[0])
            for a in range(prompt_len, T, block):
                b = min(a + block, T)
                _, f = target.forward(x[:, a:b], pos[:, a:b], features=True)
                target.settle(one * (b - a))
                parts.append(f[0])
        elif path == "transformers":
            session = TargetSession(model, layer_ids)
            parts.append(session.start(ids[:prompt_len])[1])
            for a in range(prompt_len, T, block):
                parts.append(session.forward(ids[a:a + block])[1])
        else:
            raise ValueError(f"unknown decoder path {path!r}; known: {', '.join(PATHS)}")
    return torch.cat(parts).float().cpu().numpy().reshape(T, n, -1)


def paths_for(model) -> list[str]:
    """The decoder paths eval can run for this target (the static one only where it runs it)."""
    return [p for p in PATHS if p != "static" or static.unsupported_reason(model) is None]


def relative_errors(stored: np.ndarray, got: np.ndarray) -> np.ndarray:
    """Per layer, the largest relative L2 error of a vector: stored and got [T, n, H] -> [n]."""
    norms = np.maximum(np.linalg.norm(stored, axis=-1), 1e-30)
    return np.nan_to_num((np.linalg.norm(got - stored, axis=-1) / norms).max(axis=0), nan=np.inf)
