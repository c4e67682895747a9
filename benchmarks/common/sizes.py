"""Byte counts as the benchmarks write them: "2K", "1M", "1G"."""
from __future__ import annotations

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mul = {"K": KiB, "M": MiB, "G": GiB}.get(s[-1], 1)
    return int(float(s[:-1] if mul > 1 else s) * mul)


def fmt_size(n: int) -> str:
    for unit, v in (("G", GiB), ("M", MiB), ("K", KiB)):
        if n >= v and n % v == 0:
            return f"{n // v}{unit}"
    return str(n)
