"""One rank's compute of a Llama layer on one GPU, per model shape, TP size and token count, and
each GEMM's slowdown while a stand-in for YALI's all-reduce holds its CTAs (the overlap model's
one-GPU inputs; `model.py` turns them into step times).

Per (shape, tp, phase, tokens), one rank's shards in bf16: the qkv / o_proj / gate_up / down GEMMs
(F.linear, cuBLAS), rope and SiLU-and-mul as plain torch ops (vLLM runs one kernel for each: an
upper bound), attention, the residual add + RMSNorm, the embedding lookup and the lm_head GEMM.
Attention: decode, `tokens` sequences of one query over DECODE_KV_LEN cached tokens (1024 prompt +
64 output: the committed serving runs' 1024 in / 128 out) as two batched GEMMs and a softmax
(reads the KV once, no paging); prefill, ceil(tokens / 1024) prompts of up to 1024 tokens, causal,
torch SDPA (flash backend) over K/V expanded to the query heads outside the timed region.

Timing: each op captured in a CUDA graph over rotating copies of its inputs and weights (at least
ROTATE_BYTES a rotation, so the 50 MB L2 does not hold them), replayed after warm-up, median per
op of the replays. The token counts' halves are measured too (the split's cost).

Contention: a stand-in kernel of k CTAs (k = YALI's CTAs for that message: yali_vllm.config,
plan.cpp's tables) on a second stream reads and writes the all-reduce's bytes (`--standin-passes`
times) and then polls until the fused call's committed time has passed; the GEMM is launched
~STANDIN_LEAD_US after it (as under a running all-reduce), timed with events, median of many, and
against the same gated launch without the stand-in. Left out: the NVLink traffic itself (the peers'
stores arriving in this GPU's memory while it computes, and the NVLink/L2 fabric they use), the
wait for the slowest rank (an all-reduce that a slow peer stretches stays longer under the GEMM),
and the clock/power effects of a GPU that also sends.

`--dry-run`: the same code on the CPU with the tiny shape, float32, a host clock and no stand-in
(contended = alone): checks that the script runs, not a timing.
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


def layer_ops(shape: I.Shape, tp: int, phase: str, tokens: int, dtype, device):
    """{op: (fn(i), n_rot)} of one rank's layer at `tokens`, with rotating inputs; plus the step's
    embedding lookup and lm_head GEMM."""
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
    cos = randn((tokens, 1, d // 2), dtype, device)
    sin = randn((tokens, 1, d // 2), dtype, device)

    def rope(i):
        x1, x2 = qk[i][..., : d // 2], qk[i][..., d // 2:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    ops["rope"] = (rope, rot)

    rot = n_rotations(tokens * 2 * inter * esz, device)
    gu = [randn((tokens, 2 * inter), dtype, device) for _ in range(rot)]
    ops["act"] = (lambda i: F.silu(gu[i][:, :inter]) * gu[i][:, inter:], rot)

    rot = n_rotations(tokens * h * esz * 2, device)
    xs = [randn((tokens, h), dtype, device) for _ in range(rot)]
    rs = [randn((tokens, h), dtype, device) for _ in range(rot)]
    wn = randn((h,), dtype, device)

    def norm(i):
        s = xs[i].float() + rs[i].float()
        y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)
        return (y * wn.float()).to(dtype), s.to(dtype)

    ops["norm"] = (norm, rot)

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


def measure_config(shape, tp, phase, tokens, timer, standin, comm, args, dtype, device):
    """Rows of one (shape, tp, phase, tokens): every op's time; each GEMM's under the stand-in."""
    ops = layer_ops(shape, tp, phase, tokens, dtype, device)
    rows = []
    base = {"model_shape": shape.name, "tp": tp, "phase": phase, "tokens": tokens}
    for name, (fn, rot) in ops.items():
        rows.append({**base, "op": name, "us_p50": round(timer.op_us(fn, rot), 3), "rotations": rot})
    by_op = {r["op"]: r for r in rows}
    ctas, kernel = I.yali_ctas(shape.hidden, tokens, tp) if comm is not None else (1, "none")
    fused_us = None
    if comm is not None:
        fused_us, _ = comm.fused_us(shape.hidden, tokens, by_op["norm"]["us_p50"], I.yali_serves(tp))
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
    doc = header(args, device)
    rows, t_start = [], time.time()
    for sname in args.shapes:
        shape = I.SHAPES[sname]
        for tp in args.tp:
            shape.check_tp(tp)
            comm = I.CommTimes(tp)
            for phase, toks in (("decode", args.decode_tokens), ("prefill", args.prefill_tokens)):
                for tokens in I.token_set(phase, toks):
                    got = measure_config(shape, tp, phase, tokens, timer, standin, comm, args, dtype, device)
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
