"""The frozen target: what it is (read from its folder without torch), loading only what is needed,
and one batched forward that captures decoder-layer outputs and chunked top-k log-probabilities.

Capture points are forward hooks on the chosen decoder layers: their *raw outputs*, as serving
engines capture them. HF's `hidden_states[i + 1]` is the same tensor for every layer but the last,
where transformers returns the output after the final norm; evaluation therefore uses the same
hooks (LayerCapture), never `output_hidden_states`. When no logits are wanted, the model is built with only
`max(layer_ids) + 1` layers, so the rest of the stack and the LM head are never loaded or run.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import sys

from dflash_offline.options import also, where
from dflash_offline.targets.folder import TargetInfo, checkpoint_name, tensor_entries
from dflash_offline.runtime.errors import UserError
from dflash_offline.targets import families

log = logging.getLogger("dflash.target")

def default_layer_ids(num_target_layers: int, n: int = 5) -> list[int]:
    """The DFlash rule: n ids spread from layer 1 to layer L-3, `round(1 + k (L-4) / (n-1))`."""
    if n == 1:
        return [1]
    # floor(x + 0.5): round half up, not Python's round-half-to-even.
    return [int(1 + k * (num_target_layers - 4) / (n - 1) + 0.5) for k in range(n)]


def _rule_limit(num_target_layers: int) -> int:
    """The most layers the DFlash rule spreads over this depth without repeating one."""
    return max(n for n in range(1, num_target_layers + 1) if len(set(default_layer_ids(num_target_layers, n))) == n)


def resolve_layers(info: TargetInfo, cfg) -> list[int]:
    """The target layer ids to capture: `cfg.capture_layers`, or the DFlash rule's
    `cfg.capture_count` (extract's and plan's configs); messages name the option as given."""
    layers, n = cfg.capture_layers, cfg.capture_count
    if layers is None:
        if info.num_target_layers < 5:
            raise UserError(f"target has {info.num_target_layers} layers, too few for the DFlash rule to pick "
                            f"{where(cfg, 'capture_count')} {n} (it spreads them over layers 1..L-3 of L >= 5); give "
                            f"{also(cfg, 'capture_layers')} explicitly")
        ids = default_layer_ids(info.num_target_layers, n)
        if len(set(ids)) < len(ids):
            count = where(cfg, "capture_count")
            raise UserError(f"{count} {n}: the DFlash rule spreads the captured layers over layers "
                            f"1..{info.num_target_layers - 3} of this {info.num_target_layers}-layer target and would repeat one "
                            f"({ids}); lower it (at most {_rule_limit(info.num_target_layers)} here) or give distinct "
                            f"{also(cfg, 'capture_layers')}")
    else:
        ids = list(layers)
    bad = [i for i in ids if i < 0 or i >= info.num_target_layers]
    if bad:
        raise UserError(f"{where(cfg, 'capture_layers')} {ids}: layer {bad[0]} does not exist; the target has layers "
                        f"0..{info.num_target_layers - 1}")
    if ids != sorted(ids):
        raise UserError(f"{where(cfg, 'capture_layers')} {ids}: give layer ids in increasing order")
    return ids


def check_topk(info: TargetInfo, topk: int, option: str = "--topk") -> None:
    if topk > info.vocab_size:
        raise UserError(f"{option} must be at most the target's vocabulary ({info.vocab_size} tokens), got {topk}; "
                        "the default is 32")


def check_kernels(info: TargetInfo, devices: list[str]) -> str | None:
    """For a hybrid target on CUDA, the loud warning when the fast Gated DeltaNet kernels are missing."""
    if not any(d.startswith("cuda") for d in devices):
        return None
    wanted = families.kernels({"layer_types": list(info.layer_types)})
    missing = [k for k in wanted if importlib.util.find_spec(k.module) is None]
    if not missing:
        return None
    how = [k.install for k in missing]
    return (
        f"hybrid target ({info.model_type}) on CUDA without {' and '.join(k.package for k in missing)}: transformers "
        f"falls back to "
        f"PyTorch kernels for the Gated DeltaNet layers (a 16-layer Qwen3.5-27B-shaped model: 25,000 instead of "
        f"36,300 tokens/s on an H200 without fla). Install: {'; '.join(how)}"
    )


# ----------------------------------------------------------------------------------------------
# Loading (torch from here on)


def _dtype(name: str, device: str):
    import torch

    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, name)


_KERNEL_FUNCS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")


def route_cpu_tensors_to_torch_kernels(model) -> int:
    """Send CPU tensors of hybrid layers to transformers' PyTorch reference kernels.

    transformers binds Gated DeltaNet / causal-conv functions to flash-linear-attention and
    causal-conv1d at import time when those packages are installed, and their Triton/CUDA kernels
    fail on CPU tensors ("Pointer argument cannot be accessed from Triton"). The fix wraps each
    bound function of the model's modeling module with a dispatcher: CUDA tensors keep the fast
    kernel, CPU tensors take the original PyTorch function (`__wrapped__`). Returns how many
    functions were wrapped (0 for dense targets or when nothing is bound to a fast kernel).
    """
    import torch

    wrapped = 0
    modules = {sys.modules[type(m).__module__] for m in model.modules()}
    for mod in modules:
        for name in _KERNEL_FUNCS:
            fn = getattr(mod, name, None)
            ref = getattr(fn, "__wrapped__", None)
            if fn is None or ref is None or getattr(fn, "_dflash_routed", False):
                continue

            def dispatch(*args, _fast=fn, _ref=ref, **kwargs):
                first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                if first is None:
                    first = next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
                if first is not None and first.device.type == "cpu":
                    return _ref(*args, **kwargs)
                return _fast(*args, **kwargs)

            functools.update_wrapper(dispatch, fn)
            dispatch._dflash_routed = True
            setattr(mod, name, dispatch)
            wrapped += 1
    return wrapped


def _text_config(info: TargetInfo, keep_layers: int, need_head: bool):
    from transformers import AutoConfig

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        config = AutoConfig.from_pretrained(info.path).get_text_config()
    except Exception as e:  # transformers' own checks of the config's values (layer_types vs layers, ...)
        import transformers

        what = "; ".join(ln.strip() for ln in str(e).splitlines() if ln.strip()) or type(e).__name__
        if info.model_type not in CONFIG_MAPPING:  # not a damaged file: a model transformers does not know
            raise UserError(f"{info.option} {info.path}: transformers {transformers.__version__} cannot build it as a "
                            f"causal language model ({what[:200]}); give a decoder-only causal LM as the target") from None
        raise UserError(f"{info.path / 'config.json'}: transformers {transformers.__version__} refuses it ({what[:300]}); "
                        "fix the file or download the model again") from None
    if keep_layers < config.num_hidden_layers:
        config.num_hidden_layers = keep_layers
        if getattr(config, "layer_types", None):
            config.layer_types = list(config.layer_types[:keep_layers])
    config._attn_implementation = "sdpa"
    config.use_cache = False
    if not need_head:
        # Tie the unused head to the embedding: no [vocab, hidden] matrix is allocated for it
        # (2.5 GB in bf16 for a 248K x 5120 head), and nothing reads it.
        config.tie_word_embeddings = True
    return config


def check_weights(info: TargetInfo, keep_layers: int, need_head: bool) -> None:
    """Before any worker starts: every tensor the run needs is in the safetensors files with the
    shape the config implies (the model is built on the meta device: no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its advice for non-decoder models would precede our one line
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(_text_config(info, keep_layers, need_head))
    except (ValueError, KeyError) as e:  # a model_type or config transformers cannot build as a causal LM
        import transformers

        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{info.option} {info.path}: transformers {transformers.__version__} cannot build it as a causal "
                        f"language model ({first[:200]}); give a decoder-only causal LM as the target") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    wanted = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if not any(k.startswith("model.layers.") for k in wanted) or "model.embed_tokens.weight" not in wanted:
        kind = type(model).__name__
        raise UserError(f"{info.option} {info.path}: a {kind}, not a decoder-only language model with model.embed_tokens "
                        "and model.layers (the Llama/Qwen layout the drafter reads); give such a model as the target")
    found = tensor_entries(info.weight_files)
    for name, shape in wanted.items():
        if name == "lm_head.weight" and (not need_head or info.tie_word_embeddings):
            continue
        if name not in found:
            raise UserError(f"{info.option} {info.path}: no tensor for {name} in the safetensors files; is the folder complete?")
        fname, key, got = found[name].file, found[name].key, found[name].shape
        if got != shape:
            raise UserError(f"{info.option} {info.path}: {fname} holds {key} with shape {got}, but config.json implies {shape}")


