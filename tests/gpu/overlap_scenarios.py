"""Checks of the overlapped row-parallel GEMM + all-reduce + RMSNorm that run inside both ranks of
a pair (see pair.py; test_overlap.py asserts on them).

Each rank regenerates both ranks' inputs from a seed, so it can compute the reference itself:
the two partial sums with the same row chunks and windows as the op (torch.mm on the same slices,
so cuBLAS returns the same bits), then
  * the fp32 reference (scenarios.fused_reference: residual_out bitwise, norm_out within the
    fused op's tolerance), and
  * the exact epilogue: YALI's fused op on the same partial sums, bitwise wherever it runs whole
    rows per CTA as the overlap's consumer does (fused_launch split 1).
Outputs are poisoned with NaN before every call."""
from __future__ import annotations

import random
import time

import torch

from yali_vllm import overlap
from yali_vllm.communicator import YaliCommunicator

from .scenarios import DTYPES, capture_after_warmup, compare_fused, digest, fused_reference, mismatches, run_steps

K = 256  # this rank's slice of the GEMM's inner dimension (small: the tests check the exchange)


def overlap_inputs(seed: int, tokens: int, hidden: int, dtype: torch.dtype, device, with_residual: bool = True):
    """(x of rank 0, x of rank 1, linear weight of rank 0, of rank 1, residual or None, norm
    weight), identical on both ranks for a seed."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(shape, scale):
        return torch.randn(shape, generator=g, device=device, dtype=torch.float32).mul_(scale).to(dtype)

    x0, x1 = rnd((tokens, K), 1.0), rnd((tokens, K), 1.0)
    w0, w1 = rnd((hidden, K), K ** -0.5), rnd((hidden, K), K ** -0.5)
    residual = rnd((tokens, hidden), 2.0) if with_residual else None
    norm_weight = (torch.randn((hidden,), generator=g, device=device) * 0.5 + 1.0).to(dtype)
    return x0, x1, w0, w1, residual, norm_weight


def partial_sums(x: torch.Tensor, w: torch.Tensor, chunks: int) -> torch.Tensor:
    """x @ w.T computed on the op's row slices (windows, then chunks), as the op computes it."""
    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    for w0, w1 in overlap.windows(x.shape[0], w.shape[0] * x.element_size()):
        for b, e in overlap.chunk_bounds(w1 - w0, chunks):
            torch.mm(x[w0 + b:w0 + e], w.t(), out=out[w0 + b:w0 + e])
    return out


def _tag(spec) -> str:
    return (f"{spec['dtype']} tokens={spec['tokens']} hidden={spec['hidden']} chunks={spec['chunks']} "
            f"residual={spec['residual']} inplace={spec.get('inplace', False)}")


def _launch(comm, spec, rank, seed, dev):
    """Draws one call's inputs, launches it on poisoned outputs; returns what the check needs."""
    dtype = DTYPES[spec["dtype"]]
    x0, x1, w0, w1, residual, nw = overlap_inputs(seed, spec["tokens"], spec["hidden"], dtype, dev, spec["residual"])
    x, w = (x0, w0) if rank == 0 else (x1, w1)
    keep_res = residual.clone() if residual is not None else None
    norm = torch.full((spec["tokens"], spec["hidden"]), float("nan"), dtype=dtype, device=dev)
    if spec.get("inplace") and residual is not None:
        res_in = residual.clone()
        res_out = res_in
    else:
        res_in, res_out = residual, torch.full_like(norm, float("nan"))
    refused = not comm.can_overlap(x, w, res_in, nw)
    if not refused:
        comm.gemm_allreduce_rmsnorm(x, w, res_in, nw, spec["eps"], chunks=spec["chunks"], norm_out=norm,
                                    residual_out=res_out)
    return {"spec": spec, "refused": refused, "x": (x0, x1), "w": (w0, w1), "residual": keep_res, "nw": nw,
            "norm": norm, "res_out": res_out, "res_in": res_in}


