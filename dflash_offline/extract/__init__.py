"""Stage one: the frozen target over the input, hidden states committed shard by shard into the cache."""
