#include "yali/common/quant.h"

#include "yali/common/overlap.h"

namespace yali {

const char* fused_quant_overlap_refusal(const void* in, const void* residual, const void* weight,
                                        const void* quant_out, const void* residual_out, const void* scale,
                                        size_t n, size_t row_bytes, size_t quant_bytes, size_t scale_bytes,
                                        bool scale_is_output) {
  // quant_out: the other ranks read `in` while it is written; a CTA writes its rows while other CTAs
  // still read theirs of every input; the two launches' first writes the sum before any is read.
  if (ranges_overlap(quant_out, quant_bytes, in, n))
    return "quant_out must not overlap input (the other ranks read input while quant_out is written)";
  if (residual && ranges_overlap(quant_out, quant_bytes, residual, n)) return "quant_out must not overlap residual";
  if (residual_out && ranges_overlap(quant_out, quant_bytes, residual_out, n))
    return "quant_out must not overlap residual_out";
  if (ranges_overlap(quant_out, quant_bytes, weight, row_bytes)) return "quant_out must not overlap weight";
  if (ranges_overlap(quant_out, quant_bytes, scale, scale_bytes)) return "quant_out must not overlap scale";
  if (residual_out) {
    if (ranges_overlap(residual_out, in, n))
      return "residual_out must not overlap input (the other ranks read input while residual_out is written)";
    if (residual && partly_overlap(residual_out, residual, n))
      return "residual_out must be residual itself or not overlap it (a shifted view would overwrite rows "
             "still to be read)";
    if (ranges_overlap(residual_out, n, weight, row_bytes)) return "residual_out must not overlap weight";
    if (ranges_overlap(residual_out, n, scale, scale_bytes)) return "residual_out must not overlap scale";
  }
  if (scale_is_output) {
    if (ranges_overlap(scale, scale_bytes, in, n)) return "scale must not overlap input (the scales are outputs)";
    if (residual && ranges_overlap(scale, scale_bytes, residual, n)) return "scale must not overlap residual";
    if (ranges_overlap(scale, scale_bytes, weight, row_bytes)) return "scale must not overlap weight";
  }
  return nullptr;
}

const char* quant_scheme_refusal(QuantScheme s, size_t rows, size_t hidden, int group_size, int64_t row_stride,
                                 int64_t group_stride) {
  if (s != QuantScheme::Static && s != QuantScheme::PerToken && s != QuantScheme::Group)
    return "scheme must be 0 (static per-tensor), 1 (dynamic per-token) or 2 (dynamic per-token-group)";
  if (s == QuantScheme::PerToken && rows > 1 && row_stride <= 0)
    return "scale must give every row its own element (stride(0) > 0)";
  if (s != QuantScheme::Group) return nullptr;
  bool known = false;
  for (int g : kQuantGroupSizes) known |= g == group_size;
  if (!known) return "group_size must be 64 or 128";
  if (hidden % size_t(group_size) != 0) return "group_size must divide the hidden size";
  const size_t groups = hidden / size_t(group_size);
  if (row_stride < 0 || group_stride < 0 || (rows > 1 && row_stride == 0) || (groups > 1 && group_stride == 0))
    return "scale's strides must be positive along every dimension longer than 1";
  if (rows > 1 && groups > 1) {
    // Each scale its own element: the larger stride steps past every element of the other dimension.
    const bool rows_inner = row_stride <= group_stride;
    const uint64_t inner = uint64_t(rows_inner ? row_stride : group_stride);
    const uint64_t outer = uint64_t(rows_inner ? group_stride : row_stride);
    if (outer < inner * (rows_inner ? rows : groups))
      return "scale's strides must give every (row, group) its own element (two scales would share an address)";
  }
  return nullptr;
}

}  // namespace yali