def _check(comm, call, rank, exact: bool) -> tuple[list[str], str, bool]:
    """(problems, digest of the outputs, whether the bitwise epilogue check applied). With `exact`
    the fused op runs on the reference partials: a collective, so both ranks must pass the same."""
    spec, problems = call["spec"], []
    if call["refused"]:
        return [f"{_tag(spec)}: can_overlap() refused"], "", False
    p0, p1 = (partial_sums(call["x"][r], call["w"][r], spec["chunks"]) for r in range(2))
    ref_norm, ref_res = fused_reference(p0, p1, call["residual"], call["nw"], spec["eps"])
    c = compare_fused(call["norm"], call["res_out"], ref_norm, ref_res)
    if not c["ok"]:
        problems.append(f"{_tag(spec)}: vs the fp32 reference: residual_out {c['residual_mismatches']} bitwise "
                        f"mismatches, norm_out {c['norm_nonfinite']} non-finite, max {c['norm_max_ulp']} ulp")
    bitwise = False
    mine = p0 if rank == 0 else p1
    if exact and comm.can_fuse(mine, call["residual"], call["nw"]):  # the same answer on both ranks
        # the fused op keeps whole rows per CTA: the same epilogue, bit for bit
        yn, yr = comm.fused_allreduce_rmsnorm(mine, call["residual"], call["nw"], spec["eps"])
        bitwise = True
        bad = mismatches(call["norm"], yn) + mismatches(call["res_out"], yr)
        if bad:
            problems.append(f"{_tag(spec)}: {bad} elements differ bitwise from the fused op's epilogue")
    if call["res_out"] is not call["res_in"] and call["residual"] is not None \
            and mismatches(call["res_in"], call["residual"]):
        problems.append(f"{_tag(spec)}: the residual was modified although residual_out is another tensor")
    return problems, digest(call["norm"], call["res_out"]), bitwise


def overlap_sweep(rank, group, plan, seed, comm):
    """One call per entry of `plan` (dtype, tokens, hidden, chunks, residual, eps, inplace), each
    checked against both references before the next. Returns failures, digests, counts."""
    dev = torch.device("cuda", torch.cuda.current_device())
    failures, digests, bitwise = [], [], 0
    before = comm.overlap_calls()
    launched = windows = 0
    for k, spec in enumerate(plan):
        call = _launch(comm, spec, rank, seed + k, dev)
        torch.cuda.synchronize(dev)
        launched += not call["refused"]
        row_bytes = spec["hidden"] * torch.empty(0, dtype=DTYPES[spec["dtype"]]).element_size()
        windows += len(overlap.windows(spec["tokens"], row_bytes))
        problems, d, exact = _check(comm, call, rank, exact=True)
        failures += problems
        digests.append(d)
        bitwise += exact
    return {"failures": failures, "digests": digests, "launched": launched, "bitwise_checked": bitwise,
            "device_overlap_calls": comm.overlap_calls() - before, "expected_windows": windows}


def overlap_stress(rank, group, calls, batch, seed, comm):
    """Copy-then-flag ordering under load: `calls` overlapped calls of random shapes, chunk counts
    and dtypes with fresh inputs, launched `batch` at a time back to back (the slots alternate,
    flags of later calls race the consumers of earlier ones), then every result checked."""
    dev = torch.device("cuda", torch.cuda.current_device())
    rng = random.Random(seed)
    failures, digests, checked = [], [], 0
    before = comm.overlap_calls()
    windows = 0
    i = 0
    while i < calls:
        pending = []
        for _ in range(min(batch, calls - i)):
            i += 1
            spec = {"dtype": rng.choice(("bf16", "fp16")), "tokens": rng.choice((1, 5, 64, 511, 512, 777, 1300)),
                    "hidden": rng.choice((2048, 4096, 8192)), "chunks": rng.choice((1, 2, 3, 4, 7, 16)),
                    "residual": rng.random() < 0.7, "eps": 1e-5, "inplace": rng.random() < 0.5}
            windows += len(overlap.windows(spec["tokens"], spec["hidden"] * 2))
            pending.append(_launch(comm, spec, rank, seed * 7919 + i, dev))
        torch.cuda.synchronize(dev)
        for call in pending:
            problems, d, _ = _check(comm, call, rank, exact=False)
            failures += problems
            digests.append(d)
            checked += 1
    return {"failures": failures, "digests": digests, "checked": checked,
            "device_overlap_calls": comm.overlap_calls() - before, "expected_windows": windows}


