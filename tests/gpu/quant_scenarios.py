"""Checks of the quantising fused op (all-reduce + residual add + RMSNorm + FP8 e4m3) that run
inside every rank of an N-rank group (pair.run_ranks), N in 2, 4, 6, 8.

Every call draws fresh random inputs (ranks_scenarios.fused_rank_inputs: every rank regenerates
all N inputs), poisons every output first, and runs YALI's plain fused op on the same inputs too:
  * residual_out equals the plain op's bit for bit;
  * the FP8 codes and scales equal bit for bit vLLM's quantisation (vllm_quant below: the
    arithmetic of vLLM's static_scaled_fp8_quant, dynamic_per_token_scaled_fp8_quant and
    per_token_group_fp8_quant, in torch) applied to the plain op's norm_out;
  * every code lies within one e4m3 step of the same quantisation of the fp32 norm (no rounding to
    the input dtype), with the op's own scales;
  * every rank's output bits equal every other rank's (a digest per call over the gloo group).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from yali_vllm import ops
from yali_vllm.communicator import YaliCommunicator
from yali_vllm.quant_schemes import SCHEME_GROUP, SCHEME_PER_TOKEN, SCHEME_STATIC

from . import ranks_scenarios as rs
from . import reliability
from .scenarios import DTYPES, _device, capture_after_warmup, digest, mismatches, run_steps

FP8_MAX = 448.0
PER_TOKEN_MIN_SCALE = 1.0 / (448.0 * 512.0)  # vLLM: min_scaling_factor<e4m3>: 1 / (448 * 512)
GROUP_EPS = 1e-10  # vLLM's per_token_group_quant_fp8 default
FP8_NAN_BYTE = 0x7F  # the poison of quant_out

# The schemes as the checks run them: (name, scheme, group size, ue8m0, scale layout).
#   layout "row": [rows, groups] row-major; "col": column-major (vLLM's column_major_scales);
#   "tma": column-major with rows padded to a multiple of 4 (vLLM's tma_aligned_scales, DeepGEMM).
CASES = (
    ("static", SCHEME_STATIC, 128, False, "row"),
    ("per-token", SCHEME_PER_TOKEN, 128, False, "row"),
    ("group128", SCHEME_GROUP, 128, False, "row"),
    ("group128-ue8m0-tma", SCHEME_GROUP, 128, True, "tma"),
    ("group64-col", SCHEME_GROUP, 64, False, "col"),
)
CASE_BY_NAME = {c[0]: c for c in CASES}


# ------------------------------------------------------------------ the references (torch, any device)
def ue8m0(s: torch.Tensor) -> torch.Tensor:
    """vLLM's ue8m0 rounding of fp32 scales: |s| at least 1e-10, the exponent bumped whenever the
    mantissa is not 0, the mantissa cleared."""
    bits = s.abs().clamp_min(1e-10).view(torch.int32)
    exp = (bits >> 23) & 0xFF
    return ((exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)) << 23).view(torch.float32)


def vllm_quant(y: torch.Tensor, scheme: int, static_scale: torch.Tensor | None = None, group_size: int = 128,
               use_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes float8_e4m3fn, scales fp32: [1], [rows, 1] or [rows, groups]) of vLLM's quantisation of
    y ([rows, hidden], any float dtype, taken as fp32): fp32 IEEE division, clamp, conversion to
    e4m3 rounding to nearest even."""
    y = y.float()
    rows, hidden = y.shape
    lim = torch.tensor(FP8_MAX, dtype=torch.float32, device=y.device)
    if scheme == SCHEME_STATIC:
        inv = torch.tensor(1.0, dtype=torch.float32, device=y.device) / static_scale.float().reshape(1)
        q = torch.maximum(-lim, torch.minimum(y * inv, lim))
        return q.to(torch.float8_e4m3fn), static_scale.float().reshape(1)
    if scheme == SCHEME_PER_TOKEN:
        amax = y.abs().amax(dim=-1, keepdim=True)
        s = torch.maximum(amax / lim, torch.tensor(PER_TOKEN_MIN_SCALE, dtype=torch.float32, device=y.device))
        q = torch.maximum(-lim, torch.minimum(y / s, lim))
        return q.to(torch.float8_e4m3fn), s
    g = y.view(rows, hidden // group_size, group_size)
    amax = torch.maximum(g.abs().amax(dim=-1), torch.tensor(GROUP_EPS, dtype=torch.float32, device=y.device))
    s = amax / lim
    if use_ue8m0:
        s = ue8m0(s)
    q = torch.minimum(torch.maximum(g / s.unsqueeze(-1), -lim), lim)
    return q.view(rows, hidden).to(torch.float8_e4m3fn), s


def e4m3_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element, how many e4m3 values lie between codes a and b (0: the same value)."""
    def ordered(c):
        u = c.view(torch.uint8).to(torch.int32)
        return torch.where(u >= 128, -(u - 128), u)
    return (ordered(a) - ordered(b)).abs()


def fp32_norm(summed, residual, weight, eps: float) -> torch.Tensor:
    """RMSNorm of summed [+ residual] in fp32 throughout (no rounding to the input dtype)."""
    z = summed.float() + (residual.float() if residual is not None else 0.0)
    return z * torch.rsqrt(z.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()


# ------------------------------------------------------------------ one checked call
def scale_out(case, rows: int, hidden: int, device) -> torch.Tensor | None:
    """A poisoned scale output in the case's layout (None for the static scheme)."""
    _, scheme, gs, _, layout = case
    if scheme == SCHEME_STATIC:
        return None
    cols = 1 if scheme == SCHEME_PER_TOKEN else hidden // gs
    if layout == "row" or scheme == SCHEME_PER_TOKEN:
        t = torch.empty((rows, cols), dtype=torch.float32, device=device)
    elif layout == "col":
        t = torch.empty((cols, rows), dtype=torch.float32, device=device).t()
    else:  # tma: vLLM's get_tma_aligned_size(rows, 4) = rows rounded up to a multiple of 4
        m = -(-rows // 4) * 4
        t = torch.empty_strided((rows, cols), (1, m), dtype=torch.float32, device=device)
    t.as_strided((t.untyped_storage().nbytes() // 4,), (1,)).fill_(float("nan"))
    return t


def quant_spec_tag(spec) -> str:
    return (f"{spec['case']} {spec['dtype']} tokens={spec['tokens']} hidden={spec['hidden']} "
            f"residual={spec['residual']} inplace={spec['inplace']} res_out={spec['res_out']}")


def quant_call(comm, spec: dict, rank: int, call_seed: int, device) -> dict:
    """One checked quantising call (module docstring); returns its problems and digest."""
    case = CASE_BY_NAME[spec["case"]]
    _, scheme, gs, use_ue8m0, _ = case
    dtype, tokens, hidden, eps = DTYPES[spec["dtype"]], spec["tokens"], spec["hidden"], spec["eps"]
    x, residual, weight, summed = rs.fused_rank_inputs(call_seed, rank, comm.world_size, tokens, hidden, dtype,
                                                       device, spec["residual"])
    # YALI's own norm output and residual_out: the plain fused op on the same inputs.
    norm, res_plain = comm.fused_allreduce_rmsnorm(x, None if residual is None else residual.clone(), weight, eps)
    static = None
    if scheme == SCHEME_STATIC:  # large enough to clamp some values on every other call
        static = (norm.float().abs().amax() / FP8_MAX * (0.75 if call_seed % 2 else 1.5)).reshape(1)
    s_out = scale_out(case, tokens, hidden, device)
    q_out = torch.full((tokens, hidden), FP8_NAN_BYTE, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    if spec["res_out"] == "none":
        r_out = None
    elif spec["inplace"]:
        r_out = residual
    else:
        r_out = torch.full_like(x, float("nan"))
    residual_before = None if residual is None else residual.clone()
    ops.fused_allreduce_rmsnorm_quant(comm._handle, x, residual, weight, eps, q_out, r_out,
                                      static if scheme == SCHEME_STATIC else s_out, scheme, gs, use_ue8m0)
    comm.synchronize()
    tag = quant_spec_tag(spec)
    problems = []
    if r_out is not None and mismatches(r_out, res_plain):
        problems.append(f"{tag}: residual_out differs from the plain fused op's in {mismatches(r_out, res_plain)} elements")
    want_q, want_s = vllm_quant(norm, scheme, static, gs, use_ue8m0)
    got_s = static.reshape(1) if scheme == SCHEME_STATIC else s_out
    if scheme != SCHEME_STATIC and mismatches(got_s.contiguous(), want_s.reshape(got_s.shape).contiguous()):
        problems.append(f"{tag}: {mismatches(got_s.contiguous(), want_s.reshape(got_s.shape).contiguous())} scales "
                        "differ from vLLM's quantisation of YALI's norm_out")
    bad_codes = int((q_out.view(torch.uint8) != want_q.view(torch.uint8)).sum())
    if bad_codes:
        problems.append(f"{tag}: {bad_codes} FP8 codes differ from vLLM's quantisation of YALI's norm_out")
    # The fp32 reference, with the op's own scales.
    y32 = fp32_norm(summed, residual_before, weight, eps)
    if scheme == SCHEME_GROUP:
        s32 = got_s.float().repeat_interleave(gs, dim=1)
        q32 = torch.minimum(torch.maximum(y32 / s32, torch.tensor(-FP8_MAX, device=device)),
                            torch.tensor(FP8_MAX, device=device)).to(torch.float8_e4m3fn)
    else:
        q32 = vllm_quant(y32, SCHEME_STATIC, got_s.float().reshape(-1)[:1])[0] if scheme == SCHEME_STATIC else \
            torch.maximum(torch.tensor(-FP8_MAX, device=device),
                          torch.minimum(y32 / got_s.float(), torch.tensor(FP8_MAX, device=device))).to(torch.float8_e4m3fn)
    far = int((e4m3_steps(q_out, q32) > 1).sum())
    if far:
        problems.append(f"{tag}: {far} FP8 codes more than one e4m3 step from the fp32 reference")
    outs = [q_out.view(torch.uint8)] + ([got_s.contiguous()] if scheme != SCHEME_STATIC else []) + \
        ([r_out] if r_out is not None else [])
    return {"problems": problems, "digest": digest(*outs)}


# ------------------------------------------------------------------ the scenarios
def quant_plan(world_size: int, hiddens, tokens, serve_limit: int) -> list[dict]:
    """Every case at every token count, the hidden size rotating so that every case meets every
    launch band at every world size (test_fused_quant.py checks it); with and without a residual
    (in place every other time, residual_out not stored on every third residual-less call); only
    sizes the communicator serves."""
    plan = []
    k = 0
    for ti, t in enumerate(tokens):
        for ci, case in enumerate(CASES):
            hidden = hiddens[(ti + 2 * ci) % len(hiddens)]
            k += 1
            if t * hidden * 2 > serve_limit:
                continue
            for with_res in (True, False):
                plan.append({"case": case[0], "dtype": "bf16" if k % 3 else "fp16", "tokens": t, "hidden": hidden,
                             "residual": with_res, "inplace": with_res and k % 2 == 0,
                             "res_out": "none" if not with_res and k % 3 == 0 else "tensor",
                             "eps": 1e-6 if k % 2 else 1e-5})
    return plan


def quant_sweep(rank, group, comm, hiddens, tokens, seed):
    """The plan's calls, each checked (quant_call); returns failures, the launches seen and the
    checks whose bits differ between ranks."""
    dev = _device()
    plan = quant_plan(comm.world_size, hiddens, tokens, comm.serve_limit)
    failures, digests, launches = [], {}, []
    before = comm.device_fused_calls()
    for k, spec in enumerate(plan):
        case = CASE_BY_NAME[spec["case"]]
        r = quant_call(comm, spec, rank, seed * rs.CALLS_PER_BASE + k, dev)
        failures += r["problems"]
        digests[f"{k}: {quant_spec_tag(spec)}"] = r["digest"]
        launches.append({"case": spec["case"], "tokens": spec["tokens"], "hidden": spec["hidden"],
                         **comm.fused_quant_launch(spec["tokens"], spec["hidden"], DTYPES[spec["dtype"]], case[1],
                                                   case[2])})
    return {"failures": failures, "calls": len(plan), "launches": launches,
            # each check runs the plain op and the quantising op
            "device_fused_calls": comm.device_fused_calls() - before,
            "differing": rs.differing(group, digests)}


GRAPH_SPECS = (
    {"case": "static", "dtype": "bf16", "tokens": 7, "hidden": 4096, "residual": True, "inplace": False},
    {"case": "per-token", "dtype": "fp16", "tokens": 3, "hidden": 8192, "residual": True, "inplace": True},
    {"case": "group128-ue8m0-tma", "dtype": "bf16", "tokens": 5, "hidden": 2048, "residual": False, "inplace": False},
    {"case": "group128", "dtype": "bf16", "tokens": 64, "hidden": 8192, "residual": True, "inplace": False},
)


def quant_graph(rank, group, comm, replays, seed):
    """The calls of GRAPH_SPECS captured in one CUDA graph, replayed `replays` times with fresh
    inputs refilled in place and every output poisoned; after each replay each output is checked
    against vLLM's quantisation of the plain op's norm_out on the same inputs (run eagerly)."""
    dev = _device()
    bufs = []
    for spec in GRAPH_SPECS:
        case = CASE_BY_NAME[spec["case"]]
        dtype, shape = DTYPES[spec["dtype"]], (spec["tokens"], spec["hidden"])
        b = {"spec": spec, "case": case, "x": torch.zeros(shape, dtype=dtype, device=dev),
             "w": torch.ones(spec["hidden"], dtype=dtype, device=dev),
             "res": torch.zeros(shape, dtype=dtype, device=dev) if spec["residual"] else None,
             "q": torch.zeros(shape, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn),
             "s": scale_out(case, *shape, dev) if case[1] != SCHEME_STATIC else torch.ones(1, device=dev)}
        b["res_out"] = b["res"] if spec["inplace"] else torch.zeros(shape, dtype=dtype, device=dev)
        bufs.append(b)

    def body():
        for b in bufs:
            _, scheme, gs, u8, _ = b["case"]
            comm.fused_allreduce_rmsnorm_quant(b["x"], b["res"], b["w"], 1e-6, scheme, b["s"], gs, u8,
                                               scale_out=b["s"], quant_out=b["q"], residual_out=b["res_out"])

    g = capture_after_warmup(body, dev)
    failures, digests = [], {}
    before = comm.device_fused_calls()
    for i in range(replays):
        refs = []
        for k, b in enumerate(bufs):
            s = b["spec"]
            x, res, w, _ = rs.fused_rank_inputs(seed * rs.CALLS_PER_BASE + i * rs.SEED_STRIDE + k, rank,
                                                comm.world_size, s["tokens"], s["hidden"], DTYPES[s["dtype"]], dev,
                                                s["residual"])
            b["x"].copy_(x)
            b["w"].copy_(w)
            if res is not None:
                b["res"].copy_(res)
            if b["case"][1] == SCHEME_STATIC:
                b["s"].fill_(0.01 * (1 + i % 3))
            else:
                b["s"].as_strided((b["s"].untyped_storage().nbytes() // 4,), (1,)).fill_(float("nan"))
            b["q"].view(torch.uint8).fill_(FP8_NAN_BYTE)
            if b["res_out"] is not b["res"]:
                b["res_out"].fill_(float("nan"))
            refs.append((x, None if res is None else res.clone(), w))
        g.replay()
        comm.synchronize()
        for k, (b, (x, res, w)) in enumerate(zip(bufs, refs)):
            _, scheme, gs, u8, _ = b["case"]
            norm, res_plain = comm.fused_allreduce_rmsnorm(x, res, w, 1e-6)
            want_q, want_s = vllm_quant(norm, scheme, b["s"] if scheme == SCHEME_STATIC else None, gs, u8)
            bad = int((b["q"].view(torch.uint8) != want_q.view(torch.uint8)).sum())
            if scheme != SCHEME_STATIC:
                bad += mismatches(b["s"].contiguous(), want_s.reshape(b["s"].shape).contiguous())
            bad += mismatches(b["res_out"], res_plain)
            if bad:
                failures.append(f"replay {i} {quant_spec_tag({**b['spec'], 'res_out': 'tensor'})}: {bad} bad outputs")
            digests[f"{i} {k}"] = digest(b["q"].view(torch.uint8), b["s"].contiguous(), b["res_out"])
    out = {"failures": failures, "replays": replays,
           # per replay: the graph's quantising calls and the eager plain calls
           "device_fused_calls": comm.device_fused_calls() - before, "expected_fused_calls": 2 * replays * len(bufs),
           "differing": rs.differing(group, digests)}
    del g
    return out


def quant_refusals(rank, group, comm):
    """Outputs over an input and bad arguments are refused with a ValueError naming the argument,
    before anything is launched (the same on every rank)."""
    dev = _device()
    x = torch.randn(4, 2048, dtype=torch.bfloat16, device=dev)
    res = torch.randn_like(x)
    w = torch.ones(2048, dtype=torch.bfloat16, device=dev)
    q = torch.empty(4, 2048, dtype=torch.float8_e4m3fn, device=dev)
    s = torch.empty(4, 16, dtype=torch.float32, device=dev)
    def fp8_over(t):  # a contiguous [4, 2048] FP8 view of t's first bytes
        return t.view(-1).view(torch.uint8)[: 4 * 2048].view(torch.float8_e4m3fn).view(4, 2048)

    cases = {
        "quant_out over input": (lambda: ops.fused_allreduce_rmsnorm_quant(
            comm._handle, x, res, w, 1e-6, fp8_over(x), None, s, SCHEME_GROUP, 128), "quant_out"),
        "quant_out over residual": (lambda: ops.fused_allreduce_rmsnorm_quant(
            comm._handle, x, res, w, 1e-6, fp8_over(res), None, s, SCHEME_GROUP, 128), "quant_out"),
        "scale over input": (lambda: ops.fused_allreduce_rmsnorm_quant(
            comm._handle, x, res, w, 1e-6, q, None, x.view(torch.float32)[:, :16], SCHEME_GROUP, 128), "scale"),
        "residual_out over input": (lambda: ops.fused_allreduce_rmsnorm_quant(
            comm._handle, x, res, w, 1e-6, q, x, s, SCHEME_GROUP, 128), "residual_out"),
        "group size": (lambda: ops.fused_allreduce_rmsnorm_quant(comm._handle, x, res, w, 1e-6, q, None, s,
                                                                 SCHEME_GROUP, 96), "group_size"),
        "scheme": (lambda: ops.fused_allreduce_rmsnorm_quant(comm._handle, x, res, w, 1e-6, q, None, s, 3, 128),
                   "scheme"),
    }
    before = comm.device_calls()
    seen = {}
    for name, (call, arg) in cases.items():
        try:
            call()
            seen[name] = "accepted"
        except ValueError as e:
            seen[name] = "ok" if f"{arg} " in str(e) or str(e).startswith(f"yali: {arg}") else f"ValueError: {e}"
        except Exception as e:  # noqa: BLE001 - the wrong kind of error is a finding
            seen[name] = f"{type(e).__name__}: {e}"
    return {"seen": seen, "launched": comm.device_calls() - before}


def quant_suite(rank, group, hiddens, tokens, replays, seed):
    """The sweep, the CUDA graph and the refusals on one communicator."""
    comm = YaliCommunicator(group, _device())
    return run_steps(comm, group, [
        ("sweep", lambda: quant_sweep(rank, group, comm, hiddens, tokens, seed)),
        ("graph", lambda: quant_graph(rank, group, comm, replays, seed + 1)),
        ("refusals", lambda: quant_refusals(rank, group, comm)),
    ])


def mismatched_scheme(rank, group, seed, wait_s):
    """After one good call, rank 0 issues a per-token quantising call and every other rank the
    static one of the same shape (only the descriptor's scheme differs): every rank must record a
    YALI abort naming the different calls within `wait_s` seconds and raise YaliError, not hang."""
    dev = _device()
    comm = YaliCommunicator(group, dev)
    good = quant_call(comm, {"case": "per-token", "dtype": "bf16", "tokens": 3, "hidden": 4096, "residual": True,
                             "inplace": False, "res_out": "tensor", "eps": 1e-6}, rank, seed, dev)
    dist.barrier(group)
    t0 = time.time()
    x = torch.randn(2, 4096, dtype=torch.bfloat16, device=dev)
    w = torch.ones(4096, dtype=torch.bfloat16, device=dev)
    if rank == 0:
        comm.fused_allreduce_rmsnorm_quant(x, None, w, 1e-6, SCHEME_PER_TOKEN, None)
    else:
        comm.fused_allreduce_rmsnorm_quant(x, None, w, 1e-6, SCHEME_STATIC, torch.ones(1, device=dev))
    return {"good_call_problems": good["problems"], **reliability._record_then_error(comm, t0, wait_s)}
