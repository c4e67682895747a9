// The quantising fused all-reduce + RMSNorm (Rank::fused_allreduce_rmsnorm_quant): the fused op's
// kernels with the FP8 epilogue of quant.cuh (their kQ instances), launched as the plain op's.
// N ranks: the kernels built for any world size (kW = 0).
#include "yali/common/launch.cuh"
#include "yali/communicator.h"
#include "yali/fused/fused.cuh"
#include "yali/fused/n_rank_fused.cuh"

namespace yali {

namespace {

// f(zero of the element type) for the 16-bit types the quantising epilogue takes.
template <typename F>
cudaError_t with_half_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::F16: return f(__half{});
    case DType::BF16: return f(__nv_bfloat16{});
    default: return cudaErrorInvalidValue;
  }
}

// f(std::integral_constant<QuantScheme, s>{}).
template <typename F>
cudaError_t with_scheme(QuantScheme s, F&& f) {
  switch (s) {
    case QuantScheme::Static: return f(std::integral_constant<QuantScheme, QuantScheme::Static>{});
    case QuantScheme::PerToken: return f(std::integral_constant<QuantScheme, QuantScheme::PerToken>{});
    case QuantScheme::Group: return f(std::integral_constant<QuantScheme, QuantScheme::Group>{});
    default: return cudaErrorInvalidValue;
  }
}

// f(std::integral_constant<int, kV>{}) for the launch's vectors per thread.
template <typename F>
cudaError_t with_row_vecs(int per_thread, F&& f) {
  switch (per_thread) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 8: return f(std::integral_constant<int, 8>{});
    default: return cudaErrorInvalidValue;
  }
}

// Two ranks (and the epilogue of the two-launch path at every world size).
template <typename T, int kV, QuantScheme kQ>
cudaError_t launch_quant(const FusedArgs& a, const FusedLaunch& l, cudaStream_t stream) {
  void (*kernel)(FusedArgs);
  if (!l.one_launch) kernel = add_rmsnorm_kernel<T, kV, kQ>;
  else if (l.batch_poll) kernel = l.row_loads_early ? fused_allreduce_rmsnorm_kernel<T, kV, true, true, kQ>
                                                    : fused_allreduce_rmsnorm_kernel<T, kV, true, false, kQ>;
  else kernel = l.row_loads_early ? fused_allreduce_rmsnorm_kernel<T, kV, false, true, kQ>
                                  : fused_allreduce_rmsnorm_kernel<T, kV, false, false, kQ>;
  return launch(kernel, l.grid, kFlashThreads, stream, l.pdl, a, l.cluster);
}

// N ranks, one launch.
template <typename T, int kV, QuantScheme kQ>
cudaError_t launch_quant_ranks(const FusedRanksArgs& a, const FusedLaunch& l, cudaStream_t stream) {
  if (l.spread > 1) return launch(fused_ranks_spread_kernel<T, kV, 0, kQ>, l.grid, kFlashThreads, stream, l.pdl, a, l.cluster);
  return launch(l.row_loads_early ? fused_ranks_kernel<T, kV, true, 0, kQ> : fused_ranks_kernel<T, kV, false, 0, kQ>,
                l.grid, kFlashThreads, stream, l.pdl, a, l.cluster);
}

// Calls f(zero of T, integral_constant kV, integral_constant kQ) for the call's instance.
template <typename F>
cudaError_t with_instance(DType dtype, int per_thread, QuantScheme scheme, F&& f) {
  return with_half_type(dtype, [&](auto zero) {
    return with_row_vecs(per_thread, [&](auto v) { return with_scheme(scheme, [&](auto q) { return f(zero, v, q); }); });
  });
}

// The bytes from a's first to its last scale (all strides non-negative: quant_scheme_refusal).
size_t scale_span_bytes(QuantScheme s, const QuantOut& q, size_t rows, size_t groups) {
  if (s == QuantScheme::Static) return sizeof(float);
  if (s == QuantScheme::PerToken) return (size_t(q.row_stride) * (rows - 1) + 1) * sizeof(float);
  return (size_t(q.row_stride) * (rows - 1) + size_t(q.group_stride) * (groups - 1) + 1) * sizeof(float);
}

}  // namespace

FusedLaunch Rank::fused_quant_launch(size_t rows, size_t hidden, DType dtype, QuantScheme scheme,
                                     int group_size) const {
  return fused_quant_launch_for(config_, rows, hidden, dtype, world_, int(scheme), group_size);
}

