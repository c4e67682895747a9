"""CPU tests of the fused all-reduce + RMSNorm benchmark (benchmarks/fused_bench.py) and of the
reference and comparison helpers the GPU tests use (tests/gpu/scenarios.py): argument parsing,
the reference against vLLM's own native implementation, tolerances, the per-row target verdict,
the markdown/PNG report and --report-only."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks import fused_bench as fb
from tests.gpu import scenarios

REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- arguments
def test_parse_int_list_sorts_dedups_and_rejects_bad_values():
    assert fb.parse_int_list("8192, 4096,8192") == [4096, 8192]
    assert fb.parse_int_list("512,1,32,") == [1, 32, 512]
    for bad in ("0", "-4", "x", "", ",", "1.5"):
        with pytest.raises(Exception):
            fb.parse_int_list(bad)


def test_parse_choice_list_keeps_canonical_order_and_rejects_unknown():
    assert fb.parse_choice_list("fp32,bf16", fb.DTYPE_NAMES, "--dtypes") == ["bf16", "fp32"]
    assert fb.parse_choice_list("unfused,yali-fused", fb.BACKENDS, "--backends") == ["yali-fused", "unfused"]
    with pytest.raises(Exception, match="bf8"):
        fb.parse_choice_list("bf16,bf8", fb.DTYPE_NAMES, "--dtypes")
    with pytest.raises(Exception, match="mnnvl"):
        fb.parse_choice_list("flashinfer-mnnvl", fb.BACKENDS, "--backends")


def test_parse_args_defaults_and_options():
    a = fb.parse_args([])
    assert a.hidden == [8192]
    assert a.tokens == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert a.dtypes == ["bf16"] and a.backends == fb.BACKENDS
    assert a.timeout == a.budget_s + 150 and a.name.startswith("fused-")
    assert (a.target_ratio, a.target_tokens) == (0.8, 32)
    a = fb.parse_args(["--hidden", "8192,4096", "--dtypes", "fp16,bf16", "--tokens", "64,1", "--budget-s", "100",
                       "--name", "x", "--timeout", "130"])
    assert (a.hidden, a.dtypes, a.tokens, a.budget_s, a.name, a.timeout) == (
        [4096, 8192], ["bf16", "fp16"], [1, 64], 100.0, "x", 130.0)
    q = fb.parse_args(["--quick"])
    assert q.tokens == [1, 8, 32, 128] and q.replays <= 50
    for bad in (["--replays", "0"], ["--graph-ops", "0"], ["--budget-s", "0"], ["--dtypes", "int8"],
                ["--hidden", "0"]):
        with pytest.raises(SystemExit):
            fb.parse_args(bad)


def test_flashinfer_workspace_tokens_follow_vllms_cap():
    # TP=2 on Hopper: 64 MiB / (8192 * 2 B) = 4096 rows; at least the largest measured count / 2048
    mib = 1 << 20
    assert fb.flashinfer_max_tokens(8192, "bf16", [1, 512], 64 * mib) == 2048
    assert fb.flashinfer_max_tokens(8192, "bf16", [1, 3000], 64 * mib) == 3000
    assert fb.flashinfer_max_tokens(8192, "bf16", [1, 9000], 64 * mib) == 4096
    assert fb.flashinfer_max_tokens(16384, "fp32", [1, 512], 64 * mib) == 1024
    assert fb.flashinfer_max_tokens(8192, "bf16", [1, 8], 64 * mib, at_least=1) == 8
    # TP=4 and TP=8 on Hopper: vLLM fuses up to 2 MiB and 0.5 MiB, so 128 and 32 rows of 16 KiB
    assert fb.flashinfer_max_tokens(8192, "bf16", [1, 512], 2 * mib) == 128
    assert fb.flashinfer_max_tokens(8192, "bf16", [1, 512], mib // 2) == 32


def test_flashinfer_backend_refuses_anything_but_trtllm(monkeypatch):
    be = object.__new__(fb.Backends)
    monkeypatch.setenv("VLLM_FLASHINFER_ALLREDUCE_BACKEND", "mnnvl")
    with pytest.raises(RuntimeError, match="trtllm"):
        be._init_flashinfer_trtllm()
    monkeypatch.delenv("VLLM_FLASHINFER_ALLREDUCE_BACKEND")
    with pytest.raises(RuntimeError, match="trtllm"):
        be._init_flashinfer_trtllm()


def test_flashinfer_workspace_is_set_up_as_vllms_fusion_pass_does(monkeypatch):
    # AllReduceFusionPass: get_fi_ar_workspace(TP world size, TP rank, ..., group=the TP group's CPU
    # group); vLLM counts that group's nodes, which refuses an NCCL (device) group
    fai = pytest.importorskip("vllm.distributed.device_communicators.flashinfer_all_reduce")
    ps = pytest.importorskip("vllm.distributed.parallel_state")
    tp = SimpleNamespace(cpu_group=object(), device_group=object())
    calls = []

    def get_fi_ar_workspace(**kw):
        assert kw["group"] is not tp.device_group, "in_the_same_node_as should be tested with a non-NCCL group."
        calls.append(kw)
        return SimpleNamespace(backend="trtllm")

    monkeypatch.setattr(fai, "get_fi_ar_workspace", get_fi_ar_workspace)
    monkeypatch.setattr(fai, "destroy_fi_ar_workspace", lambda: None)
    monkeypatch.setattr(ps, "get_tp_group", lambda: tp)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_world_size", lambda: 4)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 3)
    be = object.__new__(fb.Backends)
    be.names, be.skipped, be.fi_ws_key, be._agree = ["flashinfer-trtllm"], {}, None, lambda ok: ok
    be.fi_max_bytes, be.fi_min_tokens = 2 << 20, 2048  # TP=4 on Hopper: 2 MiB
    be.arf = SimpleNamespace(FlashInferFusedAllReduceParams=lambda **kw: kw)
    assert be.flashinfer_workspace(torch.bfloat16, "bf16", 8192, [1, 512]) is None
    assert calls == [{"world_size": 4, "rank": 3, "max_token_num": 128, "hidden_dim": 8192,
                      "dtype": torch.bfloat16, "group": tp.cpu_group}]
    assert be.fi_max_tokens == 128 and be.fi_params == {"world_size": 4, "max_token_num": 128}


def test_importing_the_bench_turns_multicast_off():
    import os

    for k, v in fb.MULTICAST_OFF_ENV.items():
        assert os.environ[k] == v
    assert fb.MULTICAST_OFF_ENV["VLLM_FLASHINFER_ALLREDUCE_BACKEND"] == "trtllm"


def test_unfused_path_follows_vllms_dispatch_order():
    class Comm:
        def __init__(self, disabled=False, serves=True):
            self.disabled, self.serves = disabled, serves

        def should_custom_ar(self, x):
            return self.serves

        def should_use_symm_mem(self, x):
            return self.serves

        def should_use_fi_ar(self, x):
            return self.serves

    x = torch.zeros(4)
    dc = SimpleNamespace(fi_ar_comm=None, ca_comm=Comm(), symm_mem_comm=Comm())
    assert fb.unfused_path(dc, x) == "custom"
    dc.ca_comm = Comm(serves=False)
    assert fb.unfused_path(dc, x) == "symm-mem"
    dc.symm_mem_comm = None
    assert fb.unfused_path(dc, x) == "pynccl"
    dc.ca_comm = Comm(disabled=True)
    assert fb.unfused_path(dc, x) == "pynccl"
    dc.fi_ar_comm = Comm()
    assert fb.unfused_path(dc, x) == "flashinfer-ar"


# ----------------------------------------------------------------------------- reference
def _inputs(dtype, tokens=5, hidden=256, with_residual=True, seed=0):
    return scenarios.fused_inputs(seed, tokens, hidden, dtype, torch.device("cpu"), with_residual)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_residual", [True, False])
def test_reference_is_vllms_native_fused_add_rms_norm_bitwise(dtype, with_residual):
    ir = pytest.importorskip("vllm.ir.ops")
    x0, x1, res, w = _inputs(dtype, with_residual=with_residual)
    eps = 1e-6
    s = (x0.float() + x1.float()).to(dtype)  # the all-reduce output
    if with_residual:
        want_norm, want_res = ir.fused_add_rms_norm.impls["native"].impl_fn(s, res, w, eps)
    else:
        want_norm, want_res = ir.rms_norm.impls["native"].impl_fn(s, w, eps), s
    for norm, r in (scenarios.fused_reference(x0, x1, res, w, eps), fb.reference([x0, x1], res, w, eps)):
        assert scenarios.mismatches(r, want_res) == 0
        assert scenarios.mismatches(norm, want_norm) == 0


@pytest.mark.parametrize("world_size", [4, 8])
def test_reference_of_n_ranks_is_vllms_native_fused_add_rms_norm_of_their_fp32_sum(world_size):
    ir = pytest.importorskip("vllm.ir.ops")
    dtype, eps = torch.bfloat16, 1e-5
    g = torch.Generator().manual_seed(world_size)
    inputs = [torch.randn(3, 256, generator=g).mul_(2.0).to(dtype) for _ in range(world_size)]
    res, w = torch.randn(3, 256, generator=g).to(dtype), torch.randn(256, generator=g).to(dtype)
    s = sum(x.float() for x in inputs).to(dtype)  # the all-reduce output: fp32 sum, rounded once
    want_norm, want_res = ir.fused_add_rms_norm.impls["native"].impl_fn(s, res, w, eps)
    norm, r = fb.reference(inputs, res, w, eps)
    assert scenarios.mismatches(r, want_res) == 0 and scenarios.mismatches(norm, want_norm) == 0
    # the last rank's contribution missing: wrong under the tolerance of N ranks
    alone = fb.reference(inputs[:-1], res, w, eps)
    assert not fb.check_result(*alone, norm, r, "bf16", world_size)["correct"]


def test_reference_rounds_the_all_reduce_before_the_residual_add():
    # bf16 (ulp 2^-7 at 1.0), d = 3 * 2^-10 = 0.375 ulp: the all-reduce output 1 + d rounds to 1.0, and
    # 1.0 + residual d rounds to 1.0 again; one rounding of 1 + 2d = 1 + 0.75 ulp would give 1 + 2^-7.
    one = torch.tensor([[1.0]], dtype=torch.bfloat16)
    d = torch.tensor([[3 * 2.0 ** -10]], dtype=torch.bfloat16)
    w = torch.ones(1, dtype=torch.bfloat16)
    for _, r in (scenarios.fused_reference(one, d, d, w, 1e-6), fb.reference([one, d], d, w, 1e-6)):
        assert r.item() == 1.0


# ----------------------------------------------------------------------------- ulps and tolerances
def _bump(t, idx, ulps):
    """t with element idx moved by `ulps` representable values away from zero."""
    iv = scenarios.INT_VIEW[t.dtype]
    out = t.clone()
    out.view(-1).view(iv)[idx] += ulps
    return out


def test_ulp_distance():
    a = torch.tensor([1.0, -2.0, 0.0, 3.0, 1.0], dtype=torch.bfloat16)
    b = _bump(a, 0, 1)
    assert scenarios.ulp_distance(a, b).tolist() == [1, 0, 0, 0, 0]
    assert scenarios.ulp_distance(a, _bump(a, 1, 3)).tolist()[1] == 3
    pz, nz = torch.tensor([0.0]), torch.tensor([-0.0])
    assert scenarios.ulp_distance(pz, nz).item() == 0
    tiny = torch.tensor([1e-45])  # smallest fp32 denormal: -tiny and +tiny are 2 apart
    assert scenarios.ulp_distance(tiny, -tiny).item() == 2
    assert scenarios.ulp_distance(torch.tensor([float("nan")]), torch.tensor([1.0])).item() > 1 << 30
    h = torch.tensor([65504.0], dtype=torch.float16)
    assert scenarios.ulp_distance(h, -h).item() == 2 * 0x7BFF


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compare_fused_tolerance_16bit(dtype):
    x0, x1, res, w = _inputs(dtype, tokens=4, hidden=512)
    norm, r = scenarios.fused_reference(x0, x1, res, w, 1e-5)
    c = scenarios.compare_fused(norm.clone(), r.clone(), norm, r)
    assert c["ok"] and c["norm_max_ulp"] == 0 and c["norm_equal_frac"] == 1.0
    # a few elements a few ulps off: accepted up to FUSED_TOL_16BIT_ULP
    near = _bump(_bump(norm, 3, scenarios.FUSED_TOL_16BIT_ULP), 700, -1)
    c = scenarios.compare_fused(near, r.clone(), norm, r)
    assert c["ok"] and c["norm_max_ulp"] == scenarios.FUSED_TOL_16BIT_ULP
    assert not scenarios.compare_fused(_bump(norm, 3, scenarios.FUSED_TOL_16BIT_ULP + 1), r, norm, r)["ok"]
    # many elements 1 ulp off: too many differences
    many = norm.clone()
    for i in range(0, norm.numel(), 50):
        many = _bump(many, i, 1)
    assert not scenarios.compare_fused(many, r, norm, r)["ok"]
    # residual_out must be bitwise: one ulp anywhere fails
    c = scenarios.compare_fused(norm, _bump(r, 5, 1), norm, r)
    assert not c["ok"] and c["residual_mismatches"] == 1
    # NaN left over (an element never written)
    holes = norm.clone()
    holes.view(-1)[17] = float("nan")
    c = scenarios.compare_fused(holes, r, norm, r)
    assert not c["ok"] and c["norm_nonfinite"] == 1


def test_compare_fused_rejects_a_missing_peer_or_residual():
    x0, x1, res, w = _inputs(torch.bfloat16, tokens=3, hidden=1024)
    norm, r = scenarios.fused_reference(x0, x1, res, w, 1e-5)
    alone = scenarios.fused_reference(x0, torch.zeros_like(x1), res, w, 1e-5)
    assert not scenarios.compare_fused(*alone, norm, r)["ok"]
    no_res = scenarios.fused_reference(x0, x1, None, w, 1e-5)
    assert not scenarios.compare_fused(no_res[0], r, norm, r)["ok"]


def test_compare_fused_fp32_relative_tolerance():
    x0, x1, res, w = _inputs(torch.float32, tokens=2, hidden=256)
    norm, r = scenarios.fused_reference(x0, x1, res, w, 1e-5)
    assert scenarios.compare_fused(norm * (1 + 5e-6), r, norm, r)["ok"]
    assert not scenarios.compare_fused(norm * (1 + 1e-4), r, norm, r)["ok"]


@pytest.mark.parametrize("dname,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)])
def test_bench_check_result(dname, dtype):
    x0, x1, res, w = _inputs(dtype, tokens=4, hidden=512)
    norm, r = fb.reference([x0, x1], res, w, 1e-5)
    c = fb.check_result(norm.clone(), r.clone(), norm, r, dname)
    assert c["correct"] and c["residual_bitwise"] and c["max_abs_err_norm"] == 0.0
    # a couple of ulps anywhere (another rounding order): still correct, no longer bitwise
    if dtype != torch.float32:
        c = fb.check_result(_bump(norm, 9, 2), _bump(r, 1, 1), norm, r, dname)
    else:
        c = fb.check_result(norm * (1 + 1e-6), _bump(r, 1, 4), norm, r, dname)
    assert c["correct"] and not c["residual_bitwise"] and c["max_abs_err_norm"] > 0
    # the peer's contribution missing, or the residual not added: wrong
    alone = fb.reference([x0, torch.zeros_like(x1)], res, w, 1e-5)
    assert not fb.check_result(*alone, norm, r, dname)["correct"]
    assert not fb.check_result(norm, x0 + x1, norm, r, dname)["correct"]
    nan = norm.clone()
    nan.view(-1)[0] = float("nan")
    c = fb.check_result(nan, r, norm, r, dname)
    assert not c["correct"] and c["max_abs_err_norm"] is None


def test_tolerance_grows_with_the_additions_of_n_ranks():
    assert fb.tolerance("bf16") == fb.TOLERANCE["bf16"] == fb.tolerance("bf16", 2)
    assert fb.tolerance("fp16", 8) == (7 * 2 ** -9, 7 * 2 ** -8)
    x0, x1, res, w = _inputs(torch.bfloat16, tokens=4, hidden=512)
    norm, r = fb.reference([x0, x1], res, w, 1e-5)
    off = norm + 3 * (2 ** -6) * (1 + norm.abs())  # 3 x the 2-rank tolerance everywhere
    assert not fb.check_result(off, r, norm, r, "bf16")["correct"]
    assert fb.check_result(off, r, norm, r, "bf16", world_size=8)["correct"]


def _vllm_fused_add_rms_norm(s, res, w, eps):
    """vLLM's CUDA fused_add_rms_norm: residual = s + res rounded, then normalised."""
    z = (s.float() + res.float()).to(s.dtype)
    n = (z.float() * torch.rsqrt(z.float().pow(2).mean(-1, keepdim=True) + eps)).to(s.dtype)
    return (n.float() * w.float()).to(s.dtype), z


