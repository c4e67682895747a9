"""One rank's compute of a Llama layer on one GPU, per model shape, TP size and token count, and
each GEMM's slowdown while a stand-in for YALI's all-reduce holds its CTAs (the overlap model's
one-GPU inputs; `model.py` turns them into step times).

Per (shape, tp, phase, tokens), one rank's shards in bf16: the qkv / o_proj / gate_up / down GEMMs
(F.linear, cuBLAS), attention, the embedding lookup, the lm_head GEMM, and rope (neox), SiLU-and-mul
and the residual add + RMSNorm as one kernel each (ELEMENTWISE_SRC, the memory traffic of vLLM's
rotary_embedding, silu_and_mul and fused_add_rms_norm; checked against torch before timing).
Attention: decode, `tokens` sequences of one query over DECODE_KV_LEN cached tokens (1024 prompt +
64 output: the committed serving runs' 1024 in / 128 out) as two batched GEMMs and a softmax
(reads the KV once, no paging); prefill, ceil(tokens / 1024) prompts of up to 1024 tokens, causal,
torch SDPA (flash backend) over K/V expanded to the query heads outside the timed region.

Timing: each op captured in a CUDA graph over rotating copies of its inputs and weights (at least
ROTATE_BYTES a rotation, so the 50 MB L2 does not hold them), replayed after warm-up, median per
op of the replays. The token counts' halves are measured too (the split's cost).

Contention: a stand-in kernel of k CTAs (k = YALI's CTAs for that message: yali_vllm.config,
plan.cpp's tables) on a second stream reads and writes the all-reduce's bytes (`--standin-passes`
times) and then polls until the all-reduce's committed time has passed (the one-launch fused call's
time; above its sizes the plain all-reduce's, the add + RMSNorm being a kernel of its own); the GEMM is launched
~STANDIN_LEAD_US after it (as under a running all-reduce), timed with events, median of many, and
against the same gated launch without the stand-in. Left out: the NVLink traffic itself (the peers'
stores arriving in this GPU's memory while it computes, and the NVLink/L2 fabric they use), the
wait for the slowest rank (an all-reduce that a slow peer stretches stays longer under the GEMM),
and the clock/power effects of a GPU that also sends.

Footprint: the stand-in's CTAs run 512 threads and 18 registers a thread, no shared memory; YALI's
run 512 threads and 96-128 registers (launch bounds (kFlashThreads, 1)). A cuBLAS Hopper GEMM CTA
needs nearly all of an SM's registers and most of its shared memory, so it shares an SM with
neither: for the GEMMs the two take the same SMs. Smaller kernels (norm, rope) could share an SM
with the stand-in but not with YALI's kernel; the model uses only the GEMMs' slowdowns.

`--dry-run`: the same code on the CPU with the tiny shape, float32, a host clock and no stand-in
(contended = alone), the elementwise ops as torch ops: checks that the script runs, not a timing.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from research.overlap import inputs as I  # noqa: E402

KIND = "overlap-compute"
ROTATE_BYTES = 256 << 20
MAX_ROTATIONS = 128
GEMMS = ("qkv", "o_proj", "gate_up", "down")
STANDIN_LEAD_US = 2.0
STANDIN_THREADS = 512  # YALI's kernels run 512 threads a CTA (config.h kFlashThreads)

STANDIN_SRC = r"""
extern "C" __global__ void __launch_bounds__(512) standin(const int4* __restrict__ src, int4* __restrict__ dst,
    long long n_vec, int passes, unsigned long long duration_ns, volatile int* flag) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  const long long stride = (long long)gridDim.x * blockDim.x;
  bool late = false;
  for (int p = 0; p < passes && !late; ++p)
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n_vec; i += stride) {
      int4 v = src[i];
      v.x ^= p + 1;
      dst[i] = v;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
      if (t - t0 >= duration_ns) { late = true; break; }  // the copies never outlast the all-reduce
    }
  do {  // poll like a receiver waiting for a peer's flag
    if (*flag == 12345) break;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < duration_ns);
}
"""

# One kernel each for rope (neox, in place over q and k), SiLU-and-mul and the residual add +
# RMSNorm, on bf16 as raw 16-bit words: the reads and writes of vLLM's kernels for these ops.
ELEMENTWISE_SRC = r"""
typedef unsigned short bf16;
__device__ __forceinline__ float ld(bf16 v) { return __uint_as_float(((unsigned)v) << 16); }
__device__ __forceinline__ bf16 st(float f) {
  unsigned u = __float_as_uint(f);
  return (bf16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

extern "C" __global__ void rope_neox(bf16* __restrict__ qk, const float* __restrict__ cos,
    const float* __restrict__ sin, int heads, int head_dim) {
  const int t = blockIdx.x, half = head_dim / 2;
  bf16* row = qk + (long long)t * heads * head_dim;
  for (int j = threadIdx.x; j < heads * half; j += blockDim.x) {
    const int h = j / half, i = j % half;
    const float c = cos[(long long)t * half + i], s = sin[(long long)t * half + i];
    const float x1 = ld(row[h * head_dim + i]), x2 = ld(row[h * head_dim + half + i]);
    row[h * head_dim + i] = st(x1 * c - x2 * s);
    row[h * head_dim + half + i] = st(x2 * c + x1 * s);
  }
}

extern "C" __global__ void silu_and_mul(const bf16* __restrict__ gu, bf16* __restrict__ out,
    long long tokens, int inter) {
  const long long n = tokens * inter;
  for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += (long long)gridDim.x * blockDim.x) {
    const long long t = k / inter, i = k % inter;
    const float g = ld(gu[t * 2 * inter + i]), u = ld(gu[t * 2 * inter + inter + i]);
    out[k] = st(g / (1.0f + __expf(-g)) * u);
  }
}

// One CTA a row: res_out = x + res; out = res_out * rsqrt(mean(res_out^2) + eps) * w.
extern "C" __global__ void add_rmsnorm(const bf16* __restrict__ x, const bf16* __restrict__ res,
    const bf16* __restrict__ w, bf16* __restrict__ out, bf16* __restrict__ res_out, int hidden, float eps) {
  __shared__ float warp_sums[32];
  const long long base = (long long)blockIdx.x * hidden;
  float sq = 0.f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float s = ld(x[base + i]) + ld(res[base + i]);
    const bf16 r = st(s);
    res_out[base + i] = r;
    sq += ld(r) * ld(r);
  }
  for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = sq;
  __syncthreads();
  float total = 0.f;
  for (int k = 0; k < (int)(blockDim.x >> 5); ++k) total += warp_sums[k];
  const float inv = rsqrtf(total / hidden + eps);
  for (int i = threadIdx.x; i < hidden; i += blockDim.x)
    out[base + i] = st(ld(res_out[base + i]) * inv * ld(w[i]));
}
"""
ELEMENTWISE_THREADS = 256
NORM_EPS = 1e-5


class Elementwise:
    """rope, SiLU-and-mul and add + RMSNorm: one kernel each on a GPU (ELEMENTWISE_SRC, checked
    against the torch ops once), the torch ops themselves on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            import cupy

            self.cupy = cupy
            mod = cupy.RawModule(code=ELEMENTWISE_SRC)
            self.k = {n: mod.get_function(n) for n in ("rope_neox", "silu_and_mul", "add_rmsnorm")}
            self.check(device)

    def _launch(self, name, grid, args):
        stream = self.cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        with stream:
            self.k[name]((grid,), (ELEMENTWISE_THREADS,), args)

    def rope(self, qk, cos, sin):
        """qk: (tokens, heads, d) rotated in place (neox halves); cos, sin: (tokens, 1, d / 2) float32."""
        if not self.cuda:
            d = qk.shape[-1]
            x1, x2 = qk[..., : d // 2].clone(), qk[..., d // 2:].clone()
            qk[..., : d // 2] = x1 * cos - x2 * sin
            qk[..., d // 2:] = x2 * cos + x1 * sin
            return qk
        c = self.cupy
        self._launch("rope_neox", qk.shape[0], (c.uint64(qk.data_ptr()), c.uint64(cos.data_ptr()),
                                                c.uint64(sin.data_ptr()), c.int32(qk.shape[1]), c.int32(qk.shape[2])))
        return qk

    def act(self, gu, out):
        inter = gu.shape[1] // 2
        if not self.cuda:
            out.copy_(F.silu(gu[:, :inter]) * gu[:, inter:])
            return out
        c = self.cupy
        grid = min(4 * 132, math.ceil(gu.shape[0] * inter / ELEMENTWISE_THREADS))
        self._launch("silu_and_mul", grid, (c.uint64(gu.data_ptr()), c.uint64(out.data_ptr()),
                                            c.int64(gu.shape[0]), c.int32(inter)))
        return out

    def norm(self, x, res, w, out, res_out):
        if not self.cuda:
            s = x.float() + res.float()
            res_out.copy_(s)
            y = res_out.float() * torch.rsqrt(res_out.float().pow(2).mean(-1, keepdim=True) + NORM_EPS)
            out.copy_(y * w.float())
            return out
        c = self.cupy
        self._launch("add_rmsnorm", x.shape[0], (c.uint64(x.data_ptr()), c.uint64(res.data_ptr()),
                                                 c.uint64(w.data_ptr()), c.uint64(out.data_ptr()),
                                                 c.uint64(res_out.data_ptr()), c.int32(x.shape[1]),
                                                 c.float32(NORM_EPS)))
        return out

    def check(self, device):
        """Each kernel against the torch ops in float32 on a small input (bf16 tolerance)."""
        torch.manual_seed(1)
        t, heads, d, inter, h = 5, 3, 64, 96, 320
        qk = torch.randn(t, heads, d, device=device).to(torch.bfloat16)
        ang = torch.rand(t, 1, d // 2, device=device) * 6.0
        cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
        x1, x2 = qk.float()[..., : d // 2], qk.float()[..., d // 2:]
        want = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        got = self.rope(qk.clone(), cos, sin)
        gu = torch.randn(t, 2 * inter, device=device).to(torch.bfloat16)
        want_act = F.silu(gu.float()[:, :inter]) * gu.float()[:, inter:]
        got_act = self.act(gu, torch.empty(t, inter, dtype=torch.bfloat16, device=device))
        x, r = (torch.randn(t, h, device=device).to(torch.bfloat16) for _ in range(2))
        w = torch.randn(h, device=device).to(torch.bfloat16)
        s = (x.float() + r.float()).to(torch.bfloat16).float()
        want_norm = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + NORM_EPS) * w.float()
        out, res_out = torch.empty_like(x), torch.empty_like(x)
        self.norm(x, r, w, out, res_out)
        torch.cuda.synchronize()
        for name, a, b in (("rope_neox", got, want), ("silu_and_mul", got_act, want_act),
                           ("add_rmsnorm", out, want_norm), ("add_rmsnorm residual", res_out, s)):
            if not torch.allclose(a.float(), b, rtol=2e-2, atol=2e-2):
                err = (a.float() - b).abs().max().item()
                raise RuntimeError(f"elementwise kernel {name} differs from torch: max abs error {err:.4f}")


class Timer:
    """Times ops on a device: CUDA graphs + events on a GPU, the host clock on the CPU."""

    def __init__(self, device: torch.device, replays: int, budget_ms: float):
        self.device, self.replays, self.budget_ms = device, replays, budget_ms
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def op_us(self, fn, n_rot: int) -> float:
        """Median us of one call of fn(i) (i: the rotation) over replays of all n_rot rotations."""
        if not self.cuda:
            for i in range(n_rot):
                fn(i)
            ts = []
            for _ in range(max(3, self.replays // 10)):
                t0 = time.perf_counter()
                for i in range(n_rot):
                    fn(i)
                ts.append((time.perf_counter() - t0) * 1e6 / n_rot)
            return statistics.median(ts)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                for i in range(n_rot):
                    fn(i)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(n_rot):
                fn(i)
        g.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        once_ms = (time.perf_counter() - t0) * 1e3
        n = max(5, min(self.replays, int(self.budget_ms / max(once_ms, 1e-3))))
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for a, b in ev:
            a.record()
            g.replay()
            b.record()
        torch.cuda.synchronize()
        del g
        return statistics.median(a.elapsed_time(b) for a, b in ev) * 1e3 / n_rot


class Standin:
    """The all-reduce's stand-in: k CTAs copying the message's bytes, then polling until a deadline."""

    def __init__(self, device: torch.device):
        import cupy

        self.cupy = cupy
        self.kernel = cupy.RawKernel(STANDIN_SRC, "standin")
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        self.stream = torch.cuda.Stream()
        self.cstream = cupy.cuda.ExternalStream(self.stream.cuda_stream)
        self.device = device
        clock_probe = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        clock_probe[0].record()
        torch.cuda._sleep(1_000_000)
        clock_probe[1].record()
        torch.cuda.synchronize()
        self.cycles_per_us = 1_000_000 / (clock_probe[0].elapsed_time(clock_probe[1]) * 1e3)

    def buffers(self, nbytes: int):
        n = max(16, (nbytes + 15) // 16 * 16)
        src = torch.randint(-2**30, 2**30, (n // 4,), dtype=torch.int32, device=self.device)
        return src, torch.empty_like(src)

    def launch(self, ctas: int, bufs, passes: int, duration_us: float):
        src, dst = bufs
        args = (self.cupy.uint64(src.data_ptr()), self.cupy.uint64(dst.data_ptr()),
                self.cupy.int64(src.numel() // 4), self.cupy.int32(passes),
                self.cupy.uint64(int(duration_us * 1000)), self.cupy.uint64(self.flag.data_ptr()))
        with self.cstream:
            self.kernel((ctas,), (STANDIN_THREADS,), args)

    def gated_us(self, fn, n_rot: int, iters: int, standin=None) -> list[float]:
        """fn(i) timed with events, each launch gated behind a host-covering sleep; with
        `standin=(ctas, bufs, passes, duration_us)` the stand-in starts STANDIN_LEAD_US before it."""
        main = torch.cuda.current_stream()
        out = []
        gate, lead = torch.cuda.Event(), int(STANDIN_LEAD_US * self.cycles_per_us)
        for it in range(iters + 2):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(int(200 * self.cycles_per_us))  # the host queues what follows meanwhile
            gate.record(main)
            if standin is not None:
                self.stream.wait_event(gate)
                ctas, bufs, passes, dur = standin
                self.launch(ctas, bufs, passes, dur + STANDIN_LEAD_US)
            torch.cuda._sleep(lead)
            a.record(main)
            fn(it % n_rot)
            b.record(main)
            main.wait_stream(self.stream)
            out.append((a, b))
        torch.cuda.synchronize()
        return [a.elapsed_time(b) * 1e3 for a, b in out[2:]]

    def alone_us(self, ctas: int, bufs, passes: int, duration_us: float) -> float:
        """The stand-in's own time (its deadline, or its copies where they take longer)."""
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(7):
            with torch.cuda.stream(self.stream):  # the launch is queued before the clock starts
                torch.cuda._sleep(int(100 * self.cycles_per_us))
            a.record(self.stream)
            self.launch(ctas, bufs, passes, duration_us)
            b.record(self.stream)
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) * 1e3)
        return statistics.median(ts[2:])


def n_rotations(set_bytes: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return max(1, min(MAX_ROTATIONS, math.ceil(ROTATE_BYTES / max(set_bytes, 1))))


def randn(shape, dtype, device, scale=1.0):
    return (torch.randn(shape, dtype=torch.float32, device=device) * scale).to(dtype)


def layer_ops(shape: I.Shape, tp: int, phase: str, tokens: int, dtype, device, ew: Elementwise):
    """{op: (fn(i), n_rot)} of one rank's layer at `tokens`, with rotating inputs; plus the step's
    embedding lookup and lm_head GEMM; `ew` runs rope, SiLU-and-mul and add + RMSNorm."""
    h, d = shape.hidden, shape.head_dim
    hq, hkv, inter = shape.heads // tp, shape.kv_heads // tp, shape.intermediate // tp
    qkv_out = (hq + 2 * hkv) * d
    esz = torch.finfo(dtype).bits // 8
    ops = {}

    def gemm(name, k, n, rows=tokens):
        rot = n_rotations((rows * k + k * n) * esz, device)
        xs = [randn((rows, k), dtype, device) for _ in range(rot)]
        ws = [randn((n, k), dtype, device, 1 / math.sqrt(k)) for _ in range(rot)]
        ops[name] = (lambda i: F.linear(xs[i], ws[i]), rot)

    gemm("qkv", h, qkv_out)
    gemm("o_proj", hq * d, h)
    gemm("gate_up", h, 2 * inter)
    gemm("down", inter, h)
    rows = tokens if phase == "decode" else I.prefill_prompts(tokens)[0]  # logits of the sampled rows
    gemm("lm_head", h, shape.vocab // tp, rows=rows)

    rot = n_rotations(tokens * qkv_out * esz, device)
    qk = [randn((tokens, hq + hkv, d), dtype, device) for _ in range(rot)]
    ang = torch.rand((tokens, 1, d // 2), device=device) * 6.0
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
    ops["rope"] = (lambda i: ew.rope(qk[i], cos, sin), rot)

    rot = n_rotations(tokens * 3 * inter * esz, device)
    gu = [randn((tokens, 2 * inter), dtype, device) for _ in range(rot)]
    act_out = [torch.empty((tokens, inter), dtype=dtype, device=device) for _ in range(rot)]
    ops["act"] = (lambda i: ew.act(gu[i], act_out[i]), rot)

    rot = n_rotations(tokens * h * esz * 4, device)
    xs = [randn((tokens, h), dtype, device) for _ in range(rot)]
    rs = [randn((tokens, h), dtype, device) for _ in range(rot)]
    outs = [(torch.empty_like(xs[0]), torch.empty_like(xs[0])) for _ in range(rot)]
    wn = randn((h,), dtype, device)
    ops["norm"] = (lambda i: ew.norm(xs[i], rs[i], wn, *outs[i]), rot)

    table = randn((shape.vocab // tp, h), dtype, device)
    ids = [torch.randint(0, shape.vocab // tp, (tokens,), device=device) for _ in range(4)]
    ops["embed"] = (lambda i: F.embedding(ids[i], table), 4)

    ops["attn"] = attention_op(phase, tokens, hq, hkv, d, dtype, device)
    return ops


def attention_op(phase, tokens, hq, hkv, d, dtype, device):
    esz = torch.finfo(dtype).bits // 8
    scale = 1 / math.sqrt(d)
    if phase == "decode":
        L, g = I.DECODE_KV_LEN, hq // hkv
        rot = n_rotations(2 * tokens * hkv * L * d * esz, device)
        q = [randn((tokens, hkv, g, d), dtype, device) for _ in range(rot)]
        k = [randn((tokens, hkv, L, d), dtype, device) for _ in range(rot)]
        v = [randn((tokens, hkv, L, d), dtype, device) for _ in range(rot)]

        def decode(i):
            s = torch.matmul(q[i], k[i].transpose(-1, -2)) * scale
            return torch.matmul(torch.softmax(s.float(), dim=-1).to(dtype), v[i])

        return decode, rot
    prompts, per = I.prefill_prompts(tokens)
    rot = n_rotations(3 * prompts * hq * per * d * esz, device)
    qkv = [[randn((prompts, hq, per, d), dtype, device) for _ in range(3)] for _ in range(rot)]
    for t in qkv:  # K/V of hkv heads, expanded to the query heads outside the timed region
        for j in (1, 2):
            t[j] = t[j][:, :hkv].repeat_interleave(hq // hkv, dim=1).contiguous()
    backends = [torch.nn.attention.SDPBackend.FLASH_ATTENTION] if device.type == "cuda" else None

    def prefill(i):
        q, k, v = qkv[i]
        if backends is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with torch.nn.attention.sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return prefill, rot


def standin_duration_us(fused_us: float, source: str, norm_us: float) -> float:
    """How long the all-reduce holds its CTAs: the one-launch fused call's whole time; where the
    fused call is an all-reduce followed by the add + RMSNorm kernel (`source` "allreduce ..."),
    the all-reduce's part."""
    return fused_us - norm_us if source.startswith("allreduce") else fused_us


def measure_config(shape, tp, phase, tokens, timer, standin, comm, args, dtype, device, ew):
    """Rows of one (shape, tp, phase, tokens): every op's time; each GEMM's under the stand-in."""
    ops = layer_ops(shape, tp, phase, tokens, dtype, device, ew)
    rows = []
    base = {"model_shape": shape.name, "tp": tp, "phase": phase, "tokens": tokens}
    for name, (fn, rot) in ops.items():
        rows.append({**base, "op": name, "us_p50": round(timer.op_us(fn, rot), 3), "rotations": rot})
    by_op = {r["op"]: r for r in rows}
    ctas, kernel = I.yali_ctas(shape.hidden, tokens, tp) if comm is not None else (1, "none")
    fused_us = None
    if comm is not None:
        fused_us, source = comm.fused_us(shape.hidden, tokens, by_op["norm"]["us_p50"], I.yali_serves(tp))
        fused_us = standin_duration_us(fused_us, source, by_op["norm"]["us_p50"])
    nbytes = I.message_bytes(shape, tokens)
    if standin is None:  # CPU: no second stream; the row says contention was not measured
        for g in GEMMS:
            by_op[g].update(standin_ctas=ctas, standin_kernel=kernel, standin_us=fused_us,
                            alone_gated_us=by_op[g]["us_p50"], contended_us_p50=by_op[g]["us_p50"],
                            contention_measured=False)
        return rows
    bufs = standin.buffers(nbytes)
    standin_alone = standin.alone_us(ctas, bufs, args.standin_passes, fused_us)
    for g in GEMMS:
        fn, rot = ops[g]
        alone = statistics.median(standin.gated_us(fn, rot, args.contention_iters))
        hit = statistics.median(standin.gated_us(fn, rot, args.contention_iters,
                                                 (ctas, bufs, args.standin_passes, fused_us)))
        by_op[g].update(standin_ctas=ctas, standin_kernel=kernel, standin_us=round(fused_us, 3),
                        standin_alone_us=round(standin_alone, 3), standin_bytes=nbytes,
                        alone_gated_us=round(alone, 3), contended_us_p50=round(hit, 3),
                        contention_measured=True)
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the result JSON to write (e.g. $OUT/overlap-compute.json)")
    p.add_argument("--shapes", default="8b,70b", help="model shapes (8b, 70b; tiny with --dry-run)")
    p.add_argument("--tp", default="2,4", help="tensor-parallel sizes")
    p.add_argument("--decode-tokens", default=",".join(map(str, I.DECODE_TOKENS)))
    p.add_argument("--prefill-tokens", default=",".join(map(str, I.PREFILL_TOKENS)))
    p.add_argument("--replays", type=int, default=50, help="graph replays per op (at most)")
    p.add_argument("--budget-ms", type=float, default=150.0, help="GPU time per op's replays (caps --replays)")
    p.add_argument("--contention-iters", type=int, default=25, help="gated launches per GEMM, alone and contended")
    p.add_argument("--standin-passes", type=int, default=2,
                   help="times the stand-in reads and writes the message (2: a two-rank one-shot's send and receive)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shape, float32: checks the script runs")
    a = p.parse_args(argv)
    a.shapes = [s for s in a.shapes.split(",") if s]
    a.tp = [int(x) for x in a.tp.split(",") if x]
    a.decode_tokens = tuple(int(x) for x in a.decode_tokens.split(",") if x)
    a.prefill_tokens = tuple(int(x) for x in a.prefill_tokens.split(",") if x)
    if a.dry_run and a.shapes == ["8b", "70b"]:
        a.shapes = ["tiny"]
    for s in a.shapes:
        if s not in I.SHAPES:
            p.error(f"--shapes: unknown shape {s!r} (have {', '.join(I.SHAPES)})")
        if s == "tiny" and not a.dry_run:
            p.error("--shapes tiny is for --dry-run only")
    return a


def header(args, device) -> dict:
    from benchmarks.common.results import results_header

    extra = {
        "shapes": {s: vars(I.SHAPES[s]) for s in args.shapes},
        "decode_kv_len": I.DECODE_KV_LEN,
        "prompt_tokens": I.PROMPT_TOKENS,
        "standin": {"threads": STANDIN_THREADS, "passes": args.standin_passes, "lead_us": STANDIN_LEAD_US,
                    "ctas_from": "yali_vllm.config.fused_plan / plan (plan.cpp); NCCL sizes assume "
                                 f"{I.NCCL_CTAS} CTAs",
                    "omits": "the NVLink traffic: peers' stores landing in this GPU's memory and the fabric "
                             "they use, the wait for the slowest rank, a sending GPU's clocks and power"},
        "comm_files": {str(tp): I.CommTimes(tp).files for tp in args.tp} if not args.dry_run else {},
        "dry_run": args.dry_run,
    }
    if args.dry_run:
        extra["cpu_only"] = True
    doc = results_header(KIND, extra, world_size=1)
    doc["shared_gpu"] = False
    if args.dry_run:
        doc["host"] = "no GPU (CPU dry run)"
        doc["gpus"] = []
    return doc


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or pass --dry-run")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    torch.manual_seed(0)
    timer = Timer(device, args.replays, args.budget_ms)
    standin = None if args.dry_run else Standin(device)
    ew = Elementwise(device)
    doc = header(args, device)
    rows, t_start = [], time.time()
    for sname in args.shapes:
        shape = I.SHAPES[sname]
        for tp in args.tp:
            shape.check_tp(tp)
            comm = I.CommTimes(tp)
            for phase, toks in (("decode", args.decode_tokens), ("prefill", args.prefill_tokens)):
                for tokens in I.token_set(phase, toks):
                    got = measure_config(shape, tp, phase, tokens, timer, standin, comm, args, dtype, device, ew)
                    rows += got
                    by = {r["op"]: r for r in got}
                    layer = sum(by[o]["us_p50"] for o in ("qkv", "rope", "attn", "o_proj", "gate_up", "act", "down"))
                    slow = " ".join(f"{g} +{by[g]['contended_us_p50'] - by[g]['alone_gated_us']:.1f}" for g in GEMMS)
                    print(f"[{time.time() - t_start:6.1f}s] {sname} tp={tp} {phase} {tokens:5d} tok: layer "
                          f"{layer:9.1f} us; under stand-in ({by['qkv']['standin_ctas']} CTAs, "
                          f"{by['qkv']['standin_us'] or 0:.1f} us): {slow}", flush=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    doc["records"] = rows
    doc["elapsed_s"] = round(time.time() - t_start, 1)
    from benchmarks.common.results import write_results

    path = write_results(args.out, doc)
    print(f"wrote {path}: {len(rows)} rows in {doc['elapsed_s']} s (kind {KIND}, world_size 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
