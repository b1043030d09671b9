"""Block rows and what is computed over them, shared by training and evaluation: the packing of
cache samples into rows of anchored blocks (packing.py, pieces.py, stream.py), the block losses
(loss.py, dspark_loss.py) and the held-out acceptance estimate built on them (walk.py). It reads
the cache (cache/) and the drafter (drafter/); it imports no stage, so train/ and evaluate/ both
stand on it and neither on the other."""