@pytest.mark.parametrize("world_size", [4, 8])
@pytest.mark.parametrize("dname,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_slack_admits_an_all_reduce_that_rounds_every_partial_sum(world_size, dname, dtype):
    # the benchmark's inputs (x ~ 2 N(0, 1) per rank, residual ~ 4 N(0, 1)): where the residual
    # cancels the sum, one ulp of the sum is many ulps of the output
    eps, hidden = 1e-5, 8192
    g = torch.Generator().manual_seed(world_size)
    xs = [torch.randn(64, hidden, generator=g).mul_(2.0).to(dtype) for _ in range(world_size)]
    res = torch.randn(64, hidden, generator=g).mul_(4.0).to(dtype)
    w = torch.randn(hidden, generator=g).mul_(0.5).add_(1.0).to(dtype)
    ref = fb.reference(xs, res, w, eps)
    slack = fb.rounded_sum_slack(xs, ref[1], w, eps, dname)
    rounded = []
    for order in (xs, xs[::-1], xs[1:] + xs[:1]):  # rank order (FlashInfer), other orders (NCCL's ring)
        s = order[0]
        for x in order[1:]:
            s = (s.float() + x.float()).to(dtype)  # every partial sum rounded to the dtype
        rounded.append(_vllm_fused_add_rms_norm(s, res, w, eps))
    if world_size == 4:  # tolerance() alone refuses them (as it refused vLLM's FlashInfer all-reduce and NCCL)
        assert not all(fb.check_result(*out, *ref, dname, world_size)["correct"] for out in rounded)
    assert all(fb.check_result(*out, *ref, dname, world_size, slack)["correct"] for out in rounded)
    # a missing rank, a rank counted twice or no residual: still wrong with the slack
    for bad in (xs[:-1], xs + xs[:1]):
        assert not fb.check_result(*fb.reference(bad, res, w, eps), *ref, dname, world_size, slack)["correct"]
    assert not fb.check_result(*fb.reference(xs, res * 0, w, eps), *ref, dname, world_size, slack)["correct"]


def test_slack_is_for_the_unfused_sequence_above_two_ranks_only():
    assert fb.ROUNDS_PARTIAL_SUMS == {"unfused"}  # YALI and FlashInfer's fusion round the sum once
    x0, x1, res, w = _inputs(torch.bfloat16, tokens=2, hidden=256)
    assert fb.rounded_sum_slack([x0, x1], res, w, 1e-5, "bf16") is None  # one addition, rounded once
    norm_slack, res_slack = fb.rounded_sum_slack([x0, x1, x0, x1], res, w, 1e-5, "bf16")
    assert torch.allclose(res_slack, 6 * 2 ** -8 * 2 * (x0.double().abs() + x1.double().abs()))
    assert norm_slack.shape == res_slack.shape == x0.shape and bool((norm_slack > 0).all())


# ----------------------------------------------------------------------------- verdicts and report
def _rec(backend, tokens, us, correct=True, hidden=8192, dtype="bf16", **kw):
    return {"backend": backend, "dtype": dtype, "hidden": hidden, "tokens": tokens, "us_p50": us,
            "us_p99": us * 1.1, "samples": 200, "correct": correct, **kw}


def test_target_verdict():
    y, f = _rec("yali-fused", 8, 7.9), _rec("flashinfer-trtllm", 8, 10.0)
    assert fb.target_verdict(8, y, f) == ("pass", 0.8)
    assert fb.target_verdict(32, _rec("yali-fused", 32, 8.1), f)[0] == "FAIL"
    assert fb.target_verdict(32, _rec("yali-fused", 32, 8.0), f)[0] == "pass"  # exactly at the limit
    # above 32 tokens: only "never slower"
    assert fb.target_verdict(64, _rec("yali-fused", 64, 9.9), f) == ("pass", 1.0)
    assert fb.target_verdict(64, _rec("yali-fused", 64, 10.1), f)[0] == "FAIL"
    assert fb.target_verdict(8, _rec("yali-fused", 8, 1.0, correct=False), f)[0] == "FAIL (wrong result)"
    assert fb.target_verdict(8, y, _rec("flashinfer-trtllm", 8, 10.0, correct=False))[0].startswith("n/a")
    assert fb.target_verdict(8, y, None)[0].startswith("n/a")
    assert fb.target_verdict(8, None, f)[0].startswith("n/a")
    assert fb.target_verdict(16, y, f, target_ratio=0.5, target_tokens=8) == ("pass", 1.0)


def _records():
    return [
        _rec("yali-fused", 1, 6.0), _rec("flashinfer-trtllm", 1, 10.0), _rec("unfused", 1, 12.0, ar_path="custom"),
        _rec("yali-fused", 32, 9.0), _rec("flashinfer-trtllm", 32, 10.0), _rec("unfused", 32, 15.0, ar_path="custom"),
        _rec("yali-fused", 512, 30.0), _rec("flashinfer-trtllm", 512, 31.0),
        _rec("unfused", 512, 40.0, ar_path="pynccl"),
        _rec("yali-fused", 4, 5.0, hidden=4096), _rec("unfused", 4, 9.0, hidden=4096),
    ]


def test_summarize_ratios_and_target_summary():
    rows = fb.summarize(_records())
    assert [(r["hidden"], r["tokens"]) for r in rows] == [(4096, 4), (8192, 1), (8192, 32), (8192, 512)]
    by = {(r["hidden"], r["tokens"]): r for r in rows}
    assert by[(8192, 1)]["yali_vs_flashinfer"] == pytest.approx(0.6)
    assert by[(8192, 1)]["yali_vs_unfused"] == pytest.approx(0.5)
    assert by[(8192, 1)]["verdict"] == "pass"
    assert by[(8192, 32)]["verdict"] == "FAIL"  # 0.9 > 0.8
    assert by[(8192, 512)]["verdict"] == "pass" and by[(8192, 512)]["limit"] == 1.0
    assert by[(4096, 4)]["yali_vs_flashinfer"] is None and by[(4096, 4)]["verdict"].startswith("n/a")
    s = fb.target_summary(rows)
    assert (s["rows"], s["judged"], s["passed"], s["met"]) == (4, 3, 2, False)
    assert s["failed"] == ["bf16 hidden 8192 tokens 32: FAIL"]
    ok = fb.target_summary(fb.summarize([r for r in _records() if r["tokens"] != 32]))
    assert ok["met"] and ok["failed"] == []
    assert not fb.target_summary(fb.summarize([_rec("yali-fused", 1, 1.0)]))["met"]  # nothing judged


def _result(records, **extra):
    return {"kind": fb.KIND, "date": "2026-11-22T00:00:00+00:00", "command": "fused_bench.py", "host": "2xH200",
            "versions": {}, "target": {"ratio": 0.8, "tokens": 32}, "records": records, **extra}


def test_markdown_names_the_world_size_and_a_shared_gpu():
    assert fb.markdown_table(_result(_records())).startswith("# Fused all-reduce + residual add + RMSNorm, 2 ranks")
    md = fb.markdown_table(_result(_records(), world_size=8))
    assert md.startswith("# Fused all-reduce + residual add + RMSNorm, 8 ranks (2xH200)") and "Not a timing" not in md
    shared = fb.markdown_table(_result(_records(), world_size=4, shared_gpu=True))
    assert "**Not a timing: the 4 ranks shared GPU 0" in shared and "timings are not valid" in shared


def test_markdown_table():
    md = fb.markdown_table(_result(_records(), skipped_backends={"flashinfer-trtllm": "no flashinfer"},
                                   skipped=[{"backend": "yali-fused", "dtype": "bf16", "hidden": 8192, "tokens": 9,
                                             "reason": "can_fuse refused"}]))
    assert "NOT met" in md and "2 of 3 judged rows pass" in md
    assert "## bf16, hidden 4096" in md and "## bf16, hidden 8192" in md
    line = next(ln for ln in md.splitlines() if ln.startswith("| 32 |"))
    assert "0.900×" in line and "0.600×" in line and "FAIL" in line and "≤ 0.80×" in line
    assert "9.00 (9.90)" in line
    line = next(ln for ln in md.splitlines() if ln.startswith("| 512 |"))
    assert "8388608" in line and "≤ 1.00×" in line and "| pass |" in line
    assert "custom at 1, 32 tokens" in md and "pynccl at 512 tokens" in md
    assert "flashinfer-trtllm: no flashinfer" in md and "can_fuse refused" in md
    wrong = fb.markdown_table(_result([_rec("yali-fused", 1, 1.0, correct=False), _rec("flashinfer-trtllm", 1, 9.0)]))
    assert "✗" in wrong and "FAIL (wrong result)" in wrong


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = fb.plot(_result(_records()), str(tmp_path), "p")
    assert path and Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert fb.plot(_result([]), str(tmp_path), "empty") is None


def test_report_only_regenerates_md_and_png(tmp_path):
    pytest.importorskip("matplotlib")
    src = tmp_path / "fused-x.json"
    src.write_text(json.dumps(_result(_records())))
    assert fb.main(["--report-only", str(src)]) == 0
    md = (tmp_path / "fused-x.md").read_text()
    assert "yali / FlashInfer" in md and "0.600×" in md
    assert (tmp_path / "fused-x.png").stat().st_size > 1000
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**_result([]), "kind": "allreduce-microbench"}))
    with pytest.raises(SystemExit, match="fused-allreduce-rmsnorm"):
        fb.main(["--report-only", str(other)])


