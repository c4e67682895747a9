#!/usr/bin/env python3
"""Layer-level benchmark of a row-parallel linear layer followed by all-reduce + residual add +
RMSNorm at prefill sizes, TP=2 on two GPUs:

  gemm      torch.mm alone (the floor: what the layer would cost with a free all-reduce)
  unfused   torch.mm, YALI all-reduce, vLLM's fused_add_rms_norm kernel (torch.ops._C; the
            same arithmetic in torch when vLLM's kernels are not importable: said in the result)
  fused     torch.mm, then YALI's fused all-reduce + residual add + RMSNorm
  overlap   YaliCommunicator.gemm_allreduce_rmsnorm: the GEMM in row chunks, each chunk's partial
            sums pushed to the peer by the copy engine while the next computes (one entry per
            --chunks value)

for the o_proj and down_proj shapes of Llama-3 8B (hidden 4096, intermediate 14336 / 2) and 70B
(hidden 8192, intermediate 28672 / 2) at --tokens (default 512-8192). Each variant is captured in
a CUDA graph of --ops back-to-back layers and timed with CUDA events around its replays; the
variants are timed in --rounds rounds, the order alternating (forward, then reversed), and the
report gives each one's median per-layer time over all rounds, with the exposed all-reduce
(variant - gemm). Before timing, every shape's overlap and fused results are compared (residual
bitwise, norm_out bitwise or within the fused op's tolerance) and the comparison is recorded.

Writes <out>/<name>.json (kind layer-overlap-bench) and <name>.md. Needs two GPUs with P2P:
with one (YALI_ALLOW_SHARED_GPU=1 puts both ranks on it) it refuses, since the memory in
between is then local and its timings mean nothing.

Run from the repository root, as a module (it imports the benchmarks' helpers by package):
  python -m benchmarks.layer_overlap_bench --quick
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import traceback

from benchmarks.common.cli_args import choice_list, positive_int, positive_int_list
from benchmarks.common.gpu_env import MULTICAST_OFF_ENV
from benchmarks.common.processes import run_two_ranks
from benchmarks.common.results import output_dir, results_header, write_json_and_markdown
from benchmarks.common.timing import replay_per_op

os.environ.update(MULTICAST_OFF_ENV)

# (model, layer) -> (hidden, k): the row-parallel GEMM [tokens, k] x [k, hidden] on one rank of TP=2.
SHAPES = {
    ("8b", "o_proj"): (4096, 4096 // 2),
    ("8b", "down_proj"): (4096, 14336 // 2),
    ("70b", "o_proj"): (8192, 8192 // 2),
    ("70b", "down_proj"): (8192, 28672 // 2),
}
MODELS = ("8b", "70b")
DEFAULT_TOKENS = "512,1024,2048,4096,8192"
EPS = 1e-5


def vllm_norm(torch):
    """(name, fn(s, residual, weight, eps) -> None): vLLM's fused_add_rms_norm kernel in place
    (s <- norm, residual <- s + residual), or the same arithmetic in torch."""
    try:
        import importlib

        importlib.import_module("vllm._custom_ops")  # registers torch.ops._C
        if hasattr(torch.ops._C, "fused_add_rms_norm"):
            return "vllm fused_add_rms_norm", torch.ops._C.fused_add_rms_norm
    except Exception:  # noqa: BLE001 - no vLLM kernels here: the torch version below
        pass

    def torch_norm(s, residual, weight, eps):
        z = s.float() + residual.float()
        residual.copy_(z)
        s.copy_((z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps)).to(s.dtype) * weight)

    return "torch (vLLM's native arithmetic)", torch_norm


def variants(torch, comm, t, chunks, norm):
    """name -> op() for one shape's static tensors `t`."""
    x, w, res, nw, norm_out, res_out, partial = (t[k] for k in ("x", "w", "res", "nw", "norm", "res_out", "partial"))
    res_u = res.clone()  # the unfused variant's residual, which its norm updates in place

    def gemm():
        torch.mm(x, w.t(), out=partial)

    def unfused():
        torch.mm(x, w.t(), out=partial)
        comm.all_reduce(partial, out=partial)
        norm(partial, res_u, nw, EPS)  # in place, as vLLM runs it: partial <- norm, res_u <- sum + res_u

    def fused():
        torch.mm(x, w.t(), out=partial)
        comm.fused_allreduce_rmsnorm(partial, res, nw, EPS, norm_out=norm_out, residual_out=res_out)

    ops = {"gemm": gemm, "unfused": unfused, "fused": fused}
    for c in chunks:
        ops[f"overlap-{c}"] = (lambda c=c: comm.gemm_allreduce_rmsnorm(x, w, res, nw, EPS, chunks=c,
                                                                        norm_out=norm_out, residual_out=res_out))
    return ops


