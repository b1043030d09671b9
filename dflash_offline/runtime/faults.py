"""Fault points: the crash tests kill, fail or stall a process at a named point through the environment."""

from __future__ import annotations

import os
import signal
import time

from dflash_offline.runtime.logs import heartbeat, log
from dflash_offline.runtime.signals import stop_requested


# --------------------------------------------------------------------------------------------
# Fault points for crash tests


_fault_counts: dict[tuple[str, str], int] = {}

# Environment variable -> what happens on the N-th arrival at the named point.
FAULT_VARS = {"DFLASH_OFFLINE_KILL_AT": "kill", "DFLASH_OFFLINE_RAISE_AT": "raise", "DFLASH_OFFLINE_STALL_AT": "stall",
              "DFLASH_OFFLINE_DELAY_AT": "delay", "DFLASH_OFFLINE_HOLD_AT": "hold"}


class InjectedFault(RuntimeError):
    """Raised by an armed fault point (DFLASH_OFFLINE_RAISE_AT): a stand-in for any crash."""


def fault_point(name: str) -> None:
    """Crash tests' hook at an exact point (mid-shard, between a shard's rename and its commit,
    after a training step...). On the N-th arrival at `name`:
      DFLASH_OFFLINE_KILL_AT=name:N   SIGKILL of the whole process group;
      DFLASH_OFFLINE_RAISE_AT=name:N  an InjectedFault exception (the error path: logs, status);
      DFLASH_OFFLINE_STALL_AT=name:N  sleep for an hour (a process caught mid-run, for `status`);
      DFLASH_OFFLINE_DELAY_AT=name:S  sleep S seconds at *every* arrival (a slow run);
      DFLASH_OFFLINE_HOLD_AT=name:N   wait there until a stop is requested (at most 10 minutes),
                                      heartbeat phase "held at name": a signal lands mid-shard
                                      or mid-step, deterministically.
    DFLASH_OFFLINE_FAULT_RANK=R arms them only in the process whose RANK is R (a training rank;
    a process without RANK counts as 0): one rank fails, the others follow in broken collectives.
    Unset, it costs six dict lookups.
    """
    only = os.environ.get("DFLASH_OFFLINE_FAULT_RANK")
    if only is not None and os.environ.get("RANK", "0") != only:
        return
    for var, action in FAULT_VARS.items():
        spec = os.environ.get(var)
        if not spec:
            continue
        want, _, n = spec.partition(":")
        if want != name:
            continue
        if action == "delay":
            time.sleep(float(n))
            continue
        key = (action, name)
        _fault_counts[key] = _fault_counts.get(key, 0) + 1
        if _fault_counts[key] != int(n or 1):
            continue
        log.warning("fault point %s reached (%d): %s", name, _fault_counts[key], action)
        if action == "kill":
            time.sleep(0.05)
            os.killpg(os.getpgid(0), signal.SIGKILL)
        elif action == "raise":
            raise InjectedFault(f"injected failure at {name} ({var})")
        elif action == "hold":
            heartbeat(phase=f"held at {name}")
            t0 = time.monotonic()
            while stop_requested() is None and time.monotonic() - t0 < 600:
                time.sleep(0.05)
        else:
            heartbeat(phase=f"stalled at {name}")
            time.sleep(3600)


# --------------------------------------------------------------------------------------------
# Content faults for the cache's evidence tests

CORRUPT_VAR = "DFLASH_OFFLINE_CORRUPT"


def corrupted(hidden, embeddings):
    """What extraction is about to write, corrupted as DFLASH_OFFLINE_CORRUPT says (the tests of
    cache/evidence.py; unset, the tensor is returned as it is). `hidden` [N, n, H] (a torch tensor,
    changed in place), `embeddings` [N, H]; I, J are columns of the captured layers:
      zero-layer:I   layer I all zeros;            nan-vector:I  one NaN in layer I's middle vector;
      same-layer:I=J layer I a copy of layer J;    embed-layer:I layer I the token embeddings
    (and topk-from-layer:I, corrupted_topk's; recurrent-state:N, corrupt_recurrent_state's)."""
    spec = os.environ.get(CORRUPT_VAR)
    if not spec or spec.startswith(("topk-", "recurrent-")):
        return hidden
    what, _, arg = spec.partition(":")
    if what == "zero-layer":
        hidden[:, int(arg)] = 0
    elif what == "nan-vector":
        hidden[hidden.shape[0] // 2, int(arg), 0] = float("nan")
    elif what == "same-layer":
        i, j = map(int, arg.split("="))
        hidden[:, i] = hidden[:, j]
    elif what == "embed-layer":
        hidden[:, int(arg)] = embeddings.to(hidden.dtype)
    else:
        raise ValueError(f"{CORRUPT_VAR}={spec!r}: zero-layer:I, nan-vector:I, same-layer:I=J, embed-layer:I or "
                         "topk-from-layer:I")
    log.warning("%s=%s: the batch's layer outputs corrupted on purpose", CORRUPT_VAR, spec)
    return hidden


def corrupted_topk(model, hidden, topk_ids, topk_logprobs):
    """The batch's top-k, or with DFLASH_OFFLINE_CORRUPT=topk-from-layer:I the top-k of captured
    layer I put through the final norm and the LM head (a head fed the wrong layer)."""
    spec = os.environ.get(CORRUPT_VAR)
    if not spec or not spec.startswith("topk-from-layer:") or topk_ids is None:
        return topk_ids, topk_logprobs
    import torch

    with torch.inference_mode():
        logits = model.get_output_embeddings()(model.get_decoder().norm(hidden[:, int(spec.split(":")[1])])).float()
        v, i = torch.topk(logits, topk_ids.shape[1], dim=-1)
        lp = (v - torch.logsumexp(logits, dim=-1, keepdim=True)).to(topk_logprobs.dtype)
    log.warning("%s=%s: the batch's top-k taken from another layer on purpose", CORRUPT_VAR, spec)
    return i.to(topk_ids.dtype), lp


_rounds = [0]


def corrupt_recurrent_state(target) -> None:
    """With DFLASH_OFFLINE_CORRUPT=recurrent-state:N, at the N-th decoding round of this process,
    overwrite every recurrent state of the static decoder's target (`target.recurrent`: its Gated
    DeltaNet layers' states and convolution windows) with noise: a decoder whose state departed
    from the target's (eval's forensics tests)."""
    spec = os.environ.get(CORRUPT_VAR)
    if not spec or not spec.startswith("recurrent-state:"):
        return
    _rounds[0] += 1
    if _rounds[0] != int(spec.split(":")[1]):
        return
    for layer in target.recurrent:
        layer.state.normal_(0.0, 10.0)
        layer.window.normal_(0.0, 10.0)
    log.warning("%s=%s: the decoder's recurrent states overwritten on purpose", CORRUPT_VAR, spec)
