// One GPU's side of a YALI communicator of 2 to kMaxRanks GPUs: the buffers it owns, the
// other ranks' buffers it has mapped, and the launch of one all-reduce. No torch here:
// the torch op layer (csrc/bindings) and the C++ API (yali.h) both sit on this.
#pragma once
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <string>

#include "yali/common/config.h"
#include "yali/common/layout.h"
#include "yali/common/overlap.h"
#include "yali/common/plan.h"
#include "yali/common/quant.h"

namespace yali {

struct ExchangeArgs;
struct CallCheck;
struct StreamArgs;
struct RanksArgs;
struct EpArgs;

// One tensor of an expert-parallel dispatch (Rank::ep_gather): `in` is this rank's [T_me, row_bytes],
// `out` the gathered [T_0 + ... + T_{N-1}, row_bytes].
struct EpTensor {
  const void* in;
  void* out;
  size_t row_bytes;
};

using IpcHandleBytes = std::array<uint8_t, sizeof(cudaIpcMemHandle_t)>;

class Rank {
 public:
  // Allocates and zeroes this rank's buffers on `device`, as rank `rank` of `world` ranks
  // (2 to kMaxRanks). Throws std::invalid_argument for a bad rank or world, std::runtime_error else.
  Rank(int device, int rank, int world, const Config& config);
  Rank(int device, int rank, const Config& config) : Rank(device, rank, 2, config) {}
  ~Rank();
  Rank(const Rank&) = delete;
  Rank& operator=(const Rank&) = delete;

  // Multi-process: export my shared buffer, then map every other rank's.
  IpcHandleBytes ipc_handle() const;
  void open_peer(const IpcHandleBytes& peer);  // two ranks: the other one
  void open_peer(int peer_rank, const IpcHandleBytes& peer);
  // Single process driving both GPUs: use the other Rank's buffer directly (P2P).
  void attach_peer(Rank& peer);
  // Waits for this GPU's work, then unmaps the other ranks' buffers (nothing of this rank reads or
  // writes them any more). The first step of a coordinated close: each rank frees its own buffer
  // (the destructor) only once every other rank has unmapped it too.
  void close_peer();

  // Launches one all-reduce of `nbytes` bytes of `dtype` on `stream`.
  // `mode` overrides Config::mode for this call (benchmarks force a kernel).
  // `out` may be `in` (in place) or apart from it (all_reduce_overlap_refusal).
  // Returns cudaErrorInvalidValue for inputs this rank cannot serve (check
  // plan(), alignment and overlap first), or the launch error.
  // `fused`: the fused op's descriptor, when this all-reduce is its first launch (the peer checks
  // the call as a whole).
  cudaError_t all_reduce(const void* in, void* out, size_t nbytes, DType dtype, cudaStream_t stream,
                         KernelMode mode, const CallDesc* fused = nullptr) const;
  Plan plan(size_t nbytes, KernelMode mode) const;

  // Fused all-reduce + residual add + RMSNorm over rows of `hidden` elements
  // (see fused.cuh for the exact arithmetic). `residual` may be nullptr and may
  // alias `residual_out`; no other output may overlap an input or the other
  // output (fused_overlap_refusal, overlap.h). One launch while fused_one_launch (two
  // ranks: up to Config::flash_bytes; more: ranks_fused_one_launch_max), else a YALI
  // all-reduce into norm_out followed by the add + norm kernel. Rows must be
  // 16-byte multiples of at most kFusedMaxRowBytes and pointers 16-byte aligned;
  // otherwise (or above what the rank serves) returns cudaErrorInvalidValue.
  cudaError_t fused_allreduce_rmsnorm(const void* in, const void* residual, const void* weight, float eps,
                                      void* norm_out, void* residual_out, size_t rows, size_t hidden, DType dtype,
                                      cudaStream_t stream) const;
  // The same, its normalised rows quantised to FP8 e4m3 (fused/quant.cuh: vLLM's arithmetic) into
  // q.out and q.scale by `scheme` instead of being stored: fp16 and bf16 rows. `residual_out` may
  // be nullptr (not stored). The two-launch path all-reduces into residual_out, or into
  // `workspace` (rows x hidden of dtype) where residual_out is nullptr or `residual` itself
  // (fused_quant_workspace says when). Refuses (cudaErrorInvalidValue) what the plain op refuses,
  // quant_scheme_refusal and fused_quant_overlap_refusal (quant.h), and q.out not 16-byte aligned
  // or q.scale not 4-byte aligned.
  cudaError_t fused_allreduce_rmsnorm_quant(const void* in, const void* residual, const void* weight, float eps,
                                            const QuantOut& q, QuantScheme scheme, int group_size,
                                            void* residual_out, void* workspace, size_t rows, size_t hidden,
                                            DType dtype, cudaStream_t stream) const;
  FusedLaunch fused_quant_launch(size_t rows, size_t hidden, DType dtype, QuantScheme scheme, int group_size) const;
  // Whether a quantising call of this shape needs a workspace (two launches, and residual_out is
  // nullptr or residual itself).
  bool fused_quant_workspace(size_t rows, size_t hidden, DType dtype, QuantScheme scheme, int group_size,
                             const void* residual, const void* residual_out) const;
  bool fused_one_launch(size_t rows, size_t hidden, DType dtype) const;
  FusedLaunch fused_launch(size_t rows, size_t hidden, DType dtype) const;  // fused_launch_for(config())

