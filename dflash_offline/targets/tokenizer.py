"""The target's tokenizer files read as JSON, without transformers: the token ids of the special
tokens a tokenizer names (its mask token for the drafter, its end-of-sequence token where the
model's configs name none). Ids are read in their own type; a damaged file is one line naming it
and the key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from dflash_offline.runtime.errors import UserError


class TokenizerFiles(NamedTuple):
    tok_cfg: dict  # tokenizer_config.json ({} when absent)
    special: dict  # special_tokens_map.json
    vocab: dict[str, int]  # content -> id, from every place a tokenizer lists tokens
    by_id: dict[int, str]

    def declared(self, key: str) -> list[str]:
        """The names the files give a special token (`mask_token`, `eos_token`), in their order."""
        names = [d.get("content") if isinstance(d, dict) else d for d in (self.tok_cfg.get(key), self.special.get(key))]
        return [n for n in names if isinstance(n, str) and n]

    def declared_id(self, key: str) -> int | None:
        """The id of the first declared name of `key` that the vocabulary holds, or None."""
        return next((self.vocab[n] for n in self.declared(key) if n in self.vocab), None)


def read_tokenizer_files(root: Path) -> TokenizerFiles:
    """tokenizer_config.json, special_tokens_map.json and tokenizer.json's vocabulary and added
    tokens (a 27B model's tokenizer.json is large: read it once per command)."""

    def load(name: str) -> dict:
        p = root / name
        try:
            got = json.loads(p.read_text(encoding="utf-8")) if p.is_file() else {}
        except json.JSONDecodeError as e:
            raise UserError(f"{p}: not valid JSON ({e})") from None
        if not isinstance(got, dict):
            raise UserError(f"{p}: holds a JSON {type(got).__name__}, not an object; the tokenizer files are damaged: "
                            "restore them from the model's release")
        return got

    def token_id(v, file: str, key: str) -> int:
        """An id as the file holds it: an integer (or its decimal string, as JSON object keys are)."""
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            return v
        if isinstance(v, str) and v.isdigit():
            return int(v)
        raise UserError(f"{root / file}: {key} holds {json.dumps(v)}, not a token id (an integer >= 0); the "
                        "tokenizer files are damaged: restore them from the model's release")

    tok_cfg, special, tok_json = load("tokenizer_config.json"), load("special_tokens_map.json"), load("tokenizer.json")
    for file, key, kind in (("tokenizer.json", "added_tokens", list), ("tokenizer_config.json", "added_tokens_decoder", dict)):
        got = (tok_json if file == "tokenizer.json" else tok_cfg).get(key)
        if got is not None and not isinstance(got, kind):
            raise UserError(f"{root / file}: {key} holds a JSON {type(got).__name__}, not {'an array' if kind is list else 'an object'}; "
                            "the tokenizer files are damaged: restore them from the model's release")
    vocab: dict[str, int] = {}
    model_vocab = (tok_json.get("model") or {}).get("vocab")
    if isinstance(model_vocab, dict):
        vocab.update({str(k): token_id(v, "tokenizer.json", f"model.vocab[{k!r}]") for k, v in model_vocab.items()})
    for n, t in enumerate(tok_json.get("added_tokens") or []):
        got = t.get("id") if isinstance(t, dict) else None
        vocab[str(t.get("content") if isinstance(t, dict) else t)] = token_id(got, "tokenizer.json", f"added_tokens[{n}].id")
    for i, t in (tok_cfg.get("added_tokens_decoder") or {}).items():
        vocab[str(t.get("content") if isinstance(t, dict) else t)] = token_id(
            i, "tokenizer_config.json", f"added_tokens_decoder key {i!r}")
    return TokenizerFiles(tok_cfg, special, vocab, {v: k for k, v in vocab.items()})