def test_write_outputs_follows_the_results_schema(tmp_path):
    pytest.importorskip("matplotlib")
    args = fb.parse_args(["--out", str(tmp_path), "--name", "fused-t"])
    args.shared_gpu = False
    res = {"rows": _records(), "skipped": [], "skipped_backends": {}, "setup": {"setup_s": 1.0},
           "budget_exhausted": False, "yali_config": {"flash_bytes": 8 << 20}}
    path = fb.write_outputs(args, res)
    data = json.loads(Path(path).read_text())
    for key in ("kind", "date", "command", "host", "versions", "records"):
        assert key in data
    assert data["kind"] == "fused-allreduce-rmsnorm"
    for r in data["records"]:
        assert {"backend", "dtype", "hidden", "tokens", "us_p50", "us_p99", "samples", "correct"} <= set(r)
        assert r["backend"] in fb.BACKENDS
    assert data["summary"]["met"] is False and data["target"]["ratio"] == 0.8
    assert (tmp_path / "fused-t.md").exists() and (tmp_path / "fused-t.png").exists()
    assert data["world_size"] == 2 and [g["cuda_device"] for g in data["gpus_used"]] == [0, 1]


def test_write_outputs_names_n_ranks_and_their_tolerance(tmp_path):
    args = fb.parse_args(["--out", str(tmp_path), "--name", "fused-8", "--world-size", "8"])
    args.shared_gpu = True
    res = {"rows": _records(), "skipped": [], "skipped_backends": {}, "setup": {}}
    data = json.loads(Path(fb.write_outputs(args, res)).read_text())
    assert data["world_size"] == 8 and data["shared_gpu"] is True
    assert [g["cuda_device"] for g in data["gpus_used"]] == [0] * 8 and [g["rank"] for g in data["gpus_used"]] == \
        list(range(8))
    assert data["tolerance"]["bf16"] == {"atol": 7 * 2 ** -6, "rtol": 7 * 2 ** -6}
    assert (tmp_path / "fused-8.md").read_text().startswith("# Fused all-reduce + residual add + RMSNorm, 8 ranks")


