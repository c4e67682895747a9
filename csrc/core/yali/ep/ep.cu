// Rank's expert-parallel dispatch and combine (ep.cuh): the checks, the launch shape and the
// call descriptor. Whether a call is served depends only on values every rank shares (the token
// counts, row sizes, dtype and the Config), so the ranks never disagree on it; bad pointers are
// refused too, but vLLM's tensors always pass (the Python side copies any that would not).
#include <algorithm>

#include "yali/common/launch.cuh"
#include "yali/communicator.h"
#include "yali/ep/ep.cuh"

namespace yali {

namespace {

size_t round16(size_t n) { return (n + 15) / 16 * 16; }

// 31 bits of FNV-1a over the world size, every rank's count and the parts' row bytes: two calls
// that differ in any of them carry different descriptors (call_check.cuh).
uint32_t ep_digest(int world, const uint32_t* counts, const size_t* row_bytes, int n) {
  uint64_t h = 1469598103934665603ull;
  const auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(uint64_t(world));
  for (int r = 0; r < world; ++r) mix(counts[r]);
  mix(uint64_t(n));
  for (int i = 0; i < n; ++i) mix(row_bytes[i]);
  return uint32_t(h ^ (h >> 31)) & 0x7fffffffu;
}

bool aligned(const void* p, uintptr_t to) { return reinterpret_cast<uintptr_t>(p) % to == 0; }

// Bytes of one rank's dispatch message of `count` tokens: every part's rows, each padded to 16.
size_t message_bytes(const size_t* row_bytes, int n, uint32_t count) {
  size_t m = 0;
  for (int i = 0; i < n; ++i) m += round16(size_t(count) * row_bytes[i]);
  return m;
}

}  // namespace

EpArgs Rank::ep_args(const uint32_t* counts, const CallDesc& desc) const {
  EpArgs a{};
  a.rank = rank_;
  a.world = world_;
  a.total_ctas = kMaxFlashCtas;
  uint32_t first = 0;
  for (int r = 0; r < world_; ++r) {
    a.count[r] = counts[r];
    a.first[r] = first;
    first += counts[r];
  }
  a.slot_bytes = layout_.ep_slot;
  a.push_off = layout_.ep_push;
  a.call_off = layout_.call_slots;
  for (int r = 0; r < world_; ++r) a.bufs[r] = bufs_[r];
  a.state = state_;
  a.timeout_ns = uint64_t(config_.timeout_s * 1e9);
  a.abort = AbortRef{abort_dev_, desc};
  a.call = desc;
  return a;
}

bool Rank::ep_gather_serves(const size_t* row_bytes, int n, const uint32_t* counts) const {
  if (layout_.ep_slot == 0 || n < 1 || n > kEpMaxParts) return false;
  for (int i = 0; i < n; ++i)
    if (row_bytes[i] == 0 || row_bytes[i] % 4 != 0) return false;
  uint64_t total = 0;
  for (int r = 0; r < world_; ++r) {
    total += counts[r];
    if (message_bytes(row_bytes, n, counts[r]) > layout_.ep_slot) return false;
  }
  return total <= 0x7fffffffu;
}

bool Rank::ep_combine_serves(size_t hidden, DType dtype, const uint32_t* counts) const {
  const size_t row = hidden * dtype_size(dtype);
  if (layout_.ep_slot == 0 || hidden == 0 || row % 16 != 0) return false;
  uint64_t total = 0;
  for (int r = 0; r < world_; ++r) {
    total += counts[r];
    if (size_t(counts[r]) * row > layout_.ep_slot) return false;
  }
  return total <= 0x7fffffffu;
}

cudaError_t Rank::ep_gather(const EpTensor* tensors, int n, const uint32_t* counts, cudaStream_t stream) const {
  size_t row_bytes[kEpMaxParts] = {};
  for (int i = 0; i < n && i < kEpMaxParts; ++i) row_bytes[i] = tensors[i].row_bytes;
  if (!connected() || !ep_gather_serves(row_bytes, n, counts)) return cudaErrorInvalidValue;
  uint64_t total = 0;
  size_t largest = 0, nbytes = 0;
  for (int r = 0; r < world_; ++r) {
    total += counts[r];
    const size_t message = message_bytes(row_bytes, n, counts[r]);
    largest = std::max(largest, message);
    nbytes += message;
  }
  if (total == 0) return cudaSuccess;  // nothing anywhere (an empty CUDA tensor's pointer is null)
  for (int i = 0; i < n; ++i) {
    const EpTensor& t = tensors[i];
    const size_t mine = size_t(counts[rank_]) * t.row_bytes;
    if (!aligned(t.in, 4) || !aligned(t.out, 4) || (mine != 0 && t.in == nullptr) || t.out == nullptr) return cudaErrorInvalidValue;
    for (int j = 0; j < n; ++j) {
      const size_t out_bytes = size_t(total) * tensors[j].row_bytes;
      // my own copy must not overwrite an input it has still to send, nor one output another
      if (ranges_overlap(t.in, mine, tensors[j].out, out_bytes) ||
          (j < i && ranges_overlap(t.out, size_t(total) * t.row_bytes, tensors[j].out, out_bytes)))
        return cudaErrorInvalidValue;
    }
  }
  const int grid = push_ctas(config_, largest);  // as flash-push: 1 KiB of the largest rank's message per CTA
  EpArgs a = ep_args(counts, call_desc(CallOp::Ep, Kernel::EpGather, nbytes, DType::F32, grid,
                                       ep_digest(world_, counts, row_bytes, n)));
  a.parts = n;
  for (int i = 0; i < n; ++i)
    a.part[i] = EpPart{static_cast<const char*>(tensors[i].in), static_cast<char*>(tensors[i].out), tensors[i].row_bytes};
  return launch(ep_gather_kernel, grid, kFlashThreads, stream, config_.pdl != 0, a);
}

cudaError_t Rank::ep_reduce_scatter(const void* in, void* out, size_t hidden, DType dtype, const uint32_t* counts,
                                    cudaStream_t stream) const {
  if (!connected() || !ep_combine_serves(hidden, dtype, counts) || !aligned(in, 16) || !aligned(out, 16))
    return cudaErrorInvalidValue;
  const size_t row = hidden * dtype_size(dtype);
  uint64_t total = 0;
  size_t largest = 0;
  for (int r = 0; r < world_; ++r) {
    total += counts[r];
    largest = std::max(largest, size_t(counts[r]) * row);
  }
  // The sends read rows of `in` that my sums, written meanwhile by other CTAs, would overwrite.
  if (ranges_overlap(in, size_t(total) * row, out, size_t(counts[rank_]) * row)) return cudaErrorInvalidValue;
  if (total == 0) return cudaSuccess;
  const int grid = push_ctas(config_, largest);
  const size_t rows[1] = {row};
  EpArgs a = ep_args(counts, call_desc(CallOp::Ep, Kernel::EpReduceScatter, size_t(total) * row, dtype, grid,
                                       ep_digest(world_, counts, rows, 1)));
  a.rs_in = in;
  a.rs_out = out;
  a.rs_row_bytes = row;
  return with_element_type(dtype, [&](auto zero) {
    return launch(ep_reduce_scatter_kernel<decltype(zero)>, grid, kFlashThreads, stream, config_.pdl != 0, a);
  });
}

}  // namespace yali