def load_target(info: TargetInfo, device: str, compute_dtype: str, keep_layers: int, need_head: bool):
    """Build the text causal LM with `keep_layers` layers on `device` and load its weights.

    Returns the model in eval mode. Weights of dropped layers, vision towers and MTP heads are not
    read. The LM head is loaded only when `need_head`.
    """
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    dtype = _dtype(compute_dtype, device)
    config = _text_config(info, keep_layers, need_head)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval().requires_grad_(False)
    if info.hybrid:
        route_cpu_tensors_to_torch_kernels(model)
    wanted = model.state_dict()
    loaded: set[str] = set()
    for f in info.weight_files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for key in sf.keys():
                name = checkpoint_name(key)
                if name not in wanted:
                    continue  # vision tower, MTP head, dropped layers, or the head we do not need
                if name.startswith("lm_head.") and not need_head:
                    continue
                t = sf.get_tensor(key)
                if tuple(t.shape) != tuple(wanted[name].shape):
                    raise UserError(f"{f.name}: tensor {key} has shape {tuple(t.shape)}, the config implies {tuple(wanted[name].shape)}")
                with torch.no_grad():
                    wanted[name].copy_(t)
                loaded.add(name)
    missing = [k for k in wanted if k not in loaded]
    if "lm_head.weight" in missing and (info.tie_word_embeddings or not need_head):
        missing.remove("lm_head.weight")
        if info.tie_word_embeddings:
            model.lm_head.weight = model.get_input_embeddings().weight
    if missing:
        raise UserError(f"{info.option} {info.path}: weights missing for {len(missing)} tensors, e.g. {missing[:3]}")
    log.info("target loaded on %s: %d of %d layers, head %s, dtype %s", device, keep_layers,
             info.num_target_layers, "on" if need_head else "off", dtype)
    return model


