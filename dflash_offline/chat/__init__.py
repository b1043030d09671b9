"""Chat data: conversation files in the formats users have (formats.py, records.py) and the chat
template that renders them as a server does (template.py). Shared by `prepare` and `generate`; no
stage imports here."""
