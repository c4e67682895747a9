"""The library's size table (csrc/core/yali/common/plan_table.h) as the tests read it, through
yali_vllm.config.plan_table: which of its rows holds a call. The CPU tests check the table's
properties and that every lookup follows it (tests/core/test_plan_table.py); the GPU sweep checks
that every real launch does (tests/gpu/test_fused.py)."""


def _holds(bound: int, value: int) -> bool:
    """Whether a row bound as plan_table writes it (0: unbounded) holds `value`."""
    return bound == 0 or value <= bound


def fused_band(bands: list[dict], nbytes: int, row_bytes: int) -> dict:
    """The band of a one-launch fused call of `nbytes` in rows of `row_bytes`: the first of
    `bands` (plan_table's "fused_band" rows) whose message and row bounds hold it."""
    for band in bands:
        if _holds(band["up_to"], nbytes) and _holds(band["row_bytes_max"], row_bytes):
            return band
    raise ValueError(f"no fused band holds {nbytes} bytes in rows of {row_bytes}: {bands}")


def allreduce_kernel(bands: list[dict], nbytes: int) -> str | None:
    """The kernel of the all-reduce band (plan_table's "allreduce" rows) that holds `nbytes`, or
    None above the last (vLLM's chain)."""
    for band in bands:
        if 0 < nbytes <= band["up_to"]:
            return band["kernel"]
    return None