# Captured together in one graph: an overlapped call with the residual updated in place, a
# plain all-reduce, one without a residual in two windows (hidden 16384 bf16: 1024 rows per
# slot), and a fused all-reduce + RMSNorm. Three overlap windows per replay: an odd count, so
# consecutive replays start on different slots and repeat one at the boundary (the device-side
# credit keeps that exact).
GRAPH_SPECS = (
    {"dtype": "bf16", "tokens": 600, "hidden": 4096, "chunks": 4, "residual": True, "inplace": True, "eps": 1e-6},
    {"dtype": "bf16", "tokens": 1500, "hidden": 16384, "chunks": 3, "residual": False, "eps": 1e-5},
)


def overlap_graph(rank, group, replays, pool, seed, comm):
    """Captures GRAPH_SPECS' overlapped calls, a plain all-reduce and a fused call in one CUDA graph
    (the overlap's side stream forks from and joins the capturing stream inside the capture) and
    replays it `replays` times, every replay on one of `pool` input sets loaded into the static
    tensors, outputs poisoned first; every replay is checked on the GPU against the exact
    reference (the same graph's first replay of the set, itself checked against the fp32
    reference) with no host sync per replay. Eager calls run between replays too."""
    dev = torch.device("cuda", torch.cuda.current_device())
    st = []
    for spec in GRAPH_SPECS:
        dtype = DTYPES[spec["dtype"]]
        t, h = spec["tokens"], spec["hidden"]
        b = {"x": torch.zeros((t, K), dtype=dtype, device=dev), "w": torch.zeros((h, K), dtype=dtype, device=dev),
             "nw": torch.ones(h, dtype=dtype, device=dev), "norm": torch.zeros((t, h), dtype=dtype, device=dev),
             "res": torch.zeros((t, h), dtype=dtype, device=dev) if spec["residual"] else None}
        b["res_out"] = b["res"] if spec.get("inplace") else torch.zeros((t, h), dtype=dtype, device=dev)
        st.append(b)
    ar = torch.zeros(100_003, dtype=torch.bfloat16, device=dev)
    ar_out = torch.zeros_like(ar)
    fx = torch.zeros((8, 4096), dtype=torch.bfloat16, device=dev)
    fw = torch.ones(4096, dtype=torch.bfloat16, device=dev)
    fnorm, fres = torch.zeros_like(fx), torch.zeros_like(fx)

    def body():
        a, b = st
        comm.gemm_allreduce_rmsnorm(a["x"], a["w"], a["res"], a["nw"], GRAPH_SPECS[0]["eps"],
                                    chunks=GRAPH_SPECS[0]["chunks"], norm_out=a["norm"], residual_out=a["res_out"])
        comm.all_reduce(ar, out=ar_out)
        comm.gemm_allreduce_rmsnorm(b["x"], b["w"], None, b["nw"], GRAPH_SPECS[1]["eps"],
                                    chunks=GRAPH_SPECS[1]["chunks"], norm_out=b["norm"], residual_out=b["res_out"])
        comm.fused_allreduce_rmsnorm(fx, None, fw, 1e-6, norm_out=fnorm, residual_out=fres)

    sets = []
    for p in range(pool):
        one = []
        for k, spec in enumerate(GRAPH_SPECS):
            x0, x1, w0, w1, res, nw = overlap_inputs(seed + 10 * p + k, spec["tokens"], spec["hidden"],
                                                     DTYPES[spec["dtype"]], dev, spec["residual"])
            p0, p1 = partial_sums(x0, w0, spec["chunks"]), partial_sums(x1, w1, spec["chunks"])
            ref_norm, ref_res = fused_reference(p0, p1, res, nw, spec["eps"])
            one.append({"x": x0 if rank == 0 else x1, "w": w0 if rank == 0 else w1, "res": res, "nw": nw,
                        "ref_norm": ref_norm, "ref_res": ref_res})
        sets.append(one)

    def load(p):
        for b, s in zip(st, sets[p]):
            b["x"].copy_(s["x"])
            b["w"].copy_(s["w"])
            b["nw"].copy_(s["nw"])
            if b["res"] is not None:
                b["res"].copy_(s["res"])
            b["norm"].fill_(float("nan"))
            if b["res_out"] is not b["res"]:
                b["res_out"].fill_(float("nan"))

    load(0)
    g = capture_after_warmup(body, dev)
    before = comm.overlap_calls()
    n = len(GRAPH_SPECS)
    bad_vs_first = torch.zeros(n, dtype=torch.int64, device=dev)
    first, first_problems = {}, []
    eager_failures = []
    t0 = time.time()
    for i in range(replays):
        p = i % pool
        load(p)
        g.replay()
        for k, (b, s) in enumerate(zip(st, sets[p])):
            if (p, k) not in first:
                torch.cuda.synchronize(dev)
                c = compare_fused(b["norm"], b["res_out"], s["ref_norm"], s["ref_res"])
                if not c["ok"]:
                    first_problems.append(f"replay {i} {_tag(GRAPH_SPECS[k])}: {c}")
                first[(p, k)] = (b["norm"].clone(), b["res_out"].clone())
            else:
                fn, fr = first[(p, k)]
                iv = torch.int16
                bad_vs_first[k] += (b["norm"].view(iv) != fn.view(iv)).sum() + (b["res_out"].view(iv) != fr.view(iv)).sum()
        if i % 50 == 25:  # an eager call between replays moves the host's slot alternation
            spec = {"dtype": "bf16", "tokens": 513, "hidden": 2048, "chunks": 5, "residual": True, "eps": 1e-5}
            call = _launch(comm, spec, rank, seed + 5000 + i, dev)
            torch.cuda.synchronize(dev)
            eager_failures += _check(comm, call, rank, exact=False)[0]
    torch.cuda.synchronize(dev)
    out = {"replays": replays, "elapsed_s": time.time() - t0, "first_problems": first_problems,
           "eager_failures": eager_failures, "bad_vs_first": bad_vs_first.tolist(),
           "device_overlap_calls": comm.overlap_calls() - before,
           "digests": [digest(*first[key]) for key in sorted(first)]}
    del g
    return out