def capture(torch, op, n_ops):
    """A CUDA graph of `n_ops` calls of op, captured after warm-up calls on a side stream."""
    cur = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        for _ in range(3):
            op()
    cur.wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n_ops):
            op()
    torch.cuda.synchronize()
    return g


def check(torch, comm, t, chunks):
    """The overlapped result against the fused op on the partial sums of the same chunks."""
    from yali_vllm import overlap

    x, w, res, nw = t["x"], t["w"], t["res"], t["nw"]
    partial = torch.empty_like(t["partial"])
    for w0, w1 in overlap.windows(x.shape[0], w.shape[0] * x.element_size()):
        for b, e in overlap.chunk_bounds(w1 - w0, chunks):
            torch.mm(x[w0 + b:w0 + e], w.t(), out=partial[w0 + b:w0 + e])
    fn, fr = comm.fused_allreduce_rmsnorm(partial, res, nw, EPS)
    on, orr = comm.gemm_allreduce_rmsnorm(x, w, res, nw, EPS, chunks=chunks)
    torch.cuda.synchronize()
    return {"residual_bitwise": bool(torch.equal(orr.view(torch.int16), fr.view(torch.int16))),
            "norm_bitwise": bool(torch.equal(on.view(torch.int16), fn.view(torch.int16))),
            "norm_max_abs": float((on.float() - fn.float()).abs().max().item())}


def worker(rank, port, args, q):
    try:
        import torch
        import torch.distributed as dist

        from yali_vllm.communicator import YaliCommunicator

        torch.cuda.set_device(rank)
        os.environ["YALI_OVERLAP"] = "1"  # the overlap's receive slots are allocated only when it is on
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        comm = YaliCommunicator(dist.group.WORLD, torch.device("cuda", rank))
        norm_name, norm = vllm_norm(torch)
        rows = []
        for model in args.models:
            for layer in ("o_proj", "down_proj"):
                hidden, k = SHAPES[(model, layer)]
                for tokens in args.tokens:
                    g = torch.Generator(device="cuda").manual_seed(tokens * 31 + hidden + rank)
                    dev, dt = torch.device("cuda", rank), torch.bfloat16

                    def rnd(shape, scale):
                        return (torch.randn(shape, generator=g, device=dev) * scale).to(dt)

                    t = {"x": rnd((tokens, k), 1.0), "w": rnd((hidden, k), k ** -0.5), "res": rnd((tokens, hidden), 1.0),
                         "nw": rnd((hidden,), 0.1) + 1, "norm": torch.empty((tokens, hidden), dtype=dt, device=dev),
                         "res_out": torch.empty((tokens, hidden), dtype=dt, device=dev),
                         "partial": torch.empty((tokens, hidden), dtype=dt, device=dev)}
                    checks = {c: check(torch, comm, t, c) for c in args.chunks}
                    ops = variants(torch, comm, t, args.chunks, norm)
                    graphs = {name: capture(torch, op, args.ops) for name, op in ops.items()}
                    times = {name: [] for name in ops}
                    order = list(ops)
                    for r in range(args.rounds):
                        for name in (order if r % 2 == 0 else order[::-1]):
                            dist.barrier()  # both ranks replay the same graph together
                            times[name] += replay_per_op(torch, graphs[name], args.ops, args.replays)
                    del graphs
                    row = {"model": model, "layer": layer, "tokens": tokens, "hidden": hidden, "k": k,
                           "us_p50": {n: statistics.median(v) for n, v in times.items()},
                           "us_min": {n: min(v) for n, v in times.items()}, "checks": checks}
                    rows.append(row)
                    if rank == 0:
                        print(f"{model} {layer} tokens={tokens}: " + ", ".join(
                            f"{n} {v:.1f}" for n, v in row["us_p50"].items()) + " us", flush=True)
        comm.close()
        dist.destroy_process_group()
        q.put((rank, {"rows": rows, "norm": norm_name}))
    except BaseException:
        traceback.print_exc()
        q.put((rank, None))


