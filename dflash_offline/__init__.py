"""dflash-offline: train DFlash speculative-decoding drafters from an offline hidden-state cache."""

__version__ = "0.1.0"
