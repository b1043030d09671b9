"""`dflash-offline prepare`: conversation datasets -> prompts for `generate` or training rows for `extract`."""
