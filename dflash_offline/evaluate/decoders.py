"""Which decoder runs `eval --prompts`, chosen once for the target and used for the target alone
and for every drafter alike (a speed-up compares like with like).

  static        evaluate.graphed: the target's own layers over preallocated key/value buffers,
                each round one CUDA graph on a GPU; one prompt at a time (--batch-size 1) or
                batched. Full-attention and Gated DeltaNet hybrid targets (targets/families.py).
  transformers  transformers' forward with its caches: one prompt at a time (evaluate.speculative),
                KV-cache batches with per-row recurrent-state rollback (evaluate.kv_batch; hybrid
                targets), or, for sliding-window targets, whole sequences re-run each round
                (evaluate.batched, greedy only).

`--decoder auto` takes static where the target allows it; the report and the log say which ran
and, when it is not static, why. Each kind implements one interface, `Decoder.decode_all`
(graphed.StaticDecoder, and OneAtATime, KVBatched, Rerun below), and `Decoders.decoder` picks it.
"""

from __future__ import annotations

import logging
from typing import Protocol

from dflash_offline.evaluate import kv_batch
from dflash_offline.targets import static
from dflash_offline.evaluate.config import AS_FLAGS, Said
from dflash_offline.evaluate.speculative import (Decoded, DFlashProposer, TargetSession, greedy_decode,
                                                 speculative_decode)
from dflash_offline.runtime.errors import UserError
from dflash_offline.sampling import Sampling

log = logging.getLogger("dflash.eval")


class Decoders:
    """The target alone and speculative decoding of a list of prompts, by the chosen decoder."""

    def __init__(self, model, choice: str, batch_size: int, max_prompt_len: int, max_new: int, eos: set[int],
                 sampling: Sampling, device: str, dtype: str, said: Said = AS_FLAGS):
        self.model, self.batch_size, self.max_new, self.eos = model, batch_size, max_new, eos
        self.max_prompt_len, self.sampling, self.device, self.dtype = max_prompt_len, sampling, device, dtype
        why_not = static.unsupported_reason(model)
        if choice == "static" and why_not is not None:
            raise UserError(f"{said('decoder')} static cannot run this target: {why_not}; use --decoder transformers "
                            "(or auto)")
        self.static = choice != "transformers" and why_not is None
        self.choice, self.why_not = choice, why_not
        self.kv_reason = kv_batch.unsupported_reason(model) if batch_size > 1 and not self.static else None
        if self.kv_reason is not None and not sampling.greedy:
            raise UserError(f"{said('temperature')} {sampling.temperature}: this target is decoded in batches by "
                            f"re-running whole sequences ({self.kv_reason}), which decodes greedily only; use "
                            "--batch-size 1")
        shape = "one prompt at a time" if batch_size == 1 else f"{batch_size} prompts per forward"
        if self.static:
            graphs = " with CUDA graphs" if device.startswith("cuda") else ""
            self.name, self.describe = "static", f"static buffers{graphs}, {shape}"
        elif batch_size == 1:
            self.name, self.describe = "transformers", f"transformers caches, {shape}"
        elif self.kv_reason is None:
            self.name, self.describe = "transformers", f"transformers KV caches, {shape}"
        else:
            self.name, self.describe = "transformers-rerun", f"whole sequences re-run each round ({self.kv_reason}), {shape}"
        if not self.static:
            reason = "--decoder transformers" if choice == "transformers" else why_not
            log.warning("decoding through transformers' forward, not the static decoder: %s", reason)
        self._sessions: dict[tuple, TargetSession] = {}

    def check_drafters(self, drafters) -> None:
        """A DSpark drafter decodes through the static decoder only (its Markov head drafts left to
        right inside the round): one line before any decoding."""
        dspark = [p for p, d in drafters if d.cfg.method == "dspark"]
        if dspark and not self.static:
            why = ("--decoder transformers was chosen: use --decoder auto or static" if self.choice == "transformers"
                   else f"this target cannot run the static decoder ({self.why_not})")
            raise UserError(f"{dspark[0]} is a DSpark drafter, which decodes through the static decoder only; {why}")

    def _rows(self, n: int) -> int:
        return max(1, min(self.batch_size, n))

    def _session(self, target_layers) -> TargetSession:
        key = tuple(target_layers)
        if key not in self._sessions:
            self._sessions[key] = TargetSession(self.model, list(target_layers))
        return self._sessions[key]

    def decoder(self, drafter, n_prompts: int) -> Decoder:
        """The chosen decoder for `n_prompts` prompts, speculative with `drafter` or the target
        alone (None): every kind answers `decode_all` the same way."""
        import torch

        target_layers = drafter.cfg.target_layer_ids if drafter is not None else []
        if self.static:
            from dflash_offline.evaluate.graphed import StaticDecoder

            if drafter is not None:
                drafter = drafter.to(device=self.device, dtype=getattr(torch, self.dtype)).eval()
            return StaticDecoder(self.model, drafter, self._rows(n_prompts), self.max_prompt_len, self.max_new,
                                 self.eos, self.sampling)
        if self.batch_size > 1 and self.kv_reason is None:
            proposer = (kv_batch.NoDrafts() if drafter is None
                        else kv_batch.KVBatchDFlashProposer(drafter, self.device, self.dtype))
            return KVBatched(self.model, proposer, target_layers, self.max_new, self.eos, self.batch_size, self.sampling)
        if self.batch_size > 1 and drafter is not None:
            from dflash_offline.evaluate.batched import BatchDFlashProposer

            return Rerun(self.model, BatchDFlashProposer(drafter, self.device, self.dtype), target_layers, self.max_new,
                         self.eos, self.batch_size)
        # One prompt at a time (also the target alone where batches would re-run whole sequences).
        proposer = DFlashProposer(drafter, self.device, self.dtype) if drafter is not None else None
        return OneAtATime(self._session(target_layers), proposer, self.max_new, self.eos, self.sampling)

    def target_alone(self, prompts: list[list[int]], keys: list[int], on_batch) -> list[Decoded]:
        return self.decoder(None, len(prompts)).decode_all(prompts, keys, on_batch)

    def speculative(self, drafter, prompts: list[list[int]], keys: list[int], on_batch) -> list[Decoded]:
        self.check_drafters([("the drafter", drafter)])
        return self.decoder(drafter, len(prompts)).decode_all(prompts, keys, on_batch)


