// Which outputs may lie over which inputs: the rules every entry (Rank, the torch ops, the C++
// API) applies before a launch. A kernel that writes a byte another CTA, or another rank, still
// has to read returns a silently wrong result, so each rule names the argument it refuses.
// Pure C++ (no CUDA): tests/core/test_overlap_cpu.py checks the rules at their boundaries.
#pragma once
#include <cstddef>
#include <cstdint>

namespace yali {

// Whether [a, a + na) and [b, b + nb) share a byte (an empty range shares none).
inline bool ranges_overlap(const void* a, size_t na, const void* b, size_t nb) {
  const uintptr_t x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return na != 0 && nb != 0 && x < y + nb && y < x + na;
}
// Ranges of the same length `n`.
inline bool ranges_overlap(const void* a, const void* b, size_t n) { return ranges_overlap(a, n, b, n); }

// Whether two ranges of `n` bytes share a byte without being the same range: an in-place call
// (the same bytes) is served where a shifted view is not.
inline bool partly_overlap(const void* a, const void* b, size_t n) { return a != b && ranges_overlap(a, b, n); }

// The plain all-reduce of `n` bytes: `out` may be `in` itself (every kernel reads each input
// vector before the same thread writes that output vector, or, in the stream kernel, before its
// receivers add the chunk) or apart from it. A shifted view is refused: the kernels read the input
// again after other CTAs wrote their part of `out`. Returns why `out` is refused, or nullptr.
inline const char* all_reduce_overlap_refusal(const void* in, const void* out, size_t n) {
  if (partly_overlap(out, in, n))
    return "out must be input itself or not overlap it (the kernels read input again after other CTAs "
           "wrote out: a shifted view would give a wrong sum)";
  return nullptr;
}

// The fused all-reduce + RMSNorm over `n` bytes of rows of `row_bytes` (`residual` may be null):
//  * neither output over `in`: the other ranks read `in` while the outputs are written;
//  * neither output over `weight`: every CTA reads it while the others write their rows;
//  * norm_out over nothing else: it holds the sum (two launches) before the residual is read, and
//    in one launch a CTA writes its rows while other CTAs still read theirs;
//  * residual_out is `residual` itself (in place, row by row) or apart from it.
// Returns why an output is refused, or nullptr.
inline const char* fused_overlap_refusal(const void* in, const void* residual, const void* weight,
                                         const void* norm_out, const void* residual_out, size_t n,
                                         size_t row_bytes) {
  if (ranges_overlap(norm_out, in, n))
    return "norm_out must not overlap input (the other ranks read input while norm_out is written)";
  if (ranges_overlap(residual_out, in, n))
    return "residual_out must not overlap input (the other ranks read input while residual_out is written)";
  if (ranges_overlap(norm_out, residual_out, n)) return "norm_out must not overlap residual_out";
  if (residual && ranges_overlap(norm_out, residual, n))
    return "norm_out must not overlap residual (the sum goes to norm_out before the residual is read)";
  if (residual && partly_overlap(residual_out, residual, n))
    return "residual_out must be residual itself or not overlap it (a shifted view would overwrite rows "
           "still to be read)";
  if (ranges_overlap(norm_out, n, weight, row_bytes)) return "norm_out must not overlap weight";
  if (ranges_overlap(residual_out, n, weight, row_bytes)) return "residual_out must not overlap weight";
  return nullptr;
}

}  // namespace yali
