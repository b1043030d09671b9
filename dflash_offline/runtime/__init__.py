"""Process plumbing shared by every stage: errors, path checks, logs and heartbeats, stop signals,
launch and rank rendezvous, worker supervision, fault points. Nothing here imports torch or zarr."""
