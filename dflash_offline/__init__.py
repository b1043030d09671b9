"""dflash-offline: train DFlash speculative-decoding drafters from an offline hidden-state cache."""

__version__ = "0.1.0"

__all__ = ["open_cache"]


def open_cache(path: str, tokenizer: str | None = None):
    """A read-only view of a cache for notebooks (manifest, shards, samples as arrays or text,
    statistics, plots); imports numpy and zarr, never torch. `tokenizer`: the model folder whose
    tokenizer.json decodes the samples' text, when the target folder the manifest names has moved.
    See dflash_offline.inspect."""
    from dflash_offline.inspect import open_cache as _open

    return _open(path, tokenizer)
