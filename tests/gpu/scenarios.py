"""Checks that run inside both ranks of a pair (see pair.py). Every check draws
fresh random inputs, poisons the output with NaN, and compares bitwise with the
fp32 reference (a+b in fp32, rounded once to the dtype: exactly what YALI
computes), so both ranks are also bitwise equal to each other."""
from __future__ import annotations

import random
import time

import torch

from yali_vllm.communicator import YaliCommunicator

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _device() -> torch.device:
    """This rank's GPU, as the pair set it (pair.rank_device)."""
    return torch.device("cuda", torch.cuda.current_device())


def inputs(seed: int, n: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Both ranks' inputs for one check; each rank can regenerate its peer's."""
    out = []
    for r in range(2):
        g = torch.Generator(device=device).manual_seed(seed * 2 + r)
        out.append(torch.randn(n, generator=g, device=device, dtype=torch.float32).mul_(4).to(dtype))
    return out[0], out[1]


def reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() + b.float()).to(a.dtype)


def mismatches(out: torch.Tensor, ref: torch.Tensor) -> int:
    iv = INT_VIEW[out.dtype]
    return int((out.view(iv) != ref.view(iv)).sum().item())


def rel_err_fp64(out, a, b) -> float:
    ref = a.double() + b.double()
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def sweep(rank, group, sizes_bytes, odd_counts, dtypes, modes, seed):
    dev = _device()
    comm = YaliCommunicator(group, dev)
    flash_bytes = comm.config["flash_bytes"]
    failures, checked, counter = [], 0, 0
    for dname in dtypes:
        dtype = DTYPES[dname]
        esize = torch.empty(0, dtype=dtype).element_size()
        counts = sorted(set(odd_counts + [max(1, s // esize) for s in sizes_bytes]))
        for n in counts:
            for mode in modes:
                if mode == "flash" and n * esize > flash_bytes:
                    continue
                for inplace in (False, True):
                    counter += 1
                    a, b = inputs(seed + counter, n, dtype, dev)
                    mine = (a if rank == 0 else b).clone()
                    keep = mine.clone()
                    if inplace:
                        out = comm.all_reduce(mine, out=mine, mode=mode)
                    else:
                        out = torch.full_like(mine, float("nan"))
                        comm.all_reduce(mine, out=out, mode=mode)
                    torch.cuda.synchronize(dev)
                    bad = mismatches(out, reference(a, b))
                    if not inplace and mismatches(mine, keep):
                        failures.append(f"{dname} n={n} {mode}: input was modified")
                    err = rel_err_fp64(out, a, b) if n * esize <= (64 << 20) else 0.0
                    tol = 1e-6 if dtype == torch.float32 else 1e-2
                    if bad or not err <= tol:
                        failures.append(f"{dname} n={n} mode={mode} inplace={inplace}: {bad} bitwise mismatches, "
                                        f"fp64 rel err {err:.2e}")
                    checked += 1
                    del a, b, mine, keep, out
    comm.close()
    return {"checked": checked, "failures": failures}


def capture_after_warmup(body, dev) -> "torch.cuda.CUDAGraph":
    """Runs body() once on a side stream (the warm-up outside the capture, as torch asks), waits
    for it, then captures body() into a CUDA graph and returns it."""
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream(dev).wait_stream(side)
    torch.cuda.synchronize(dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    return g


def graph_replays(rank, group, replays, check_every, seed):
    """Captures several all-reduces (flash and stream sizes, in- and out-of-place)
    in one CUDA graph, replays it `replays` times, refreshing the inputs and
    checking every output every `check_every` replays."""
    dev = _device()
    comm = YaliCommunicator(group, dev)
    specs = [(torch.bfloat16, 1023), (torch.float16, 64 << 10), (torch.float32, 1 << 20 | 3),
             (torch.bfloat16, 3 << 20), (torch.bfloat16, 24 << 20), (torch.float32, (12 << 20) + 5)]
    xs = [torch.zeros(n, dtype=dt, device=dev) for dt, n in specs]
    outs = [torch.zeros_like(x) for x in xs]
    inplace_x = torch.zeros(40 << 20, dtype=torch.bfloat16, device=dev)  # stream, in place

    def body():
        for x, o in zip(xs, outs):
            comm.all_reduce(x, out=o)
        comm.all_reduce(inplace_x, out=inplace_x)

    g = capture_after_warmup(body, dev)
    calls_before = comm.device_calls()
    failures, checks = [], 0
    for i in range(replays):
        if i % check_every == 0 or i == replays - 1:
            pairs = [inputs(seed + i * 10 + k, x.numel(), x.dtype, dev) for k, x in enumerate(xs + [inplace_x])]
            for x, (a, b) in zip(xs + [inplace_x], pairs):
                x.copy_(a if rank == 0 else b)
            for o in outs:
                o.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize(dev)
            for k, (o, (a, b)) in enumerate(zip(outs + [inplace_x], pairs)):
                bad = mismatches(o, reference(a, b))
                if bad:
                    failures.append(f"replay {i} op {k}: {bad} mismatches")
            checks += 1
        else:
            g.replay()
    torch.cuda.synchronize(dev)
    calls = comm.device_calls() - calls_before
    comm.close()
    return {"failures": failures, "checks": checks, "device_calls": calls, "expected_calls": replays * (len(xs) + 1)}


def stress(rank, group, calls, seed, max_bytes):
    """`calls` back-to-back all-reduces of random size, dtype, kernel family and
    placement (same random sequence on both ranks); samples are checked."""
    dev = _device()
    comm = YaliCommunicator(group, dev)
    flash_bytes = comm.config["flash_bytes"]
    rng = random.Random(seed)
    pools = {}
    for name, dt in DTYPES.items():
        esize = torch.empty(0, dtype=dt).element_size()
        a, b = inputs(seed + len(pools), max_bytes // esize + 64, dt, dev)
        pools[dt] = (a, b, torch.empty_like(a), torch.empty_like(a))
    failures, checked = [], 0
    t0 = time.time()
    for i in range(calls):
        dt = rng.choice(list(DTYPES.values()))
        esize = torch.empty(0, dtype=dt).element_size()
        n = max(1, int(2 ** rng.uniform(0, 1) * 2 ** rng.uniform(0, (max_bytes // esize).bit_length() - 1)))
        n = min(n, max_bytes // esize)
        off = rng.randrange(0, 64) // (16 // esize) * (16 // esize)  # 16-byte aligned offsets
        mode = rng.choice(["auto", "flash", "stream"])
        if mode == "flash" and n * esize > flash_bytes:
            mode = "auto"
        inplace = rng.random() < 0.3
        a, b, scratch, out = pools[dt]
        src = (a if rank == 0 else b)[off:off + n]
        if inplace:
            x = scratch[off:off + n]
            x.copy_(src)
            o = comm.all_reduce(x, out=x, mode=mode)
        else:
            o = comm.all_reduce(src, out=out[off:off + n], mode=mode)
        if i % 997 == 0 or i == calls - 1:
            torch.cuda.synchronize(dev)
            bad = mismatches(o, reference(a[off:off + n], b[off:off + n]))
            if bad:
                failures.append(f"call {i} ({dt}, n={n}, {mode}, inplace={inplace}): {bad} mismatches")
            checked += 1
    torch.cuda.synchronize(dev)
    elapsed = time.time() - t0
    comm.close()
    return {"failures": failures, "checked": checked, "elapsed_s": elapsed}


def compiled(rank, group):
    """The op inside torch.compile(fullgraph=True): no graph break, right values."""
    dev = _device()
    comm = YaliCommunicator(group, dev)
    handle = comm._handle

    @torch.compile(fullgraph=True)
    def f(x):
        y = x * 2
        out = torch.empty_like(y)
        torch.ops.yali.all_reduce(handle, y, out)
        return out + 1

    a, b = inputs(7, 4096 + 3, torch.bfloat16, dev)
    got = f(a if rank == 0 else b)
    want = (reference(a * 2, b * 2).float() + 1).to(torch.bfloat16)
    torch.cuda.synchronize(dev)
    bad = mismatches(got, want)
    comm.close()
    return {"mismatches": bad}


def missing_peer(rank, group, wait_s):
    """Rank 1 never issues its all-reduce: rank 0's kernel must give up after
    YALI_TIMEOUT_S with a clear reason instead of hanging."""
    dev = _device()
    comm = YaliCommunicator(group, dev)
    x = torch.ones(1 << 10, device=dev)
    if rank == 1:
        time.sleep(wait_s)  # stay alive (our buffer stays mapped) while rank 0 times out
        return {"rank": 1}
    t0 = time.time()
    comm.all_reduce(x)
    try:
        torch.cuda.synchronize(dev)
        err = None
    except Exception as e:  # the trapped kernel surfaces here
        err = str(e)
    return {"error": err, "abort": comm.abort_message(), "elapsed_s": time.time() - t0}


def mismatched_settings(rank, group):
    """A bad or different YALI_* setting on one rank: both ranks refuse, neither hangs."""
    import os

    from yali_vllm.communicator import YaliUnavailable

    if rank == 1:
        os.environ["YALI_DEV_PUSH_CTA_BYTES"] = "999"
    try:
        YaliCommunicator(group, _device())
        first = "created"
    except YaliUnavailable as e:
        first = str(e)
    os.environ["YALI_DEV_PUSH_CTA_BYTES"] = "2K" if rank == 1 else "1K"  # valid but different
    try:
        YaliCommunicator(group, _device())
        second = "created"
    except YaliUnavailable as e:
        second = str(e)
    return {"bad": first, "different": second}


# ------------------------------------------------------------------------------------------------
# Fused all-reduce + residual add + RMSNorm (YaliCommunicator.fused_allreduce_rmsnorm).
#
# The reference is vLLM's native fused_add_rms_norm / rms_norm applied to the all-reduce output
# (vllm/ir/ops/layernorm.py): residual_out must match it bitwise; norm_out may differ where the
# kernel's sum of squares, added in another order, moves a rounding (a few elements, <= 3 ulp in
# fp16/bf16; a relative 1e-5 in fp32). Both ranks must produce identical bits.

FUSED_TOL_16BIT_ULP = 3           # largest norm_out distance from the reference, fp16/bf16
FUSED_MIN_EQUAL_FRAC = 0.99       # fp16/bf16: at least this share of norm_out bitwise equal
FUSED_FP32_RTOL, FUSED_FP32_ATOL = 1e-5, 1e-6


def fused_inputs(seed: int, tokens: int, hidden: int, dtype: torch.dtype, device, with_residual: bool = True):
    """(x of rank 0, x of rank 1, residual or None, weight), identical on both ranks for a seed."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(shape, scale):
        return torch.randn(shape, generator=g, device=device, dtype=torch.float32).mul_(scale)

    x0 = rnd((tokens, hidden), 2.0).to(dtype)
    x1 = rnd((tokens, hidden), 2.0).to(dtype)
    residual = rnd((tokens, hidden), 4.0).to(dtype) if with_residual else None
    weight = rnd((hidden,), 0.5).add_(1.0).to(dtype)
    return x0, x1, residual, weight


def fused_reference(x0, x1, residual, weight, eps: float):
    """(norm_out, residual_out) exactly as vLLM computes all_reduce -> fused_add_rms_norm (or
    rms_norm without a residual) with its native implementation."""
    dtype = x0.dtype
    s = (x0.float() + x1.float()).to(dtype)  # what a plain all-reduce returns
    z = s.float() + residual.float() if residual is not None else s.float()
    residual_out = z.to(dtype)
    variance = z.pow(2).mean(dim=-1, keepdim=True)
    norm_out = ((z * torch.rsqrt(variance + eps)).to(weight.dtype) * weight).to(dtype)
    return norm_out, residual_out


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element, how many representable values of the dtype lie between a and b (int64;
    +0 and -0 are the same value; a NaN is far from everything)."""
    bits = a.element_size() * 8
    sign = 1 << (bits - 1)

    def ordered(t):
        u = t.contiguous().view(INT_VIEW[t.dtype]).to(torch.int64) & ((1 << bits) - 1)
        return torch.where(u >= sign, sign - u, u)  # sign-magnitude -> monotone integer line

    d = (ordered(a) - ordered(b)).abs()
    nan = torch.isnan(a) | torch.isnan(b)
    return torch.where(nan, torch.full_like(d, 1 << 40), d)


def compare_fused(norm, residual_out, ref_norm, ref_residual) -> dict:
    """Checks one fused result against the reference: residual_out bitwise, norm_out within the
    tolerance above. Returns the numbers and ok."""
    res_bad = mismatches(residual_out, ref_residual)
    nonfinite = int((~torch.isfinite(norm)).sum().item())
    ulp = ulp_distance(norm, ref_norm)
    max_ulp = int(ulp.max().item()) if ulp.numel() else 0
    equal = float((ulp == 0).float().mean().item()) if ulp.numel() else 1.0
    diff = (norm.double() - ref_norm.double()).abs()
    max_abs = float(diff.max().item()) if diff.numel() else 0.0
    if norm.dtype == torch.float32:
        norm_ok = bool((diff <= FUSED_FP32_ATOL + FUSED_FP32_RTOL * ref_norm.double().abs()).all().item())
    else:
        norm_ok = max_ulp <= FUSED_TOL_16BIT_ULP and equal >= FUSED_MIN_EQUAL_FRAC
    return {"residual_mismatches": res_bad, "norm_nonfinite": nonfinite, "norm_max_ulp": max_ulp,
            "norm_equal_frac": equal, "norm_max_abs": max_abs,
            "ok": res_bad == 0 and nonfinite == 0 and norm_ok}


def digest(*tensors) -> str:
    """A hash of the tensors' bits (to compare the two ranks' outputs)."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def _fused_tag(spec) -> str:
    return (f"{spec['dtype']} tokens={spec['tokens']} hidden={spec['hidden']} "
            f"residual={spec['residual']} eps={spec['eps']:g} inplace={spec.get('inplace', False)}")


