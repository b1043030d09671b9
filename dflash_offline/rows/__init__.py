"""The input contract's rows (cache-contract.md, Input): Parquet files of token rows, and the part
folders that `generate` and `prepare` write and commit in a manifest (parts.py: the one owner of
that format); reader.py reads both for `extract`, `generate` and `plan`. Imports no stage."""
