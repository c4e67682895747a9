// The FP8 (e4m3) quantisation the fused all-reduce + RMSNorm may end in (Rank::
// fused_allreduce_rmsnorm_quant; the epilogue is fused/quant.cuh). Pure C++: the host side, the
// torch op layer and the kernels share these.
#pragma once
#include <cstddef>
#include <cstdint>

namespace yali {

// The schemes, numbered as the torch op takes them; None is the plain fused op (no FP8 output).
enum class QuantScheme : int { None = -1, Static = 0, PerToken = 1, Group = 2 };

// The largest e4m3 magnitude; the group sizes the group scheme serves.
constexpr float kFp8Max = 448.f;
constexpr int kQuantGroupSizes[] = {64, 128};

// Where the quantised row goes (one per call, a kernel argument).
//  * out: [rows, hidden] e4m3 codes, row-major;
//  * scale: Static: the one fp32 input scale; PerToken: row r's scale, written at
//    scale[r * row_stride]; Group: group g of row r's scale, written at
//    scale[r * row_stride + g * group_stride] (any layout: row- or column-major, padded);
//  * group_vecs: Group: the 16-byte input vectors of one group (group size / elements per vector);
//  * ue8m0: Group: every scale rounded up to a power of two.
struct QuantOut {
  void* out;
  float* scale;
  int64_t row_stride;
  int64_t group_stride;
  int group_vecs;
  int ue8m0;
};

// The scheme's bits of the call descriptor (layout.h: w[3] above the hidden size, which takes at
// most 16 bits): 0 for the plain fused op, else (scheme + 1) | ue8m0 << 2 | group_size / 64 << 3.
inline uint32_t quant_desc_bits(QuantScheme s, int group_size, bool ue8m0) {
  if (s == QuantScheme::None) return 0;
  uint32_t bits = uint32_t(int(s) + 1);
  if (s == QuantScheme::Group) bits |= uint32_t(ue8m0) << 2 | uint32_t(group_size / 64) << 3;
  return bits;
}

// Why a quantising fused call's outputs are refused (the plain fused op's rules, overlap.h, with
// quant_out in the place of norm_out, and the scale besides), or nullptr. `n`: the input's bytes;
// `quant_bytes`: quant_out's; `scale_bytes`: the bytes from the scale's first to its last element
// (the one input scale for Static). `scale_is_output`: PerToken and Group write the scales.
const char* fused_quant_overlap_refusal(const void* in, const void* residual, const void* weight,
                                        const void* quant_out, const void* residual_out, const void* scale,
                                        size_t n, size_t row_bytes, size_t quant_bytes, size_t scale_bytes,
                                        bool scale_is_output);

// Why a scheme, group size and scale layout are refused for rows of `hidden` elements, or nullptr:
// group sizes kQuantGroupSizes dividing hidden; the group scales' strides (elements) non-negative,
// positive along every dimension longer than 1, and the larger one at least the smaller one times
// its dimension's length, so that no two scales share an address.
const char* quant_scheme_refusal(QuantScheme s, size_t rows, size_t hidden, int group_size, int64_t row_stride,
                                 int64_t group_stride);

}  // namespace yali
