"""The two-rank fused op's launch bands (plan.cpp: fused_launch_for): one copy for the CPU test of
the size table and for the GPU sweep that checks every real launch follows it, so a table change
that misses one fails in CI."""

KiB = 1024


def two_rank_band(nbytes: int, row_bytes: int) -> tuple[int, int]:
    """(bytes sent per CTA, row loads before the send) of a one-launch two-rank fused call."""
    if nbytes <= 128 * KiB or (nbytes <= 256 * KiB and row_bytes <= 8 * KiB):
        return 4 * KiB, 0
    if nbytes <= 256 * KiB:
        return 8 * KiB, 1
    return 1 * KiB, 0
