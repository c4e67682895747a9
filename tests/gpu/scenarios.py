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
    dev = torch.device("cuda", rank)
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


def graph_replays(rank, group, replays, check_every, seed):
    """Captures several all-reduces (flash and stream sizes, in- and out-of-place)
    in one CUDA graph, replays it `replays` times, refreshing the inputs and
    checking every output every `check_every` replays."""
    dev = torch.device("cuda", rank)
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

    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        body()  # warm-up outside capture
    torch.cuda.current_stream(dev).wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
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
    dev = torch.device("cuda", rank)
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
    dev = torch.device("cuda", rank)
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
    dev = torch.device("cuda", rank)
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
        os.environ["YALI_DEV_LANES"] = "999"
    try:
        YaliCommunicator(group, torch.device("cuda", rank))
        first = "created"
    except YaliUnavailable as e:
        first = str(e)
    os.environ["YALI_DEV_LANES"] = "64" if rank == 1 else "128"  # valid but different
    try:
        YaliCommunicator(group, torch.device("cuda", rank))
        second = "created"
    except YaliUnavailable as e:
        second = str(e)
    return {"bad": first, "different": second}
