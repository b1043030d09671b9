"""Numbers as people read them in logs and messages: 1.23 GB, 4.5M."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def human_count(n: float) -> str:
    """1234 -> "1.23K", 2.1e9 -> "2.10B": parameter and token counts in log lines."""
    for unit in ("", "K", "M", "B"):
        if abs(n) < (999.5 if unit == "" else 999.995):  # what rounds to 1000 takes the next unit
            return f"{n:.0f}" if unit == "" else f"{n:.2f}{unit}"
        n /= 1000
    return f"{n:.2f}T"