# ----------------------------------------------------------------------------- the GPU test plan
def needs_library():
    """Skips a test that reads the library's size table where the extension is not built."""
    from yali_vllm import _ext

    if _ext.library_error() is not None:
        pytest.skip(f"extension not built: {_ext.library_error()}")


def test_gpu_fused_plan_covers_the_spec():
    from tests.gpu import test_fused as tf

    plan = tf.fused_plan()
    keys = {(p["dtype"], p["hidden"], p["tokens"], p["residual"]) for p in plan}
    assert len(keys) == len(plan)  # no duplicates
    for d in ("bf16", "fp16"):
        for h in tf.HIDDEN:
            for t in tf.TOKENS:
                assert (d, h, t, True) in keys and (d, h, t, False) in keys
    assert {p["hidden"] for p in plan if p["dtype"] == "fp32"} == set(tf.FP32_HIDDEN)
    for res in (True, False):
        assert {p["eps"] for p in plan if p["residual"] == res} == {1e-5, 1e-6}
    assert {p["inplace"] for p in plan if p["residual"]} == {True, False}
    assert not any(p["inplace"] for p in plan if not p["residual"])
    # 513 x 8192 x bf16 crosses the 8 MiB one-launch limit; 256 x 8192 x bf16 does not
    assert 513 * 8192 * 2 > 8 << 20 >= 256 * 8192 * 2
    assert ("bf16", 8192, 513, True) in keys


