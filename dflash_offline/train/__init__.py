"""Stage two: a DFlash drafter trained from a committed cache, data parallel, resumable to the step."""