def markdown(res) -> str:
    chunk_names = [n for n in res["records"][0]["us_p50"] if n.startswith("overlap-")] if res["records"] else []
    head = ["model", "layer", "tokens", "gemm", "unfused", "fused", *chunk_names, "best overlap vs unfused",
            "vs fused", "exposed all-reduce: unfused / fused / best overlap"]
    lines = [f"# Row-parallel GEMM + all-reduce + RMSNorm, TP=2, bf16 ({res['date']})", "",
             f"Per-layer time in us, median of {res['rounds']} rounds x {res['replays']} replays of CUDA graphs of "
             f"{res['ops']} layers; norm of the unfused variant: {res['norm']}.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in res["records"]:
        p = r["us_p50"]
        best = min(chunk_names, key=lambda n: p[n]) if chunk_names else None
        cells = [r["model"], r["layer"], str(r["tokens"])] + [f"{p[n]:.1f}" for n in ("gemm", "unfused", "fused", *chunk_names)]
        if best:
            cells += [f"{p['unfused'] / p[best]:.2f}x", f"{p['fused'] / p[best]:.2f}x",
                      f"{p['unfused'] - p['gemm']:.1f} / {p['fused'] - p['gemm']:.1f} / {p[best] - p['gemm']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    bad = [f"{r['model']} {r['layer']} {r['tokens']} chunks={c}: {v}" for r in res["records"]
           for c, v in r["checks"].items() if not v["residual_bitwise"]]
    lines += ["", "Checks (overlap against the fused op on the same partial sums): "
              + ("residual_out bitwise equal everywhere." if not bad else "MISMATCHES: " + "; ".join(bad))]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=lambda s: choice_list(s, MODELS, "model"), default=list(MODELS))
    p.add_argument("--tokens", type=lambda s: positive_int_list(s, "token count"), default=DEFAULT_TOKENS)
    p.add_argument("--chunks", type=lambda s: positive_int_list(s, "chunk count"), default="2,4,8")
    p.add_argument("--ops", type=positive_int, default=8, help="layers per CUDA graph")
    p.add_argument("--replays", type=positive_int, default=20, help="timed replays per round")
    p.add_argument("--rounds", type=positive_int, default=4, help="rounds, order alternating")
    p.add_argument("--quick", action="store_true", help="512 and 4096 tokens, 2 rounds")
    p.add_argument("--out", default=str(output_dir()))
    p.add_argument("--name", default=time.strftime("layer-overlap-%Y%m%d-%H%M%S"))
    p.add_argument("--timeout", type=positive_int, default=1800, help="seconds for the whole run")
    return p


def refusal(torch) -> str | None:
    """Why this machine gives no timings, or None."""
    from yali_vllm.communicator import shared_gpu_allowed

    if shared_gpu_allowed():
        return "YALI_ALLOW_SHARED_GPU=1 is for correctness tests only: two ranks on one GPU time nothing real"
    if torch.cuda.device_count() < 2:
        return f"needs two GPUs with P2P, {torch.cuda.device_count()} visible"
    if not torch.cuda.can_device_access_peer(0, 1):
        return "GPUs 0 and 1 have no P2P access"
    return None


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.quick:
        args.tokens, args.rounds = [512, 4096], 2
    import torch

    why = refusal(torch)
    if why:
        raise SystemExit(f"layer_overlap_bench: {why}")
    res = run_two_ranks(worker, args, args.timeout, "layer overlap benchmark")
    if res is None:
        raise SystemExit("layer_overlap_bench: a rank failed (see its traceback above)")
    out = results_header("layer-overlap-bench", {
        "method": "per-layer time = CUDA-graph replay time / layers per graph (CUDA events around replays), "
                  "median over rounds x replays, variant order alternating per round",
        "ops": args.ops, "replays": args.replays, "rounds": args.rounds, "norm": res["norm"],
        "shapes": {f"{m} {layer}": {"hidden": h, "k": k} for (m, layer), (h, k) in SHAPES.items()},
    })
    out["records"] = res["rows"]
    md = markdown(out)
    path = write_json_and_markdown(args.out, args.name, out, md)
    print(md)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