def test_gpu_fused_plan_rows_fit_the_fused_kernel():
    # every row of the plan fits the fused kernel's row limit, as the library's size table gives it
    from tests.gpu import test_fused as tf
    from yali_vllm import config

    needs_library()
    longest = config.limits()["fused_max_row_bytes"]
    assert all(p["hidden"] * (4 if p["dtype"] == "fp32" else 2) <= longest for p in tf.fused_plan())


def test_gpu_fused_sweep_launch_overrides():
    # The default sweep checks the size table only when no launch knob is set (experiments.sh runs
    # the whole fused suite with YALI_DEV_FUSED_CLUSTER=8, where the table cannot hold).
    from tests.gpu import test_fused as tf

    needs_library()  # the checks read the library's size table

    assert tf.fused_launch_overrides({"YALI_TIMEOUT_S": "60", "YALI_DEV_PDL": "0", "YALI_ENABLE": "1"}) == {}
    env = {"YALI_DEV_FUSED_BATCH_POLL_MIN": "0", "YALI_DEV_FUSED_CLUSTER": "", "YALI_DEV_FLASH_BYTES": "4M",
           "YALI_DEV_PUSH_CTA_BYTES": "2K", "YALI_TIMEOUT_S": "30"}
    assert tf.fused_launch_overrides(env) == {"YALI_DEV_FLASH_BYTES": "4M", "YALI_DEV_FUSED_BATCH_POLL_MIN": "0"}
    cfg = {"fused_cluster": -1}
    ok = (16384 * 16, 16, {"grid": 32, "cta_bytes": 8192, "row_loads_early": 1, "cluster": 1})
    assert tf.check_overridden_launches([ok], cfg) == []
    bad = tf.check_overridden_launches([ok, (16384 * 32, 32, {**ok[2], "grid": 16}),
                                        (16384 * 32, 32, {**ok[2], "grid": 129})], cfg)
    assert len(bad) == 2 and "grid 16 not in [32, 128]" in bad[0] and "grid 129 not in [32, 128]" in bad[1], bad


