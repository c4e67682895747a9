"""Checks that run inside every rank of an N-rank group (pair.run_ranks), N in 2, 4, 6, 8.

Every check draws fresh random inputs, one per rank, from a seed made of the call and the rank,
so each rank regenerates all N inputs and computes the reference itself (no data is exchanged
for it). Outputs are poisoned with NaN before the call. A plain all-reduce must lie within the
dtype's tolerance of the fp64 sum (the kernels add in fp32 and round once to the dtype), and its
bits are compared with the fp32 sum added in rank order (what n_rank_exchange.cuh computes); the
fused all-reduce + residual add + RMSNorm is checked as the two-rank fused tests check it
(scenarios.compare_fused) against vLLM's arithmetic applied to the fp32 sum of the N inputs,
added in rank order and rounded to the dtype. Every rank's output bits must equal every other
rank's: each scenario gathers a digest per check over the gloo group."""
from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from yali_vllm import config
from yali_vllm.communicator import YaliCommunicator

from . import reliability
from .scenarios import (DTYPES, _device, _fused_check, _fused_tag, capture_after_warmup, compare_fused, digest,
                        fused_reference, launch_fused_check, mismatches, run_steps)

# Seeds: rank r's input of a call with seed s comes from s * SEED_STRIDE + r; the tensors every
# rank shares (the fused op's residual and weight) from s * SEED_STRIDE + SHARED_SLOT, which no
# rank uses (YALI serves at most 8 ranks).
SEED_STRIDE = 16
SHARED_SLOT = SEED_STRIDE - 1
# Seeds of one scenario's calls: base * CALLS_PER_BASE + call.
CALLS_PER_BASE = 100_000

# Unit roundoff (half the distance between 1 and the next value) and the smallest positive value
# of each dtype: rounding x to the dtype moves it by at most UNIT_ROUNDOFF * |x| + TINY / 2.
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
TINY = {torch.float32: 2.0 ** -149, torch.float16: 2.0 ** -24, torch.bfloat16: 2.0 ** -133}
FP32_UNIT_ROUNDOFF = UNIT_ROUNDOFF[torch.float32]

# The sweep uses messages up to the largest one the table serves, or up to this when it serves
# more (two ranks: the stream kernel up to YALI_MAX_BYTES; tests/gpu/test_allreduce.py covers
# those sizes), so that every process of a shared GPU keeps its references small.
SWEEP_CAP_BYTES = 32 << 20
# The table is probed at every power of two up to here (and bisected between two of them).
PROBE_TOP_BYTES = 1 << 40
# An odd element count above a million (its bytes are not a multiple of 16 in any dtype).
LARGE_ODD_COUNT = 1_000_003


# ------------------------------------------------------------------------------------ inputs
def rank_seed(call_seed: int, rank: int) -> int:
    """The generator seed of `rank`'s input to the call with seed `call_seed`."""
    if not 0 <= rank < SHARED_SLOT:
        raise ValueError(f"rank must be in [0, {SHARED_SLOT}), got {rank}")
    return call_seed * SEED_STRIDE + rank


