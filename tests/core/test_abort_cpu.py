"""The text of a kernel's abort record, without a GPU (csrc/core/yali/common/abort_text.cpp, built with
the host compiler): this rank's call, what the wait saw in words, both ranks' calls.
tests/gpu/test_abort_record.py has a kernel record a stalled call on the GPU."""
from .core_rules import query

PUSH_EMPTY = 0x80008000
EMPTY = [0xFFFFFFFF] * 4
ALL_REDUCE, FUSED = 1, 2
FLASH_PUSH, STREAM, PUSH_ONESHOT = 5, 3, 6
BF16 = 2


def desc(op, kernel, nbytes, dtype, ctas, w3=0) -> list[int]:
    (words,) = query(f"call {op} {kernel} {nbytes} {dtype} {ctas} {w3}")
    return [int(w) for w in words.split()]


def abort_text(*, rank=0, world=2, timeout_s=4.0, kernel=FLASH_PUSH, block=3, what=6, expected=PUSH_EMPTY,
               seen=PUSH_EMPTY, peer=-1, mine=EMPTY, theirs=EMPTY) -> str:
    fields = [rank, world, timeout_s, kernel, block, what, expected, seen, peer, *mine, *theirs]
    (text,) = query("abort " + " ".join(str(f) for f in fields))
    return text


def test_a_wait_for_pushed_data_names_this_call_and_the_empty_slot_in_words():
    mine = desc(ALL_REDUCE, FLASH_PUSH, 65536, BF16, 64)
    text = abort_text(mine=mine)
    assert text == ("yali: rank 0 flash-push kernel, block 3, gave up after YALI_TIMEOUT_S=4s waiting for the peer's "
                    "push data (still empty; this rank: all_reduce of 65536 bytes bf16 by flash-push on 64 CTAs; "
                    "peer: not seen (it has not issued this call)): the peer's process died or the ranks issued "
                    "different calls")
    assert str(PUSH_EMPTY) not in text
    assert "partly arrived" in abort_text(mine=mine, seen=0x3F80)  # one word of the vector arrived


def test_counters_stay_numbers_and_the_timeout_reads_as_set():
    text = abort_text(kernel=STREAM, what=3, expected=5, seen=3, timeout_s=0.5,
                      mine=desc(ALL_REDUCE, STREAM, 16 << 20, BF16, 128))
    assert "YALI_TIMEOUT_S=0.5s waiting for the peer's stream credit (expected >= 5, saw 3; this rank: all_reduce of " \
           "16777216 bytes bf16 by stream on 128 lanes;" in text, text
    assert "(none arrived;" in abort_text(what=8, expected=0, seen=0, mine=desc(ALL_REDUCE, FLASH_PUSH, 2048, BF16, 2))


def test_a_peer_in_the_same_call_is_not_blamed_for_a_missing_call():
    mine = desc(FUSED, PUSH_ONESHOT, 16 * 8192 * 2, BF16, 16, 8192)
    text = abort_text(rank=1, world=4, kernel=PUSH_ONESHOT, block=0, peer=2, mine=mine, theirs=mine)
    assert text.startswith("yali: rank 1 of 4 push-oneshot kernel, block 0, gave up"), text
    assert ("this rank: fused all-reduce + RMSNorm of hidden 8192, 262144 bytes bf16 by push-oneshot on 16 CTAs; "
            "rank 2: fused all-reduce + RMSNorm of hidden 8192") in text, text
    assert text.endswith("the rank 2 issued this call too: its process died in it, or its CTAs got no SM"), text


def test_different_calls_name_both():
    mine, theirs = desc(ALL_REDUCE, FLASH_PUSH, 65536, BF16, 64), desc(ALL_REDUCE, FLASH_PUSH, 131072, BF16, 128)
    text = abort_text(what=9, expected=0, seen=0, mine=mine, theirs=theirs)
    assert text == ("yali: rank 0 flash-push kernel, block 3: the ranks issued different calls (this rank: all_reduce "
                    "of 65536 bytes bf16 by flash-push on 64 CTAs; peer: all_reduce of 131072 bytes bf16 by "
                    "flash-push on 128 CTAs): every rank must issue the same YALI calls, in the same order")