def test_gpu_fused_sweep_cluster_rule():
    # The GPU sweep's cluster rule: the largest power of two dividing the grid, up to the cluster_max
    # of the library's size table band that holds the call; YALI_DEV_FUSED_CLUSTER overrides.
    from tests.gpu import test_fused as tf
    from tests.size_table import fused_band
    from yali_vllm import config

    needs_library()
    bands = config.plan_table(2)["fused_band"]
    table = {"fused_cluster": -1}
    for t, g in ((1, 4), (2, 8), (8, 32), (16, 32), (32, 128)):  # rows of 16 KiB
        most = fused_band(bands, 16384 * t, 16384)["cluster_max"]
        assert tf.expected_fused_cluster(16384 * t, t, g, table) == min(most, g & -g), (t, g)
    assert {fused_band(bands, 16384 * t, 16384)["cluster_max"] for t in (1, 32)} == {8, 1}  # both kinds of band
    assert tf.expected_fused_cluster(16384, 1, 6, table) == 2 and tf.expected_fused_cluster(16384, 1, 5, table) == 1
    assert tf.expected_fused_cluster(16384, 1, 4, {"fused_cluster": 0}) == 1
    assert tf.expected_fused_cluster(128 * 16384, 128, 128, {"fused_cluster": 8}) == 8
    assert tf.expected_fused_cluster(16384, 1, 8, {"fused_cluster": 2}) == 2
    cfg = {"fused_cluster": -1}
    ok = (16384, 1, {"grid": 4, "cta_bytes": 4096, "row_loads_early": 0, "cluster": 4})
    assert tf.check_overridden_launches([ok], cfg) == []
    bad = tf.check_overridden_launches([(16384, 1, {**ok[2], "cluster": 1})], cfg)
    assert len(bad) == 1 and "clusters of 1, expected 4" in bad[0]