def layer_output(output):
    """A decoder layer's output tensor (some transformers versions return a tuple)."""
    return output[0] if isinstance(output, tuple) else output


class LayerCapture:
    """Forward hooks on the chosen decoder layers, the one way their outputs are captured. Each
    layer's raw output is copied into `stage` when one is set (extraction's [B, S, n, H] staging
    tensor: one copy, no second buffer), else kept for `features()`, the outputs concatenated
    [B, T, n*H] in `layer_ids` order (what eval's decoders feed the drafter: the features
    extraction stores and serving engines capture). Held (`remove()` at the end) or used as
    `with LayerCapture(model, ids) as raw: model(...)`, hooks removed on leaving the block."""

    def __init__(self, model, layer_ids: list[int]):
        self.decoder = model.get_decoder()
        self.layer_ids = list(layer_ids)
        self.stage = None
        self.outs: dict = {}
        self._handles = [
            self.decoder.layers[lid].register_forward_hook(self._hook(j)) for j, lid in enumerate(self.layer_ids)
        ]

    def _hook(self, j: int):
        def hook(module, args, output):
            if self.stage is not None:
                self.stage[:, :, j, :].copy_(layer_output(output))
            else:
                self.outs[j] = layer_output(output)

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> LayerCapture:
        self.outs = {}
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def features(self):
        import torch

        if len(self.outs) != len(self.layer_ids):
            raise RuntimeError(f"captured {len(self.outs)} of layers {self.layer_ids}: no forward ran inside the block")
        return torch.cat([self.outs[j] for j in range(len(self.layer_ids))], dim=-1)


def captured_forward(model, capture: LayerCapture, input_ids, attention_mask, flat_index, last: bool = False):
    """One padded batch through the decoder -> (the captured layers' outputs [N, n, H], and with
    `last` the final-normed states [N, H] the LM head reads, else None), N the valid tokens
    gathered with `flat_index`."""
    import torch

    B, S = input_ids.shape
    n, H = len(capture.layer_ids), model.config.hidden_size
    capture.stage = torch.empty((B, S, n, H), dtype=model.dtype, device=input_ids.device)
    with torch.inference_mode():
        out = capture.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        hidden = capture.stage.view(B * S, n, H).index_select(0, flat_index)
        capture.stage = None
        return hidden, out.last_hidden_state.view(B * S, H).index_select(0, flat_index) if last else None


def forward_batch(model, capture: LayerCapture, input_ids, attention_mask, flat_index, topk: int,
                  logits_chunk_tokens: int):
    """One padded batch -> (hidden [N, n, H], topk_ids [N, k] int32, topk_logprobs [N, k] fp16).

    N = valid (unpadded) tokens, gathered with `flat_index` (row * S + position, built on the host,
    so no device-to-host sync for a boolean mask). Top-k is computed `logits_chunk_tokens` at a time:
    a [chunk, vocab] fp32 block is the most full-vocabulary logits ever alive.
    """
    import torch

    hidden, last = captured_forward(model, capture, input_ids, attention_mask, flat_index, topk > 0)
    if topk == 0:
        return hidden, None, None
    with torch.inference_mode():
        head = model.get_output_embeddings()
        ids_parts, lp_parts = [], []
        for a in range(0, last.shape[0], logits_chunk_tokens):
            logits = head(last[a:a + logits_chunk_tokens])
            # top-k of the logits, then log p = logit - logsumexp: the same values as top-k of
            # log_softmax (within one fp32 rounding), without writing a second full-vocabulary
            # tensor and without sorting in fp32 what the head produced in bf16.
            v, i = torch.topk(logits, topk, dim=-1)
            lse = torch.logsumexp(logits.float(), dim=-1, keepdim=True)
            ids_parts.append(i.to(torch.int32))
            lp_parts.append((v.float() - lse).to(torch.float16))
        return hidden, torch.cat(ids_parts), torch.cat(lp_parts)
