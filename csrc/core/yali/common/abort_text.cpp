#include "yali/common/abort_text.h"

#include <cstdio>

namespace yali {

namespace {

bool same_call(const CallDesc& a, const CallDesc& b) {
  for (int i = 0; i < 4; ++i)
    if (a.w[i] != b.w[i]) return false;
  return true;
}

// The FP8 quantisation of a fused call's descriptor (quant.h: quant_desc_bits), "" for none.
std::string quant_text(uint32_t bits) {
  switch (bits & 0x3u) {
    case 0: return "";
    case 1: return " + FP8 static quant";
    case 2: return " + FP8 per-token quant";
    default:
      return " + FP8 group-" + std::to_string(64 * ((bits >> 3) & 0xfu)) + " quant" + ((bits & 0x4u) ? " (ue8m0)" : "");
  }
}

// YALI_TIMEOUT_S as set: "4", "0.5".
std::string seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", s);
  return buf;
}

}  // namespace

std::string describe_call(const CallDesc& d) {
  if (d.w[0] == kCallEmpty) return "not seen (it has not issued this call)";
  static const char* dtypes[] = {"fp32", "fp16", "bf16", "?"};
  const uint64_t nbytes = uint64_t(d.w[0]) | uint64_t(d.w[1]) << 31;
  const uint32_t op = d.w[2] & 0x3u, dtype = (d.w[2] >> 6) & 0x3u, ctas = (d.w[2] >> 8) & 0xfffu;
  const Kernel kernel = Kernel((d.w[2] >> 2) & 0xfu);
  const std::string what =
      op == uint32_t(CallOp::Fused)       ? "fused all-reduce + RMSNorm" + quant_text(d.w[3] >> 16) + " of hidden " +
                                                std::to_string(d.w[3] & 0xffffu) + ", "
      : op == uint32_t(CallOp::AllReduce) ? std::string("all_reduce of ")
      : op == uint32_t(CallOp::Ep)        ? (kernel == Kernel::EpGather ? "EP dispatch (tokens and layout " : "EP combine (tokens and layout ") +
                                                std::to_string(d.w[3]) + ") of "
                                          : std::string("? of ");
  const std::string type = kernel == Kernel::EpGather ? "" : std::string(" ") + dtypes[dtype];  // a gather moves bytes
  return what + std::to_string(nbytes) + " bytes" + type + " by " + kernel_name(kernel) + " on " +
         std::to_string(ctas) + (kernel == Kernel::Stream ? " lanes" : " CTAs");
}

std::string wait_seen(int what, uint64_t expected, uint64_t seen) {
  if (what == 6) return seen == kPushEmpty ? "still empty" : "partly arrived";
  if (what == 8) return "none arrived";
  return "expected >= " + std::to_string(expected) + ", saw " + std::to_string(seen);
}

std::string abort_text(const AbortInfo& a, int rank, int world, double timeout_s) {
  // With N ranks the record names the rank it waited for or disagreed with.
  const std::string them = a.peer >= 0 ? "rank " + std::to_string(a.peer) : std::string("peer");
  const std::string calls = "this rank: " + describe_call(a.mine) + "; " + them + ": " + describe_call(a.theirs);
  const std::string who = "yali: rank " + std::to_string(rank) + (world > 2 ? " of " + std::to_string(world) : "") +
                          " " + kernel_name(Kernel(a.kernel)) + " kernel, block " + std::to_string(a.block);
  if (a.what == 9)
    return who + ": the ranks issued different calls (" + calls +
           "): every rank must issue the same YALI calls, in the same order";
  static const char* whats[] = {"?", "?", "?", "stream credit", "stream ready", "?", "push data", "?", "call descriptor"};
  const int w = (a.what >= 1 && a.what <= 8) ? a.what : 0;
  // The peer's descriptor equal to this call's: the peer is in this call too, but its data did not come.
  const std::string why = same_call(a.mine, a.theirs)
                              ? "the " + them + " issued this call too: its process died in it, or its CTAs got no SM"
                              : "the " + them + "'s process died or the ranks issued different calls";
  return who + ", gave up after YALI_TIMEOUT_S=" + seconds(timeout_s) + "s waiting for the " + them + "'s " +
         whats[w] + " (" + wait_seen(a.what, a.expected, a.seen) + "; " + calls + "): " + why;
}

}  // namespace yali
