// The core's pure C++ rules, one query a line on stdin, one answer a line on stdout, for the CPU
// tests (tests/core/core_rules.py builds this with the host compiler; no CUDA, no GPU):
//   overlap A NA B NB                                    -> 1 or 0 (ranges_overlap)
//   all_reduce IN OUT N                                  -> ok, or why out is refused
//   fused IN RESIDUAL WEIGHT NORM_OUT RESIDUAL_OUT N ROW -> ok, or why an output is refused
//   fused_quant IN RESIDUAL WEIGHT QUANT_OUT RESIDUAL_OUT SCALE N ROW QUANT_BYTES SCALE_BYTES SCALE_IS_OUTPUT
//                                                        -> ok, or why an output is refused (quant.h)
//   quant_bits SCHEME GROUP_SIZE UE8M0                   -> the scheme's descriptor bits (quant_desc_bits)
//   quant_scheme SCHEME ROWS HIDDEN GROUP_SIZE ROW_STRIDE GROUP_STRIDE
//                                                        -> ok, or why the scheme or scale layout is refused
//   call OP KERNEL NBYTES DTYPE CTAS W3                  -> the descriptor's four words (call_desc)
//   abort RANK WORLD TIMEOUT_S KERNEL BLOCK WHAT EXPECTED SEEN PEER M0 M1 M2 M3 T0 T1 T2 T3
//                                                        -> the abort message (abort_text)
// Addresses and words are decimal integers.
#include <cstdint>
#include <iostream>
#include <sstream>
#include <string>

#include "yali/common/abort_text.h"
#include "yali/common/overlap.h"
#include "yali/common/quant.h"

namespace {

const void* at(uint64_t a) { return reinterpret_cast<const void*>(uintptr_t(a)); }

std::string answer(const char* refusal) { return refusal ? refusal : "ok"; }

std::string run(std::istringstream& q) {
  std::string op;
  q >> op;
  if (op == "overlap") {
    uint64_t a, na, b, nb;
    q >> a >> na >> b >> nb;
    return yali::ranges_overlap(at(a), na, at(b), nb) ? "1" : "0";
  }
  if (op == "all_reduce") {
    uint64_t in, out, n;
    q >> in >> out >> n;
    return answer(yali::all_reduce_overlap_refusal(at(in), at(out), n));
  }
  if (op == "fused") {
    uint64_t in, residual, weight, norm_out, residual_out, n, row;
    q >> in >> residual >> weight >> norm_out >> residual_out >> n >> row;
    return answer(yali::fused_overlap_refusal(at(in), at(residual), at(weight), at(norm_out), at(residual_out), n, row));
  }
  if (op == "fused_quant") {
    uint64_t in, residual, weight, quant_out, residual_out, scale, n, row, quant_bytes, scale_bytes, scale_is_output;
    q >> in >> residual >> weight >> quant_out >> residual_out >> scale >> n >> row >> quant_bytes >> scale_bytes >>
        scale_is_output;
    return answer(yali::fused_quant_overlap_refusal(at(in), at(residual), at(weight), at(quant_out), at(residual_out),
                                                    at(scale), n, row, quant_bytes, scale_bytes, scale_is_output != 0));
  }
  if (op == "quant_scheme") {
    int scheme, group_size;
    uint64_t rows, hidden;
    int64_t row_stride, group_stride;
    q >> scheme >> rows >> hidden >> group_size >> row_stride >> group_stride;
    return answer(yali::quant_scheme_refusal(yali::QuantScheme(scheme), rows, hidden, group_size, row_stride,
                                             group_stride));
  }
  if (op == "quant_bits") {
    int scheme, group_size, ue8m0;
    q >> scheme >> group_size >> ue8m0;
    return std::to_string(yali::quant_desc_bits(yali::QuantScheme(scheme), group_size, ue8m0 != 0));
  }
  if (op == "call") {
    uint32_t kind, kernel, dtype, ctas;
    uint64_t nbytes, w3;
    q >> kind >> kernel >> nbytes >> dtype >> ctas >> w3;
    const yali::CallDesc d = yali::call_desc(yali::CallOp(kind), yali::Kernel(kernel), nbytes, yali::DType(dtype),
                                             int(ctas), w3);
    return std::to_string(d.w[0]) + " " + std::to_string(d.w[1]) + " " + std::to_string(d.w[2]) + " " +
           std::to_string(d.w[3]);
  }
  if (op == "abort") {
    int rank, world;
    double timeout_s;
    yali::AbortInfo a{};
    q >> rank >> world >> timeout_s >> a.kernel >> a.block >> a.what >> a.expected >> a.seen >> a.peer;
    for (auto& w : a.mine.w) q >> w;
    for (auto& w : a.theirs.w) q >> w;
    a.magic = yali::kAbortMagic;
    a.world = world;
    return yali::abort_text(a, rank, world, timeout_s);
  }
  return "unknown query: " + op;
}

}  // namespace

int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream q(line);
    std::cout << run(q) << "\n";
  }
  return 0;
}
