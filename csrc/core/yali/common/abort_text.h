// The host's text of an abort record (Rank::abort_message): which rank, kernel and block gave up,
// on what wait, and both ranks' calls. Pure C++ (no CUDA): tests/core/test_abort_cpu.py checks it.
#pragma once
#include <string>

#include "yali/common/layout.h"

namespace yali {

// One call as a sentence: "all_reduce of 65536 bytes bf16 by flash-push on 64 CTAs", or "not seen
// (it has not issued this call)" for an empty descriptor.
std::string describe_call(const CallDesc& d);

// What the waiter saw when it gave up, for the record's `what` (see AbortInfo): a counter for the
// flag waits, and in words for the pushed data (the empty marker is no count) and descriptors.
std::string wait_seen(int what, uint64_t expected, uint64_t seen);

// The message of a complete record `a` of rank `rank` of `world`, whose YALI_TIMEOUT_S is `timeout_s`.
std::string abort_text(const AbortInfo& a, int rank, int world, double timeout_s);

}  // namespace yali