def overlap_compiled(rank, group, comm):
    """comm.gemm_allreduce_rmsnorm inside torch.compile(fullgraph=True) with a dynamic token count."""
    dev = torch.device("cuda", torch.cuda.current_device())
    eps = 1e-6

    @torch.compile(fullgraph=True, dynamic=True)
    def f(x, w, residual, nw):
        norm, res = comm.gemm_allreduce_rmsnorm(x * 1, w, residual, nw, eps, chunks=4)
        return norm, res

    failures = []
    for tokens in (512, 777):
        x0, x1, w0, w1, res, nw = overlap_inputs(31 + tokens, tokens, 4096, torch.bfloat16, dev, True)
        norm, r = f(x0 if rank == 0 else x1, w0 if rank == 0 else w1, res, nw)
        ref_norm, ref_res = fused_reference(partial_sums(x0, w0, 4), partial_sums(x1, w1, 4), res, nw, eps)
        torch.cuda.synchronize(dev)
        c = compare_fused(norm, r, ref_norm, ref_res)
        if not c["ok"]:
            failures.append(f"tokens={tokens}: {c}")
    return {"failures": failures}


def overlap_suite(rank, group, plan, stress_calls, graph_replays, seed):
    """The scenarios above in one process pair on one communicator; each scenario's exception is
    reported (with the kernel's abort reason) instead of ending the run."""
    comm = YaliCommunicator(group, torch.device("cuda", torch.cuda.current_device()))
    return run_steps(comm, group, [
        ("sweep", lambda: overlap_sweep(rank, group, plan, seed, comm)),
        ("stress", lambda: overlap_stress(rank, group, stress_calls, 24, seed + 1, comm)),
        ("graph", lambda: overlap_graph(rank, group, graph_replays, 3, seed + 2, comm)),
        ("compiled", lambda: overlap_compiled(rank, group, comm)),
    ])


def overlap_missing_peer(rank, group, wait_s):
    """Rank 1 never issues its overlapped call: rank 0's consumer must give up after
    YALI_TIMEOUT_S and say why (the chunk flag it waited for) instead of hanging."""
    dev = torch.device("cuda", torch.cuda.current_device())
    comm = YaliCommunicator(group, dev)
    x0, x1, w0, w1, res, nw = overlap_inputs(5, 512, 2048, torch.bfloat16, dev, True)
    if rank == 1:
        time.sleep(wait_s)  # alive, buffers mapped, but never calls
        return {"rank": 1}
    t0 = time.time()
    comm.gemm_allreduce_rmsnorm(x0, w0, res, nw, 1e-5)
    try:
        torch.cuda.synchronize(dev)
        err = None
    except Exception as e:  # the trapped kernel surfaces here
        err = str(e)
    return {"error": err, "abort": comm.abort_message(), "elapsed_s": time.time() - t0}