def test_gpu_fused_sweep_launch_model_matches_measured_launches():
    # The grid rule the sweep checks under launch knobs (a CTA per row, at least the senders),
    # against the launches the device reported in the whole-row runs of current/fused/20261122-launch-sweep
    # (fused_bench records the launch of every row; that tree still sent 1 KiB per CTA with the
    # loads first by default, and its config says so). The runs whose config has the row split
    # knob (`fused_split`, since removed) at 1 are whole-row runs that recorded their launches.
    from tests.gpu import test_fused as tf

    needs_library()  # the checks read the library's size table

    run = REPO / "lab/results/current/fused/20261122-launch-sweep"
    docs = {f: json.loads(f.read_text()) for f in sorted(run.glob("*/fused-*.json"))}
    files = [f for f, doc in docs.items() if doc["yali_config"].get("fused_split") == 1]
    for f in files:
        doc = docs[f]
        cfg = doc["yali_config"]
        launches = []
        for r in doc["records"]:
            nbytes, rows = r["bytes"], r["tokens"]
            launches.append((nbytes, rows, {**r["yali_launch"], "cta_bytes": cfg["fused_cta_bytes"]}))
            senders = min(cfg["flash_ctas"], -(-nbytes // cfg["fused_cta_bytes"]))
            assert r["yali_launch"]["split"] == 1 and \
                r["yali_launch"]["grid"] == max(senders, min(rows, cfg["flash_ctas"])), (f.name, r)
        assert tf.check_overridden_launches(launches, cfg) == [], f.name
    assert len(files) == 3


def test_main_keeps_partial_results_when_the_ranks_fail(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    args_seen = {}

    def fake_run_ranks(worker, args, timeout, what, world_size):
        args_seen.update(timeout=timeout, world_size=world_size)
        fb._checkpoint(args, {"rows": _records()[:3], "skipped": [], "skipped_backends": {}, "setup": {}})
        raise SystemExit(f"{what} failed or timed out (see worker output above)")

    monkeypatch.setattr(fb, "run_ranks", fake_run_ranks)
    monkeypatch.setenv("YALI_ALLOW_SHARED_GPU", "1")  # a machine with fewer GPUs than ranks runs them on GPU 0
    rc = fb.main(["--out", str(tmp_path), "--name", "fused-p", "--budget-s", "50", "--world-size", "4"])
    assert rc == 1 and args_seen == {"timeout": 200, "world_size": 4}
    data = json.loads((tmp_path / "fused-p.json").read_text())
    assert len(data["records"]) == 3 and "failed or timed out" in data["incomplete"]
    assert not (tmp_path / ".fused-p.partial.json").exists()
    # nothing measured at all: the failure propagates
    monkeypatch.setattr(fb, "run_ranks", lambda *a, **k: (_ for _ in ()).throw(SystemExit("dead")))
    with pytest.raises(SystemExit, match="dead"):
        fb.main(["--out", str(tmp_path), "--name", "fused-q"])