bool Rank::fused_quant_workspace(size_t rows, size_t hidden, DType dtype, QuantScheme scheme, int group_size,
                                 const void* residual, const void* residual_out) const {
  return !fused_quant_launch(rows, hidden, dtype, scheme, group_size).one_launch &&
         (residual_out == nullptr || residual_out == residual);
}

cudaError_t Rank::fused_allreduce_rmsnorm_quant(const void* in, const void* residual, const void* weight, float eps,
                                                const QuantOut& q, QuantScheme scheme, int group_size,
                                                void* residual_out, void* workspace, size_t rows, size_t hidden,
                                                DType dtype, cudaStream_t stream) const {
  if (dtype != DType::F16 && dtype != DType::BF16) return cudaErrorInvalidValue;
  const size_t row_bytes = hidden * dtype_size(dtype);
  const uintptr_t any = reinterpret_cast<uintptr_t>(in) | reinterpret_cast<uintptr_t>(residual) |
                        reinterpret_cast<uintptr_t>(weight) | reinterpret_cast<uintptr_t>(q.out) |
                        reinterpret_cast<uintptr_t>(residual_out) | reinterpret_cast<uintptr_t>(workspace);
  if (!connected() || rows == 0 || hidden == 0 || row_bytes % 16 != 0 || row_bytes > kFusedMaxRowBytes ||
      any % 16 != 0 || reinterpret_cast<uintptr_t>(q.scale) % 4 != 0 || q.out == nullptr || q.scale == nullptr ||
      rows > size_t(INT32_MAX) ||
      quant_scheme_refusal(scheme, rows, hidden, group_size, q.row_stride, q.group_stride) != nullptr)
    return cudaErrorInvalidValue;
  const size_t nbytes = rows * row_bytes, groups = scheme == QuantScheme::Group ? hidden / size_t(group_size) : 1;
  if (fused_quant_overlap_refusal(in, residual, weight, q.out, residual_out, q.scale, nbytes, row_bytes, rows * hidden,
                                  scale_span_bytes(scheme, q, rows, groups), scheme != QuantScheme::Static) != nullptr)
    return cudaErrorInvalidValue;
  QuantOut qa = q;
  qa.group_vecs = scheme == QuantScheme::Group ? int(size_t(group_size) * dtype_size(dtype) / 16) : 0;
  const FusedLaunch l = fused_quant_launch(rows, hidden, dtype, scheme, group_size);
  const Kernel k = world_ > 2 ? Kernel::PushOneShot : Kernel::FlashPush;
  const CallDesc desc = call_desc(CallOp::Fused, k, nbytes, dtype, l.grid,
                                  hidden | size_t(quant_desc_bits(scheme, group_size, q.ue8m0 != 0)) << 16);
  const RowNorm n{residual, weight, nullptr, residual_out, int(rows), int(row_bytes / 16), int(hidden), eps};
  if (l.one_launch && world_ > 2) {
    const FusedRanksArgs a{ranks_args(in, nullptr, nbytes, desc), n, qa};
    return with_instance(dtype, l.row_vecs_per_thread, scheme, [&](auto zero, auto v, auto s) {
      return launch_quant_ranks<decltype(zero), decltype(v)::value, decltype(s)::value>(a, l, stream);
    });
  }
  FusedArgs a{};
  a.n = n;
  a.q = qa;
  if (l.one_launch) {
    a.x = exchange_args(in, nullptr, nbytes, desc);
  } else {
    // The all-reduce into residual_out (the epilogue reads each vector of the sum before it
    // writes the same vector of residual_out), or into the workspace where residual_out is
    // missing or is the residual, which the sum would overwrite before it is read.
    void* sum = residual_out != nullptr && residual_out != residual ? residual_out : workspace;
    if (sum == nullptr || ranges_overlap(sum, nbytes, in, nbytes) ||
        (residual != nullptr && ranges_overlap(sum, nbytes, residual, nbytes)))
      return cudaErrorInvalidValue;
    const cudaError_t e = all_reduce(in, sum, nbytes, dtype, stream, config_.mode, &desc);
    if (e != cudaSuccess) return e;
    a.x.state = state_;  // the epilogue counts the fused call there
    a.sum = sum;
  }
  return with_instance(dtype, l.row_vecs_per_thread, scheme, [&](auto zero, auto v, auto s) {
    return launch_quant<decltype(zero), decltype(v)::value, decltype(s)::value>(a, l, stream);
  });
}

}  // namespace yali