def _fused_call(comm, spec, rank, seed, device):
    """Draws the inputs of one fused check, launches it (outputs poisoned with NaN first) and
    returns what the check needs once the stream is done."""
    dtype = DTYPES[spec["dtype"]]
    x0, x1, residual, weight = fused_inputs(seed, spec["tokens"], spec["hidden"], dtype, device, spec["residual"])
    return launch_fused_check(comm, spec, (x0 if rank == 0 else x1).clone(), residual, weight, x0, x1)


def launch_fused_check(comm, spec, mine, residual, weight, x0, x1) -> dict:
    """Launches one fused check of `mine` (outputs poisoned with NaN first; the residual updated in
    place when spec["inplace"], as vLLM uses it) and returns it in the form _fused_check reads,
    with x0 + x1 the all-reduce its reference adds."""
    keep = {"x": mine.clone(), "residual": residual.clone() if residual is not None else None}
    norm = torch.full_like(mine, float("nan"))
    res_in = residual.clone() if spec.get("inplace") and residual is not None else residual
    res_out = res_in if res_in is not residual else torch.full_like(mine, float("nan"))
    refused = not comm.can_fuse(mine, res_in, weight)
    if not refused:
        comm.fused_allreduce_rmsnorm(mine, res_in, weight, spec["eps"], norm_out=norm, residual_out=res_out)
    return {"spec": spec, "refused": refused, "x0": x0, "x1": x1, "residual": residual, "weight": weight,
            "mine": mine, "keep": keep, "norm": norm, "res_out": res_out, "res_in": res_in}