class Decoder(Protocol):
    """What every decoder does: decode `prompts` (each with its sampling key), calling `on_batch`
    with each finished group of results, and return one Decoded per prompt in order.
    Implemented by graphed.StaticDecoder and the three below."""

    def decode_all(self, prompts: list[list[int]], keys: list[int], on_batch) -> list[Decoded]: ...


class OneAtATime:
    """transformers' caches, one prompt at a time (evaluate.speculative); the target alone when
    `proposer` is None."""

    def __init__(self, session: TargetSession, proposer: DFlashProposer | None, max_new: int, eos: set[int],
                 sampling: Sampling):
        self.session, self.proposer, self.max_new, self.eos, self.sampling = session, proposer, max_new, eos, sampling

    def decode_all(self, prompts: list[list[int]], keys: list[int], on_batch) -> list[Decoded]:
        runs = []
        for p, k in zip(prompts, keys):
            if self.proposer is None:
                runs.append(greedy_decode(self.session, p, self.max_new, self.eos, self.sampling, k))
            else:
                runs.append(speculative_decode(self.session, self.proposer, p, self.max_new, self.eos, self.sampling, k))
            on_batch(runs[-1:])
        return runs


class KVBatched:
    """transformers' KV caches, many prompts per forward, with per-row recurrent-state rollback
    (evaluate.kv_batch); the target alone with `kv_batch.NoDrafts`."""

    def __init__(self, model, proposer, target_layers: list[int], max_new: int, eos: set[int], batch_size: int,
                 sampling: Sampling):
        self.model, self.proposer, self.target_layers = model, proposer, target_layers
        self.max_new, self.eos, self.batch_size, self.sampling = max_new, eos, batch_size, sampling

    def decode_all(self, prompts: list[list[int]], keys: list[int], on_batch) -> list[Decoded]:
        return kv_batch.kv_batched_decode(self.model, self.proposer, self.target_layers, prompts, self.max_new, self.eos,
                                          self.batch_size, on_batch, self.sampling, keys)


class Rerun:
    """Whole sequences re-run each round, many prompts per forward (evaluate.batched): sliding-window
    targets, greedy only (Decoders refuses a temperature first), so the keys are not used."""

    def __init__(self, model, proposer, target_layers: list[int], max_new: int, eos: set[int], batch_size: int):
        self.model, self.proposer, self.target_layers = model, proposer, target_layers
        self.max_new, self.eos, self.batch_size = max_new, eos, batch_size

    def decode_all(self, prompts: list[list[int]], keys: list[int], on_batch) -> list[Decoded]:
        from dflash_offline.evaluate.batched import batched_speculative_decode

        return batched_speculative_decode(self.model, self.proposer, self.target_layers, prompts, self.max_new, self.eos,
                                          self.batch_size, on_batch)
