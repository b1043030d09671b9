"""`dflash-offline generate`: the target's own completions of prompts, the training input of extract."""