def _fused_check(call) -> tuple[dict, list[str]]:
    spec, problems = call["spec"], []
    if call["refused"]:
        return {}, [f"{_fused_tag(spec)}: can_fuse() refused"]
    ref_norm, ref_res = fused_reference(call["x0"], call["x1"], call["residual"], call["weight"], spec["eps"])
    c = compare_fused(call["norm"], call["res_out"], ref_norm, ref_res)
    if not c["ok"]:
        problems.append(f"{_fused_tag(spec)}: residual_out {c['residual_mismatches']} bitwise mismatches, norm_out "
                        f"{c['norm_nonfinite']} non-finite, max {c['norm_max_ulp']} ulp, max abs err "
                        f"{c['norm_max_abs']:.3g}, {100 * c['norm_equal_frac']:.2f}% bitwise equal")
    if mismatches(call["mine"], call["keep"]["x"]):
        problems.append(f"{_fused_tag(spec)}: the input x was modified")
    if call["res_out"] is not call["res_in"] and call["keep"]["residual"] is not None \
            and mismatches(call["res_in"], call["keep"]["residual"]):
        problems.append(f"{_fused_tag(spec)}: the residual was modified although residual_out is another tensor")
    return c, problems


def fused_sweep(rank, group, plan, seed, comm=None):
    """One fused call per entry of `plan` (dicts: dtype, tokens, hidden, residual, eps, inplace),
    each checked against the reference. Returns failures, per-check numbers, digests of both
    outputs (for the cross-rank comparison) and the device-side fused call count."""
    dev = _device()
    own = comm is None
    comm = comm or YaliCommunicator(group, dev)
    flash_bytes = int(comm.config["flash_bytes"])
    failures, stats, digests = [], [], []
    before = comm.device_fused_calls()
    launched = 0
    t0 = time.time()
    for k, spec in enumerate(plan):
        call = _fused_call(comm, spec, rank, seed + k, dev)
        launched += not call["refused"]
        torch.cuda.synchronize(dev)
        c, problems = _fused_check(call)
        failures += problems
        if c:
            nbytes = call["mine"].numel() * call["mine"].element_size()
            launch = comm.fused_launch(spec["tokens"], spec["hidden"], DTYPES[spec["dtype"]])
            stats.append({"tag": _fused_tag(spec), "bytes": nbytes, "one_launch": nbytes <= flash_bytes,
                          "tokens": spec["tokens"], "launch": launch,
                          "norm_max_ulp": c["norm_max_ulp"], "norm_max_abs": c["norm_max_abs"],
                          "norm_equal_frac": c["norm_equal_frac"]})
            digests.append(digest(call["norm"], call["res_out"]))
        del call
    fused_calls = comm.device_fused_calls() - before
    if own:
        comm.close()
    return {"failures": failures, "stats": stats, "digests": digests, "launched": launched,
            "device_fused_calls": fused_calls, "flash_bytes": flash_bytes, "config": dict(comm.config),
            "elapsed_s": time.time() - t0}


