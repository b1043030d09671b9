"""The hidden-state cache (cache-contract.md): manifest, shard writer, reader."""
