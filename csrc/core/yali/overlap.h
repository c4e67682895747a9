// Copy-engine overlap of a row-parallel GEMM with its all-reduce + residual add + RMSNorm
// (the prefill path): one GPU's side. No torch here: the torch op layer drives it.
//
// The GEMM runs in row chunks on the caller's stream (cuBLAS, outside this file). After each
// chunk, on a side stream that waited for the chunk's GEMM, send() has the copy engine push
// the chunk's partial sums into the peer's receive slot (cudaMemcpyAsync into the peer's
// IPC-mapped buffer: no SM), then a 1-thread kernel stores the chunk's flag in the peer's
// buffer with release semantics. consume() is one kernel on the caller's stream: per chunk it
// waits for the peer's flag (watchdog: YALI_TIMEOUT_S), then per row adds its own partial and
// the peer's (both in local memory; fp32 sum rounded once to T, as a plain all-reduce returns
// it), the residual, and normalises with fused.cuh's epilogue, bit for bit.
//
// Receive slots: two, chosen by the host alternately (slot = call count & 1, the same on both
// ranks). Two suffice without any wait: the peer's copies into my slot for call e+2 are issued
// after its consumer of call e+1, which needed my copies of e+1, which my side stream issues
// after my main stream's GEMMs of e+1, which follow my consumer of e: my consumer of e (the
// last reader of that slot) is done before the slot is written again. The slot is a host value
// in a captured CUDA graph, so a graph replayed after other calls can repeat a slot; every
// counter is therefore on the device (sends/recvs per slot, advanced by the kernels), the
// flags carry those counts, and before the first copy of a call the side stream waits (one
// thread) until the peer has consumed every earlier call sent to that slot (a credit the
// peer's consumer stores). With the alternation intact that wait is already satisfied.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "config.h"
#include "layout.h"
#include "rank.h"

namespace yali {

constexpr int kOverlapMaxChunks = 16;                  // GEMM chunks (flags) per call and slot
constexpr size_t kOverlapDefaultSlotBytes = 32u << 20;  // per slot; larger calls go in windows
// SMs the consumer leaves free: its CTAs spin on the peer's flags, and this GPU's own flag
// kernels (side stream) must still find an SM, or both GPUs' consumers wait for each other.
constexpr int kOverlapFreeSms = 4;

// Device state only this GPU touches, advanced by the kernels (CUDA-graph safe).
struct OverlapState {
  uint64_t sends[2];   // calls this GPU sent into the peer's slot s
  uint64_t recvs[2];   // calls this GPU consumed from its own slot s
  uint64_t done_ctas;  // consumer CTAs finished in the running call (the last one resets it)
  uint64_t calls;      // consumer calls that ran (graph replays included)
};

// The shared buffer: flags first (written only by the peer), then the two receive slots.
struct OverlapLayout {
  size_t ready = 0;   // [2][kOverlapMaxChunks]: peer's send count whose chunk c is in my slot s
  size_t credit = 0;  // [2]: my sends into the peer's slot s that the peer consumed
  size_t flags_end = 0;
  size_t slots = 0;  // [2][slot_bytes]
  size_t total = 0;
  explicit OverlapLayout(size_t slot_bytes) {
    ready = 0;
    credit = ready + sizeof(uint64_t) * 2 * kOverlapMaxChunks;
    flags_end = (credit + sizeof(uint64_t) * 2 + 255) / 256 * 256;
    slots = flags_end;
    total = slots + 2 * slot_bytes;
  }
};

// Why an overlap kernel gave up (AbortInfo::what): kOverlapWaitCredit, or 1 + the chunk whose
// ready flag it waited for.
constexpr int kOverlapWaitCredit = 100;

class Overlap {
 public:
  // Allocates this GPU's shared buffer (two slots of slot_bytes) and state. Throws std::runtime_error.
  Overlap(int device, int rank, size_t slot_bytes, double timeout_s);
  ~Overlap();
  Overlap(const Overlap&) = delete;
  Overlap& operator=(const Overlap&) = delete;

  IpcHandleBytes ipc_handle() const;
  void open_peer(const IpcHandleBytes& peer);
  void close_peer();  // waits for this GPU's work, then unmaps the peer's buffer

  // On `stream` (the side stream): for chunk 0 first the slot's credit wait, then the copy of
  // nbytes from `src` to byte `offset` of the peer's slot `slot`, then chunk `chunk`'s flag.
  cudaError_t send(const void* src, size_t offset, size_t nbytes, int slot, int chunk, cudaStream_t stream) const;
  // On `stream` (the main stream): rows x hidden; `partial` is my GEMM output, chunk c holds rows
  // [c * chunk_rows, (c + 1) * chunk_rows). `residual` may be nullptr and may alias `residual_out`.
  cudaError_t consume(const void* partial, const void* residual, const void* weight, float eps, void* norm_out,
                      void* residual_out, size_t rows, size_t hidden, size_t chunk_rows, DType dtype, int slot,
                      cudaStream_t stream) const;

  uint64_t device_calls() const;  // synchronising read of OverlapState::calls
  bool aborted() const;
  std::string abort_message() const;  // "" unless an overlap kernel gave up waiting
  size_t slot_bytes() const { return slot_bytes_; }
  size_t buffer_bytes() const { return layout_.total; }
  int device() const { return device_; }
  bool connected() const { return peer_shared_ != nullptr; }

 private:
  int device_;
  int rank_;
  size_t slot_bytes_;
  uint64_t timeout_ns_;
  double timeout_s_;
  int consumer_ctas_;
  OverlapLayout layout_;
  char* shared_ = nullptr;       // mine, IPC-exported
  char* peer_shared_ = nullptr;  // the peer's, mapped
  OverlapState* state_ = nullptr;
  AbortInfo* abort_host_ = nullptr;
  AbortInfo* abort_dev_ = nullptr;
};

}  // namespace yali