  // Expert parallelism (ep.cuh), on a rank whose Config::ep_slot_bytes is not 0. `counts[r]` is
  // rank r's tokens, the same array on every rank. Dispatch: every tensor of every rank into
  // every rank's `out` (rows of 4-byte multiples, pointers 4-byte aligned, at most kEpMaxParts
  // tensors). Combine: `in` is [T_0 + ... + T_{N-1}, hidden] of dtype, `out` this rank's
  // [T_me, hidden] summed over the ranks in rank order (rows of 16-byte multiples, pointers
  // 16-byte aligned). Every rank must make the same calls. Returns cudaErrorInvalidValue for what
  // it does not serve (ep_gather_serves / ep_combine_serves say it first, from values every rank
  // shares) and for bad pointers, else the launch's error; no tokens anywhere: no launch.
  cudaError_t ep_gather(const EpTensor* tensors, int n, const uint32_t* counts, cudaStream_t stream) const;
  cudaError_t ep_reduce_scatter(const void* in, void* out, size_t hidden, DType dtype, const uint32_t* counts,
                                cudaStream_t stream) const;
  bool ep_gather_serves(const size_t* row_bytes, int n, const uint32_t* counts) const;
  bool ep_combine_serves(size_t hidden, DType dtype, const uint32_t* counts) const;
  size_t ep_slot_bytes() const { return layout_.ep_slot; }

  uint64_t device_calls() const;      // synchronising read of LocalState::calls
  uint64_t device_fused_calls() const;  // synchronising read of LocalState::fused_calls
  std::string abort_message() const;  // "" unless a kernel gave up waiting
  bool aborted() const;               // a kernel of this rank gave up (host-mapped record: no CUDA call)
  const Config& config() const { return config_; }
  size_t buffer_bytes() const { return layout_.total; }
  int device() const { return device_; }
  int rank() const { return rank_; }
  int world() const { return world_; }
  bool connected() const;  // every other rank's buffer is mapped

 private:
  ExchangeArgs exchange_args(const void* in, void* out, size_t nbytes, const CallDesc& desc) const;
  CallCheck call_check(const CallDesc& desc) const;
  StreamArgs stream_args(const void* in, void* out, size_t nbytes, const Plan& p, const CallDesc& desc) const;
  char* peer_buf() const { return bufs_[1 - rank_]; }  // two ranks: the peer's buffer, mapped
  RanksArgs ranks_args(const void* in, void* out, size_t nbytes, const CallDesc& desc) const;
  EpArgs ep_args(const uint32_t* counts, const CallDesc& desc) const;
  cudaError_t ranks_fused(const void* in, const void* residual, const void* weight, float eps, void* norm_out,
                          void* residual_out, size_t rows, size_t hidden, DType dtype, cudaStream_t stream) const;

  int device_;
  int rank_;
  int world_;
  Config config_;
  SharedLayout layout_;
  char* shared_ = nullptr;       // mine, IPC-exported
  std::array<char*, kMaxRanks> bufs_{};  // every rank's buffer as mapped here (bufs_[rank_] = shared_)
  bool peer_is_ipc_ = false;
  LocalState* state_ = nullptr;
  AbortInfo* abort_host_ = nullptr;
  AbortInfo* abort_dev_ = nullptr;
};

}  // namespace yali