def _normal(seed: int, n: int, scale: float, device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(n, generator=g, device=device, dtype=torch.float32).mul_(scale)


def rank_input(call_seed: int, rank: int, n: int, dtype: torch.dtype, device, scale: float = 4.0) -> torch.Tensor:
    """`rank`'s input (n elements of `dtype`) to the call with seed `call_seed`; any rank can
    regenerate it."""
    return _normal(rank_seed(call_seed, rank), n, scale, device).to(dtype)


def sum_references(call_seed: int, world_size: int, n: int, dtype: torch.dtype, device,
                   scale: float = 4.0) -> dict[str, torch.Tensor]:
    """The references of the all-reduce of the `world_size` ranks' inputs of `call_seed`,
    accumulated one rank's input at a time: "fp64", their sum in fp64 (exact for these fp16 and
    bf16 inputs); "abs", the sum of their magnitudes (fp64); "fp32", their fp32 sum added in rank
    order and rounded once to `dtype` (at two ranks what YALI computes, bit for bit)."""
    s64 = torch.zeros(n, dtype=torch.float64, device=device)
    a64 = torch.zeros_like(s64)
    s32 = torch.zeros(n, dtype=torch.float32, device=device)
    for r in range(world_size):
        x = rank_input(call_seed, r, n, dtype, device, scale)
        s64 += x.double()
        a64 += x.double().abs()
        s32 = x.float() if r == 0 else s32 + x.float()  # the first term as is: no +0.0 added to it
    return {"fp64": s64, "abs": a64, "fp32": s32.to(dtype)}


def out_of_tolerance(out: torch.Tensor, refs: dict[str, torch.Tensor], world_size: int) -> int:
    """How many elements of an all-reduce output lie outside the dtype's tolerance of the fp64
    sum (a NaN or inf is always outside): world_size - 1 fp32 roundings of the running sum, each
    within FP32_UNIT_ROUNDOFF of the sum of magnitudes (one more allowed for the second-order
    terms), then one rounding to the dtype."""
    dtype = out.dtype
    exact = refs["fp64"]
    tol = (world_size * FP32_UNIT_ROUNDOFF * refs["abs"] * (1 + UNIT_ROUNDOFF[dtype])
           + UNIT_ROUNDOFF[dtype] * exact.abs() + TINY[dtype])
    inside = (out.reshape(-1).double() - exact).abs() <= tol
    return int((~inside).sum().item())


def fused_rank_inputs(call_seed: int, rank: int, world_size: int, tokens: int, hidden: int, dtype: torch.dtype,
                      device, with_residual: bool):
    """(this rank's x, residual or None, weight, the all-reduce of every rank's x as a plain
    all-reduce returns it) of one fused check; every rank draws the same residual and weight."""
    n = tokens * hidden
    x = rank_input(call_seed, rank, n, dtype, device, scale=2.0).view(tokens, hidden)
    summed = sum_references(call_seed, world_size, n, dtype, device, scale=2.0)["fp32"].view(tokens, hidden)
    g = torch.Generator(device=device).manual_seed(call_seed * SEED_STRIDE + SHARED_SLOT)
    residual = (torch.randn((tokens, hidden), generator=g, device=device, dtype=torch.float32).mul_(4.0).to(dtype)
                if with_residual else None)
    weight = torch.randn((hidden,), generator=g, device=device, dtype=torch.float32).mul_(0.5).add_(1.0).to(dtype)
    return x, residual, weight, summed


def as_pair(summed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`summed` as the two inputs of the two-rank references (scenarios.reference and
    fused_reference add x0 + x1 in fp32 and round): (summed, -0.0), and adding -0.0 changes no
    bit of any value, so those references apply to an N-rank sum unchanged."""
    return summed, torch.full_like(summed, -0.0)


def fused_sum_reference(summed, residual, weight, eps: float):
    """(norm_out, residual_out) of vLLM's fused_add_rms_norm (rms_norm without a residual) applied
    to `summed`, the all-reduce output."""
    return fused_reference(*as_pair(summed), residual, weight, eps)


# ------------------------------------------------------------------------- the size table
def kernel_spans(kernel_of, top: int = PROBE_TOP_BYTES) -> list[tuple[str, int, int]]:
    """The size table as (kernel, first byte count, last byte count) spans, smallest first, of the
    messages it serves (kernel_of(nbytes) -> kernel name, or None where it serves none). Probes
    every power of two up to `top`, and `top`, and bisects each change: a kernel whose whole span
    lies strictly between two neighbouring probes is not found."""
    points = [1 << k for k in range(top.bit_length()) if 1 << k <= top]
    if points[-1] != top:
        points.append(top)
    spans: list[list] = []
    current = kernel_of(points[0])
    start = points[0]
    for lo, hi in zip(points, points[1:]):
        k_hi = kernel_of(hi)
        if k_hi == current:
            continue
        a, b = lo, hi  # kernel_of(a) == current != kernel_of(b)
        while b - a > 1:
            mid = (a + b) // 2
            if kernel_of(mid) == current:
                a = mid
            else:
                b = mid
        spans.append([current, start, a])
        current, start = kernel_of(b), b
    spans.append([current, start, top])
    return [(k, lo, hi) for k, lo, hi in spans if k is not None]


def _odd_at_most(c: int) -> int:
    return c if c % 2 else c - 1


def sweep_counts(spans, esize: int, cap: int = SWEEP_CAP_BYTES) -> list[int]:
    """Element counts of `esize`-byte elements that hit every span of the table (up to `cap`
    bytes): 1 and 7, LARGE_ODD_COUNT, and per span its first count, the first odd one, an odd
    one in the middle (geometric), the last and the last odd one. The last of one span and the
    first of the next sit on the kernels' boundary; odd counts leave a tail that is not a whole
    16-byte vector."""
    counts = {1, 7, LARGE_ODD_COUNT}
    largest = 0
    for _, lo, hi in spans:
        first, last = -(-lo // esize), min(hi, cap) // esize
        if last < first:
            continue
        largest = max(largest, last)
        mid = math.isqrt(first * last)
        counts |= {first, first | 1, _odd_at_most(max(mid, first | 1)), _odd_at_most(last), last}
    return sorted(c for c in counts if 1 <= c <= largest)


def table_of(world_size: int):
    """kernel_of(nbytes) of YALI's size table for `world_size` ranks."""
    return lambda nbytes: config.plan(nbytes, world_size=world_size)[0]


def serve_top(world_size: int) -> int:
    """The flash-push / stream switch at two ranks (the end of the size table's first all-reduce
    band); above, the largest message the N-rank kernels serve (YALI_DEV_RANKS_MAX, or the world
    size's row of the table)."""
    table = config.plan_table(world_size)
    return int(table["allreduce"][0]["up_to"] if world_size == 2 else table["limits"]["serve_max"])


def probe_top(world_size: int) -> int:
    """The largest message the size table is probed to: past the flash-push / stream switch at two
    ranks, the N-rank limit above."""
    return serve_top(world_size) + (4096 if world_size == 2 else 0)


# ---------------------------------------------------------------------- cross-rank check
def differing(group, digests: dict[str, str]) -> list[str]:
    """The checks (keys of `digests`, one output digest per check) whose output bits differ
    between ranks, from every rank's digests gathered over the gloo group."""
    got: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(got, digests, group=group)
    keys = sorted(set().union(*got))
    return [k for k in keys if len({g.get(k) for g in got}) > 1]


# ------------------------------------------------------------------------------- scenarios
def _all_reduce_check(comm, world_size: int, call_seed: int, n: int, dtype, rank: int, inplace: bool, device):
    """One all-reduce of fresh inputs (output poisoned unless in place); returns (problems,
    order_mismatches, output digest)."""
    x = rank_input(call_seed, rank, n, dtype, device)
    if not comm.should_use(x):
        return [f"should_use refused {n} x {dtype}"], 0, "refused"
    keep = None if inplace else x.clone()
    if inplace:
        out = comm.all_reduce(x, out=x)
    else:
        out = torch.full_like(x, float("nan"))
        comm.all_reduce(x, out=out)
    refs = sum_references(call_seed, world_size, n, dtype, device)
    comm.synchronize()
    problems = []
    bad = out_of_tolerance(out, refs, world_size)
    if bad:
        problems.append(f"{bad} elements outside the tolerance of the fp64 sum")
    if keep is not None and mismatches(x, keep):
        problems.append("the input was modified")
    return problems, mismatches(out, refs["fp32"]), digest(out)


def all_reduce_sweep(rank, group, comm, dtypes, seed):
    """Every dtype of `dtypes` at the element counts of sweep_counts over the N-rank size table,
    out of place and in place. Returns failures, the kernels hit per dtype, the table's kernels,
    the elements that differ from the rank-order fp32 sum, bit for bit, and the checks
    whose bits differ between ranks."""
    dev = _device()
    world = comm.world_size
    kernel_of = table_of(world)
    spans = kernel_spans(kernel_of)
    failures, digests, kernels = [], {}, {}
    order_mismatches = checks = 0
    for dname in dtypes:
        dtype = DTYPES[dname]
        esize = torch.empty(0, dtype=dtype).element_size()
        for n in sweep_counts(spans, esize):
            kernel = kernel_of(n * esize)
            kernels.setdefault(dname, set()).add(kernel)
            for inplace in (False, True):
                checks += 1
                tag = f"{dname} n={n} ({n * esize} B, {kernel}) inplace={inplace}"
                problems, order_bad, digests[tag] = _all_reduce_check(
                    comm, world, seed * CALLS_PER_BASE + checks, n, dtype, rank, inplace, dev)
                failures += [f"{tag}: {p}" for p in problems]
                order_mismatches += order_bad
    return {"failures": failures, "checks": checks, "kernels": {d: sorted(k) for d, k in kernels.items()},
            "refusal": refusal_above_top(comm, dev), "table": spans, "table_kernels": sorted({k for k, _, _ in spans}),
            "order_mismatches": order_mismatches, "differing": differing(group, digests)}


def refusal_above_top(comm, device) -> str | None:
    """The error of an all-reduce 16 bytes above the N-rank limit (None at two ranks, whose limit
    depends on the mode; "no error" when it is served)."""
    if comm.world_size == 2:
        return None
    x = torch.zeros(serve_top(comm.world_size) // 2 + 8, dtype=torch.bfloat16, device=device)
    try:
        comm.all_reduce(x)
    except ValueError as e:
        return str(e)
    return "no error"


def first_two_launch_rows(comm, hidden: int, dtype: torch.dtype) -> int | None:
    """The fewest rows of `hidden` elements whose fused call runs in two launches (all-reduce,
    then the epilogue) and that the communicator still serves, or None when every served size
    runs in one launch."""
    most = comm.max_bytes // (hidden * torch.empty(0, dtype=dtype).element_size())
    if most < 1 or comm.fused_launch(most, hidden, dtype)["one_launch"]:
        return None
    one, two = 0, most  # 0 rows: below every one-launch size
    while two - one > 1:
        mid = (one + two) // 2
        if comm.fused_launch(mid, hidden, dtype)["one_launch"]:
            one = mid
        else:
            two = mid
    return two if comm.should_use(torch.empty((two, hidden), dtype=dtype, device=comm.device)) else None


TWO_LAUNCH_HIDDEN = 8192


def with_two_launch_specs(comm, plan: list[dict]) -> list[dict]:
    """`plan` and, per dtype of the plan, with and without a residual, one call of the fewest
    TWO_LAUNCH_HIDDEN-wide rows above the one-launch limit (when the table has such a size)."""
    extra = []
    for dname in sorted({s["dtype"] for s in plan}):
        rows = first_two_launch_rows(comm, TWO_LAUNCH_HIDDEN, DTYPES[dname])
        if rows is not None:
            extra += [{"dtype": dname, "tokens": rows, "hidden": TWO_LAUNCH_HIDDEN, "residual": res, "eps": 1e-6,
                       "inplace": res} for res in (True, False)]
    return plan + extra


def fused_call(comm, spec: dict, rank: int, call_seed: int, device) -> dict:
    """Draws the inputs of one fused check, launches it (outputs poisoned with NaN first; the
    residual updated in place when spec["inplace"]) and returns it in the form
    scenarios._fused_check reads, the all-reduce of the N inputs standing as its two-rank pair
    (as_pair)."""
    dtype = DTYPES[spec["dtype"]]
    mine, residual, weight, summed = fused_rank_inputs(call_seed, rank, comm.world_size, spec["tokens"],
                                                       spec["hidden"], dtype, device, spec["residual"])
    x0, x1 = as_pair(summed)
    return launch_fused_check(comm, spec, mine, residual, weight, x0, x1)


def fused_sweep(rank, group, comm, plan, seed):
    """One fused call per entry of `plan` (dicts: dtype, tokens, hidden, residual, eps, inplace)
    plus the two-launch calls of with_two_launch_specs, each checked against the reference.
    Returns failures, how many calls ran in one and in two launches, the device's fused call
    count and the checks whose bits differ between ranks."""
    dev = _device()
    specs = with_two_launch_specs(comm, plan)
    failures, digests = [], {}
    launched = one_launch = spread = 0
    before = comm.device_fused_calls()
    for k, spec in enumerate(specs):
        call = fused_call(comm, spec, rank, seed * CALLS_PER_BASE + k, dev)
        comm.synchronize()
        _, problems = _fused_check(call)
        failures += problems
        if not call["refused"]:
            launched += 1
            launch = comm.fused_launch(spec["tokens"], spec["hidden"], DTYPES[spec["dtype"]])
            one_launch += launch["one_launch"]
            spread += launch["one_launch"] and launch["spread"] > 1  # a row over a cluster of CTAs
            digests[f"{k}: {_fused_tag(spec)}"] = digest(call["norm"], call["res_out"])
        del call
    return {"failures": failures, "specs": len(specs), "launched": launched, "one_launch": one_launch, "spread": spread,
            "two_launch": launched - one_launch, "two_launch_served": len(specs) > len(plan),
            "device_fused_calls": comm.device_fused_calls() - before, "differing": differing(group, digests)}


# The calls captured by graph_replays: fused calls with and without a residual, one updating it in
# place (each within one launch at every world size: at most 512 KiB), and between them all-reduces
# of an odd element count in the middle of the table's first and last span (in place for the second).
GRAPH_FUSED_SPECS = (
    {"dtype": "bf16", "tokens": 7, "hidden": 4096, "residual": True, "eps": 1e-5, "inplace": False},
    {"dtype": "fp16", "tokens": 32, "hidden": 8192, "residual": True, "eps": 1e-6, "inplace": True},
    {"dtype": "bf16", "tokens": 2, "hidden": 2048, "residual": False, "eps": 1e-6, "inplace": False},
)
GRAPH_ALL_REDUCE_DTYPES = ("bf16", "fp32")  # first span, last span (in place)


def _graph_all_reduce_counts(world_size: int) -> list[int]:
    """An odd element count in the middle of the first and of the last span of the table (capped
    at SWEEP_CAP_BYTES), for the dtypes of GRAPH_ALL_REDUCE_DTYPES."""
    spans = kernel_spans(table_of(world_size))
    counts = []
    for dname, (_, lo, hi) in zip(GRAPH_ALL_REDUCE_DTYPES, (spans[0], spans[-1])):
        esize = torch.empty(0, dtype=DTYPES[dname]).element_size()
        first, last = -(-lo // esize), min(hi, SWEEP_CAP_BYTES) // esize
        counts.append(_odd_at_most(max(math.isqrt(first * last), first | 1)))
    return counts


def graph_replays(rank, group, comm, replays, seed):
    """Captures two all-reduces and the fused calls of GRAPH_FUSED_SPECS in one CUDA graph and
    replays it `replays` times; before each replay every input is refilled in place with fresh
    values and every output poisoned, after it every output is checked and its digest kept."""
    dev = _device()
    world = comm.world_size
    ars = []  # all-reduces: x, out (x itself for the in-place one), element count, dtype
    for k, (dname, n) in enumerate(zip(GRAPH_ALL_REDUCE_DTYPES, _graph_all_reduce_counts(world))):
        x = torch.zeros(n, dtype=DTYPES[dname], device=dev)
        ars.append({"x": x, "out": x if k == 1 else torch.zeros_like(x), "n": n, "dtype": DTYPES[dname]})
    fused = []
    for spec in GRAPH_FUSED_SPECS:
        dtype, shape = DTYPES[spec["dtype"]], (spec["tokens"], spec["hidden"])
        b = {"spec": spec, "x": torch.zeros(shape, dtype=dtype, device=dev),
             "w": torch.ones(spec["hidden"], dtype=dtype, device=dev), "norm": torch.zeros(shape, dtype=dtype, device=dev),
             "res": torch.zeros(shape, dtype=dtype, device=dev) if spec["residual"] else None}
        b["res_out"] = b["res"] if spec["inplace"] else torch.zeros(shape, dtype=dtype, device=dev)
        fused.append(b)

    def body():
        comm.fused_allreduce_rmsnorm(fused[0]["x"], fused[0]["res"], fused[0]["w"], fused[0]["spec"]["eps"],
                                     norm_out=fused[0]["norm"], residual_out=fused[0]["res_out"])
        comm.all_reduce(ars[0]["x"], out=ars[0]["out"])
        for b in fused[1:]:
            comm.fused_allreduce_rmsnorm(b["x"], b["res"], b["w"], b["spec"]["eps"], norm_out=b["norm"],
                                         residual_out=b["res_out"])
        comm.all_reduce(ars[1]["x"], out=ars[1]["out"])

    g = capture_after_warmup(body, dev)
    fused_before, calls_before = comm.device_fused_calls(), comm.device_calls()
    failures, digests = [], {}
    t0 = time.time()
    for i in range(replays):
        base = seed * CALLS_PER_BASE + i * SEED_STRIDE
        refs = []
        for k, a in enumerate(ars):
            a["x"].copy_(rank_input(base + k, rank, a["n"], a["dtype"], dev))
            if a["out"] is not a["x"]:
                a["out"].fill_(float("nan"))
            refs.append(sum_references(base + k, world, a["n"], a["dtype"], dev))
        fused_refs = []
        for k, b in enumerate(fused, start=len(ars)):
            s = b["spec"]
            x, res, w, summed = fused_rank_inputs(base + k, rank, world, s["tokens"], s["hidden"], DTYPES[s["dtype"]],
                                                  dev, s["residual"])
            b["x"].copy_(x)
            b["w"].copy_(w)
            if res is not None:
                b["res"].copy_(res)
            b["norm"].fill_(float("nan"))
            if b["res_out"] is not b["res"]:
                b["res_out"].fill_(float("nan"))
            fused_refs.append(fused_sum_reference(summed, res, w, s["eps"]))
        g.replay()
        comm.synchronize()
        for k, (a, ref) in enumerate(zip(ars, refs)):
            bad = out_of_tolerance(a["out"], ref, world)
            if bad:
                failures.append(f"replay {i} all-reduce {k} ({a['n']} x {a['dtype']}): {bad} elements outside the tolerance")
            digests[f"{i} all-reduce {k}"] = digest(a["out"])
        for k, (b, (ref_norm, ref_res)) in enumerate(zip(fused, fused_refs)):
            c = compare_fused(b["norm"], b["res_out"], ref_norm, ref_res)
            if not c["ok"]:
                failures.append(f"replay {i} fused {_fused_tag(b['spec'])}: {c}")
            digests[f"{i} fused {k}"] = digest(b["norm"], b["res_out"])
    elapsed = time.time() - t0
    out = {"failures": failures, "replays": replays, "elapsed_s": elapsed,
           "device_fused_calls": comm.device_fused_calls() - fused_before,
           "expected_fused_calls": replays * len(fused),
           # every all-reduce and one-launch fused call is one exchange launch (advance_epochs)
           "device_calls": comm.device_calls() - calls_before, "expected_calls": replays * (len(ars) + len(fused)),
           "differing": differing(group, digests)}
    del g
    return out


def small_ints(shape: tuple[int, ...], device) -> torch.Tensor:
    """(e % 7) at element e, bf16, of `shape`: with a small offset per rank every N-rank sum is an
    integer that bf16 holds exactly, so a result can be checked with ==."""
    return (torch.arange(math.prod(shape), device=device) % 7).to(torch.bfloat16).view(shape)


def stress_counts(world_size: int) -> list[int]:
    """bf16 element counts of the interleaved stress: 1000, and per kernel of the table the odd
    count nearest the middle of its span (up to the N-rank limit, or 8 MiB + 4 KiB at two ranks:
    one stream call)."""
    counts = [1000]
    for _, lo, hi in kernel_spans(table_of(world_size), top=probe_top(world_size)):
        n = ((lo + hi) // 4) | 1
        counts.append(n if lo <= 2 * n <= hi else -(-lo // 2))
    return counts


def interleaved_stress(rank, group, comm, rounds: int):
    """`rounds` rounds of one all-reduce per stress count (the kernels alternate call after call,
    every other round in place) and one fused call, eager, checked on the device without a
    synchronisation in between: rank r's input is (r + 1 + i % 5) + (j % 7) at element j of round
    i, so every sum is a small integer, exact in bf16. Returns the wrong elements, the calls and
    the fused outputs' cross-rank check."""
    dev, n_ranks = _device(), comm.world_size
    bf16 = torch.bfloat16
    counts = stress_counts(n_ranks)
    pattern = [small_ints((n,), dev) for n in counts]
    xs = [torch.empty_like(p) for p in pattern]
    outs = [torch.empty_like(p) for p in pattern]
    fused_pattern = small_ints((3, 4096), dev)
    fx, weight = torch.empty_like(fused_pattern), torch.ones(4096, dtype=bf16, device=dev)
    norm, res = torch.empty_like(fx), torch.empty_like(fx)
    bad = torch.zeros((), dtype=torch.int64, device=dev)
    calls_before = comm.device_calls()
    for i in range(rounds):
        mine = float(rank + 1 + i % 5)
        total = float(n_ranks * (n_ranks + 1) // 2 + n_ranks * (i % 5))
        for k, p in enumerate(pattern):
            xs[k].copy_(p).add_(mine)
            out = xs[k] if i % 2 else outs[k]
            comm.all_reduce(xs[k], out=out)
            bad += (out != p * n_ranks + total).sum()
        fx.copy_(fused_pattern).add_(mine)
        comm.fused_allreduce_rmsnorm(fx, None, weight, 1e-6, norm_out=norm, residual_out=res)
        bad += (res != fused_pattern * n_ranks + total).sum()  # residual_out is the sum itself
    calls = comm.device_calls() - calls_before  # synchronises
    return {"bad": int(bad), "calls": calls, "rounds": rounds, "counts": counts,
            "differing": differing(group, {"fused-norm": digest(norm)})}


def ranks_suite(rank, group, dtypes, fused_plan, replays, seed, stress_rounds):
    """The all-reduce sweep, the fused sweep, the CUDA graph and the interleaved stress on one
    communicator (the N processes' start-up is paid once); each scenario's exception is reported
    instead of ending the run (scenarios.run_steps)."""
    comm = YaliCommunicator(group, _device())
    return run_steps(comm, group, [
        ("sweep", lambda: all_reduce_sweep(rank, group, comm, dtypes, seed)),
        ("fused", lambda: fused_sweep(rank, group, comm, fused_plan, seed + 1)),
        ("graph", lambda: graph_replays(rank, group, comm, replays, seed + 2)),
        ("stress", lambda: interleaved_stress(rank, group, comm, stress_rounds)),
    ])


# The mismatched calls: rank 0's side and every other rank's side of two-rank cases where only
# the call descriptor differs (the same number of 16-byte vectors): a plain all-reduce, and the
# fused op (above two ranks its spread kernel: 2 rows of hidden 4096 against 1 of 8192).
MISMATCH_CASES = ("bf16-1000-vs-997", "fused-hidden")


def mismatched_call(rank, group, seed, wait_s, case):
    """After one good call, rank 0 issues its side of reliability.MISMATCH_CASES[case] and every
    other rank the other side: every rank must record a YALI abort within `wait_s` seconds and
    raise YaliError, not hang. Nothing runs on the GPU afterwards (a trapped kernel loses the
    process's CUDA context)."""
    dev = _device()
    comm = YaliCommunicator(group, dev)
    problems, _, _ = _all_reduce_check(comm, comm.world_size, seed, 4099, torch.bfloat16, rank, False, dev)
    dist.barrier(group)
    t0 = time.time()
    side = reliability.MISMATCH_CASES[case][0 if rank == 0 else 1]
    reliability._call(comm, side, dev)
    return {"good_call_problems": problems, **reliability._record_then_error(comm, t0, wait_s)}