def fused_interleaved(rank, group, calls, seed, batch=16, comm=None):
    """`calls` random operations, about half fused all-reduce + RMSNorm (random shape, dtype,
    residual, eps, in place or not; some above the one-launch size) and half plain all-reduces
    (random size, dtype, kernel family, in place or not). The two share YALI's buffers and epochs.
    Each batch is launched back to back, then every result of the batch is checked."""
    dev = _device()
    own = comm is None
    comm = comm or YaliCommunicator(group, dev)
    flash_bytes = int(comm.config["flash_bytes"])
    rng = random.Random(seed)
    failures, checked, fused_launched, digests = [], 0, 0, []
    before = comm.device_fused_calls()
    t0 = time.time()
    i = 0
    while i < calls:
        # 1. draw the whole batch (inputs generated before any collective is launched)
        ops = []
        for _ in range(min(batch, calls - i)):
            i += 1
            dname = rng.choice(list(DTYPES))
            esize = torch.empty(0, dtype=DTYPES[dname]).element_size()
            if rng.random() < 0.5:
                hidden = rng.choice([2048, 4096, 5120, 8192, 16384])
                tokens = rng.choice([1, 2, 3, 7, 16, 32, 64, 100, 256, 513, 1024])
                tokens = max(1, min(tokens, (16 << 20) // (hidden * esize)))
                spec = {"dtype": dname, "tokens": tokens, "hidden": hidden, "residual": rng.random() < 0.75,
                        "eps": rng.choice([1e-5, 1e-6]), "inplace": rng.random() < 0.5}
                ops.append(("fused", spec, seed * 1000 + i))
            else:
                n = max(1, int(2 ** rng.uniform(0, ((12 << 20) // esize).bit_length() - 1)))
                mode = rng.choice(["auto", "flash", "stream"])
                if mode == "flash" and n * esize > flash_bytes:
                    mode = "auto"
                ops.append(("ar", {"dtype": dname, "n": n, "mode": mode, "inplace": rng.random() < 0.3},
                            seed * 1000 + i))
        prepared = []
        for kind, spec, s in ops:
            if kind == "fused":
                prepared.append((kind, spec, s, None))
            else:
                a, b = inputs(s, spec["n"], DTYPES[spec["dtype"]], dev)
                prepared.append((kind, spec, s, (a, b)))
        # 2. launch back to back
        launched = []
        for kind, spec, s, ab in prepared:
            if kind == "fused":
                call = _fused_call(comm, spec, rank, s, dev)
                fused_launched += not call["refused"]
                launched.append((kind, spec, call))
            else:
                a, b = ab
                x = (a if rank == 0 else b).clone()
                if spec["inplace"]:
                    out = comm.all_reduce(x, out=x, mode=spec["mode"])
                else:
                    out = torch.full_like(x, float("nan"))
                    comm.all_reduce(x, out=out, mode=spec["mode"])
                launched.append((kind, spec, (a, b, out)))
        torch.cuda.synchronize(dev)
        # 3. check the batch
        for kind, spec, payload in launched:
            if kind == "fused":
                _, problems = _fused_check(payload)
                failures += problems
                if not payload["refused"]:
                    digests.append(digest(payload["norm"], payload["res_out"]))
            else:
                a, b, out = payload
                bad = mismatches(out, reference(a, b))
                if bad:
                    failures.append(f"all_reduce {spec}: {bad} bitwise mismatches")
            checked += 1
        del launched, prepared
    fused_calls = comm.device_fused_calls() - before
    if own:
        comm.close()
    return {"failures": failures, "checked": checked, "fused_launched": fused_launched,
            "device_fused_calls": fused_calls, "digests": digests, "elapsed_s": time.time() - t0}


# The fused calls captured by fused_graph: one-launch sizes of every dtype, with and without a
# residual, in place, and one above the one-launch size (bf16 513 x 8192 = 8.02 MiB).
FUSED_GRAPH_SPECS = (
    {"dtype": "bf16", "tokens": 1, "hidden": 8192, "residual": True, "eps": 1e-5, "inplace": False},
    {"dtype": "bf16", "tokens": 32, "hidden": 4096, "residual": False, "eps": 1e-6, "inplace": False},
    {"dtype": "fp16", "tokens": 7, "hidden": 5120, "residual": True, "eps": 1e-6, "inplace": True},
    {"dtype": "fp32", "tokens": 64, "hidden": 2048, "residual": True, "eps": 1e-5, "inplace": False},
    {"dtype": "bf16", "tokens": 513, "hidden": 8192, "residual": True, "eps": 1e-5, "inplace": True},
)


def fused_graph(rank, group, replays, pool, seed, specs=FUSED_GRAPH_SPECS, comm=None):
    """Captures the fused calls of `specs` plus a plain all-reduce between them in one CUDA graph
    and replays it `replays` times. Before every replay the inputs are replaced by one of `pool`
    precomputed input sets and the outputs poisoned; after it, mismatch counters are accumulated
    on the GPU (no host sync per replay), so every replay is checked."""
    dev = _device()
    own = comm is None
    comm = comm or YaliCommunicator(group, dev)
    # Static buffers the graph reads and writes.
    st = []
    for spec in specs:
        dtype = DTYPES[spec["dtype"]]
        shape = (spec["tokens"], spec["hidden"])
        b = {"x": torch.zeros(shape, dtype=dtype, device=dev), "w": torch.ones(spec["hidden"], dtype=dtype, device=dev),
             "norm": torch.zeros(shape, dtype=dtype, device=dev)}
        b["res"] = torch.zeros(shape, dtype=dtype, device=dev) if spec["residual"] else None
        b["res_out"] = b["res"] if (spec["inplace"] and spec["residual"]) else torch.zeros(shape, dtype=dtype, device=dev)
        st.append(b)
    ar_x = torch.zeros(300_001, dtype=torch.bfloat16, device=dev)
    ar_out = torch.zeros_like(ar_x)

    def body():
        for k, (spec, b) in enumerate(zip(specs, st)):
            comm.fused_allreduce_rmsnorm(b["x"], b["res"], b["w"], spec["eps"], norm_out=b["norm"],
                                         residual_out=b["res_out"])
            if k == 1:
                comm.all_reduce(ar_x, out=ar_out)

    # Input sets and their references, computed once.
    sets = []
    for p in range(pool):
        one = []
        for k, spec in enumerate(specs):
            x0, x1, res, w = fused_inputs(seed + 100 * p + k, spec["tokens"], spec["hidden"], DTYPES[spec["dtype"]],
                                          dev, spec["residual"])
            ref_norm, ref_res = fused_reference(x0, x1, res, w, spec["eps"])
            one.append({"x": (x0 if rank == 0 else x1), "res": res, "w": w, "ref_norm": ref_norm,
                        "ref_res": ref_res})
        a, b = inputs(seed + 100 * p + 99, ar_x.numel(), ar_x.dtype, dev)
        sets.append((one, (a if rank == 0 else b), reference(a, b)))

    def load(p):
        one, ar_in, _ = sets[p]
        for b, s in zip(st, one):
            b["x"].copy_(s["x"])
            b["w"].copy_(s["w"])
            if b["res"] is not None:
                b["res"].copy_(s["res"])
            b["norm"].fill_(float("nan"))
            if b["res_out"] is not b["res"]:
                b["res_out"].fill_(float("nan"))
        ar_x.copy_(ar_in)
        ar_out.fill_(float("nan"))

    load(0)
    g = capture_after_warmup(body, dev)
    fused_before = comm.device_fused_calls()
    bad_res = torch.zeros(len(specs), dtype=torch.int64, device=dev)
    bad_norm = torch.zeros(len(specs), dtype=torch.int64, device=dev)
    max_ulp = torch.zeros(len(specs), dtype=torch.int64, device=dev)
    bad_ar = torch.zeros((), dtype=torch.int64, device=dev)
    changed = torch.zeros(len(specs), dtype=torch.int64, device=dev)  # norm bits differ from the first replay of the set
    first = {}
    t0 = time.time()
    for i in range(replays):
        p = i % pool
        load(p)
        g.replay()
        one, _, ar_ref = sets[p]
        for k, (b, s) in enumerate(zip(st, one)):
            iv = INT_VIEW[b["norm"].dtype]
            bad_res[k] += (b["res_out"].view(iv) != s["ref_res"].view(iv)).sum()
            ulp = ulp_distance(b["norm"], s["ref_norm"])
            max_ulp[k] = torch.maximum(max_ulp[k], ulp.max())
            if b["norm"].dtype == torch.float32:
                near = (b["norm"].double() - s["ref_norm"].double()).abs() <= (
                    FUSED_FP32_ATOL + FUSED_FP32_RTOL * s["ref_norm"].double().abs())
                bad_norm[k] += (~near).sum()  # a NaN is never near
            else:
                bad_norm[k] += (ulp > FUSED_TOL_16BIT_ULP).sum()
            if (p, k) not in first:
                first[(p, k)] = b["norm"].clone()
            else:
                changed[k] += (b["norm"].view(iv) != first[(p, k)].view(iv)).sum()
        bad_ar += (ar_out.view(torch.int16) != ar_ref.view(torch.int16)).sum()
    torch.cuda.synchronize(dev)
    elapsed = time.time() - t0
    fused_calls = comm.device_fused_calls() - fused_before
    out = {
        "replays": replays, "fused_per_replay": len(specs), "device_fused_calls": fused_calls,
        "expected_fused_calls": replays * len(specs), "elapsed_s": elapsed,
        "bad_residual": bad_res.tolist(), "bad_norm": bad_norm.tolist(), "max_ulp": max_ulp.tolist(),
        "nondeterministic": changed.tolist(), "bad_all_reduce": int(bad_ar.item()),
        "specs": [_fused_tag(s) for s in specs],
        "digests": [digest(first[(p, k)]) for p in range(min(pool, replays)) for k in range(len(specs))],
    }
    del g
    if own:
        comm.close()
    return out


def fused_compiled(rank, group, comm=None):
    """comm.fused_allreduce_rmsnorm inside torch.compile(fullgraph=True), out of place and with
    the residual updated in place (as vLLM's fused_add_rms_norm does)."""
    dev = _device()
    own = comm is None
    comm = comm or YaliCommunicator(group, dev)
    eps = 1e-6

    @torch.compile(fullgraph=True)
    def out_of_place(x, residual, weight):
        norm, res = comm.fused_allreduce_rmsnorm(x * 2, residual, weight, eps)
        return norm, res, norm.float().abs().sum()  # a consumer of the output in the same graph

    @torch.compile(fullgraph=True)
    def in_place(x, residual, weight):
        norm = torch.empty_like(x)
        comm.fused_allreduce_rmsnorm(x, residual, weight, eps, norm_out=norm, residual_out=residual)
        return norm

    failures = []
    for tokens in (48,):  # one shape: each compile costs seconds
        x0, x1, res, w = fused_inputs(11 + tokens, tokens, 4096, torch.bfloat16, dev, True)
        got_norm, got_res, _ = out_of_place((x0 if rank == 0 else x1), res, w)
        ref_norm, ref_res = fused_reference(x0 * 2, x1 * 2, res, w, eps)
        torch.cuda.synchronize(dev)
        c = compare_fused(got_norm, got_res, ref_norm, ref_res)
        if not c["ok"]:
            failures.append(f"out of place, tokens={tokens}: {c}")
        r = res.clone()
        got = in_place((x0 if rank == 0 else x1), r, w)
        ref_norm, ref_res = fused_reference(x0, x1, res, w, eps)
        torch.cuda.synchronize(dev)
        c = compare_fused(got, r, ref_norm, ref_res)
        if not c["ok"]:
            failures.append(f"residual in place, tokens={tokens}: {c}")
    if own:
        comm.close()
    return {"failures": failures}


def run_steps(comm, group, steps) -> dict:
    """Runs a suite's (name, step) scenarios on one communicator, reporting each scenario's
    exception (with the kernel's abort reason) instead of ending the run; both ranks leave each
    scenario together; closes the communicator. Returns {"describe": ..., name: result}."""
    import traceback

    import torch.distributed as dist

    results = {"describe": comm.describe()}
    for name, step in steps:
        t0 = time.time()
        try:
            results[name] = step()
        except Exception:
            abort = ""
            try:
                abort = comm.abort_message()
            except Exception:
                pass
            results[name] = {"error": traceback.format_exc()[-3000:] + (f"\nkernel abort: {abort}" if abort else "")}
        results[name]["wall_s"] = round(time.time() - t0, 2)
        dist.barrier(group=group)  # both ranks leave a scenario together
    comm.close()
    return results


def suite_part(suite, name) -> list:
    """Both ranks' results of scenario `name` of a run_steps suite; fails on a scenario's error."""
    parts = [r[name] for r in suite]
    for rank, p in enumerate(parts):
        assert "error" not in p, f"rank {rank} {name}:\n{p['error']}"
    return parts


def checked_parts(res, name: str) -> list:
    """Every rank's part `name` of a run_steps suite, once no rank reports a failed check."""
    parts = suite_part(res, name)
    for rank, r in enumerate(parts):
        failures = r.get("failures", [])
        assert not failures, f"rank {rank} {name}: {len(failures)} failed checks:\n" + "\n".join(failures[:20])
    return parts


def fused_suite(rank, group, plan, interleave_calls, graph_replays, seed):
    """Runs the fused scenarios above in one process pair on one communicator (the pair's start-up
    is paid once); each scenario's exception is reported instead of ending the run."""
    comm = YaliCommunicator(group, _device())
    return run_steps(comm, group, [
        ("sweep", lambda: fused_sweep(rank, group, plan, seed, comm=comm)),
        ("interleaved", lambda: fused_interleaved(rank, group, interleave_calls, seed + 1, comm=comm)),
        ("graph", lambda: fused_graph(rank, group, graph_replays, 4, seed + 2, comm=comm)),
        ("compiled", lambda: fused_compiled(rank, group, comm=comm)),
    ])


def unaligned_inputs(rank, group, seed):
    """Rank 0's tensors sit 2 bytes past a 16-byte boundary, rank 1's are aligned: both ranks still
    route every call to YALI (should_use/can_fuse never look at the address) and get exact, bitwise
    equal results, served through aligned copies where needed (a plain all-reduce, in place and
    out of place, and the fused op with an unaligned input, residual, weight and outputs)."""
    device = _device()
    comm = YaliCommunicator(group, device)
    failures = []
    shift = 1 if rank == 0 else 0
    out = torch.empty(0, device=device)

    def place(t: torch.Tensor) -> torch.Tensor:
        """`t` at an address 2 bytes past 16-byte alignment on rank 0 (a view of a larger buffer)."""
        buf = torch.empty(t.numel() + 8, dtype=t.dtype, device=device)
        v = buf[shift:shift + t.numel()].view(t.shape)
        v.copy_(t)
        return v

    try:
        for n in (1, 7, 1001, 65537):
            a, b = inputs(seed + n, n, torch.bfloat16, device)
            x = place(a if rank == 0 else b)
            if not comm.should_use(x):
                failures.append(f"should_use refused n={n} on rank {rank}")
                continue
            ref = reference(a, b)
            out = comm.all_reduce(x)
            bad = mismatches(out, ref)
            comm.all_reduce(x, out=x)  # in place
            bad += mismatches(x, ref)
            if bad:
                failures.append(f"all_reduce n={n}: {bad} mismatches")
        x0, x1, residual, weight = fused_inputs(seed, 5, 2048, torch.bfloat16, device)
        args = (place(x0 if rank == 0 else x1), place(residual), place(weight))
        if not comm.can_fuse(*args):
            failures.append(f"can_fuse refused unaligned tensors on rank {rank}")
        else:
            norm_out, residual_out = place(torch.empty_like(x0)), place(torch.empty_like(x0))
            n, r = comm.fused_allreduce_rmsnorm(*args, 1e-5, norm_out, residual_out)
            # The same call on aligned tensors: the reference the staged path must equal bitwise.
            rn, rr = comm.fused_allreduce_rmsnorm(x0 if rank == 0 else x1, residual, weight, 1e-5)
            if n is not norm_out or r is not residual_out:
                failures.append("fused: the given outputs were not returned")
            if not (torch.equal(n.view(torch.int16), rn.view(torch.int16)) and
                    torch.equal(r.view(torch.int16), rr.view(torch.int16))):
                failures.append("fused: unaligned result differs from the aligned call")
        torch.cuda.synchronize(device)
        return {"failures": failures, "digest": digest(out), "device_calls": comm.device_calls()}
    finally:
        comm.close()
