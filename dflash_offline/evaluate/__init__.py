"""`dflash-offline eval`: what a drafter saves, by the walk estimate on a cache and by real decoding."""
