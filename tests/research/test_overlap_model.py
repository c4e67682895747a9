"""The overlap model on hand-computed cases, its interpolation in log-size, its result files against
the results schema, and measure_compute.py's CPU dry run (so the GPU script cannot rot)."""
import json
import os

import pytest

from research.overlap import inputs as I
from research.overlap import measure_compute, model
from lab.tests.test_results_files import test_result_file_follows_schema as check_schema
from yali_vllm import _ext

pytestmark = pytest.mark.skipif(_ext.library_error() is not None, reason=f"extension not built: {_ext.library_error()}")

OPS = ("qkv", "rope", "attn", "o_proj", "gate_up", "act", "down", "norm", "embed", "lm_head")


def test_interpolation_is_a_power_law_between_sizes():
    pts = {1024: 1.0, 4096: 3.0, 16384: 7.0, 65536: 7.0}
    assert I.interp_log_size(pts, 2048) == pytest.approx(3 ** 0.5)  # halfway in log2 between 1 and 4 KiB
    assert I.interp_log_size(pts, 8192) == pytest.approx(3 * (7 / 3) ** 0.5)
    assert I.interp_log_size(pts, 32768) == pytest.approx(7.0)  # flat stays flat
    assert I.interp_log_size(pts, 4096) == 3.0 and I.interp_log_size(pts, 16384) == 7.0
    with pytest.raises(ValueError, match="outside"):
        I.interp_log_size(pts, 512)
    with pytest.raises(ValueError, match="outside"):
        I.interp_log_size(pts, 131072)


def test_committed_fused_times_interpolate_between_their_sizes():
    comm = I.CommTimes(2)
    pts = comm.fused_by_hidden[4096]
    lo, hi = 8 * 4096 * 2, 16 * 4096 * 2  # 8 and 16 tokens measured, 12 between them
    got, src = comm.fused_us(4096, 12, norm_us=0.0, yali_serves=I.yali_serves(2))
    assert src == "fused h4096"
    assert min(pts[lo], pts[hi]) <= got <= max(pts[lo], pts[hi])
    above, src = comm.fused_us(4096, 8192, norm_us=10.0, yali_serves=I.yali_serves(2))
    assert src == "allreduce yali + measured norm"
    assert above == pytest.approx(comm.allreduce_us(8192 * 4096 * 2, "yali") + 10.0)


def test_pipeline_hides_the_all_reduce_and_charges_the_slowdown():
    # 2 layers, attention block 2 us, MLP block 1.5 us, all-reduce 4 us, slowdowns 0.8 / 0.4 us:
    # comm-bound, 8 all-reduces of 4 us after the first block of 2 us (worked through by hand)
    assert model.pipeline_us(2, 2.0, 1.5, 4.0, 0.8, 0.4) == pytest.approx(34.0)
    # 1 layer, short all-reduce: each block that starts under one pays its slowdown in full
    assert model.pipeline_us(1, 10.0, 20.0, 5.0, 4.0, 2.0) == pytest.approx(73.0)
    # 1 layer, all-reduce longer than the blocks: the compute waits for it
    assert model.pipeline_us(1, 10.0, 20.0, 30.0, 0.0, 0.0) == pytest.approx(130.0)
    # a host floor per block
    assert model.pipeline_us(1, 1.0, 1.0, 0.0, 0.0, 0.0, host_us=5.0) == pytest.approx(20.0)


def _results_dir(tmp_path):
    """Committed-result stand-ins at the paths the model reads: a fused op of 4 and 6 us at 1 and 2
    tokens of hidden 4096, an all-reduce of 2 us at 2 KiB and 100 us at 1 GiB (both backends)."""
    root = tmp_path / "results"
    fused = {"kind": "fused-allreduce-rmsnorm", "records": [
        {"backend": "yali-fused", "dtype": "bf16", "hidden": 4096, "tokens": t, "bytes": t * 8192, "us_p50": us}
        for t, us in ((1, 4.0), (2, 6.0))]}
    ar = {"kind": "allreduce-microbench", "records": [
        {"backend": b, "dtype": "bf16", "timing": "graph", "bytes": n, "us_p50": us}
        for b in ("yali", "nccl") for n, us in ((2048, 2.0), (1 << 30, 100.0))]}
    for rel, doc in [(I.FUSED_FILES[2][0], fused), (I.ALLREDUCE_FILES[2], ar)]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(json.dumps(doc))
    return str(root)


def _measurement(tmp_path):
    """Layers 2, hidden 4096, vocab 512: every op 1 us at 2 tokens and 0.5 us at 1; the slowdowns
    under the stand-in 0.8 (qkv) and 0.4 (gate_up) us at 1 token, 0.3 (o_proj) and 0.2 (down) at 2."""
    shape = {"name": "s", "hidden": 4096, "intermediate": 8192, "heads": 32, "kv_heads": 8, "head_dim": 128,
             "layers": 2, "vocab": 512}
    slow = {(1, "qkv"): 0.8, (1, "gate_up"): 0.4, (2, "o_proj"): 0.3, (2, "down"): 0.2}
    rows = []
    for tokens, us in ((1, 0.5), (2, 1.0)):
        for op in OPS:
            r = {"model_shape": "s", "tp": 2, "phase": "decode", "tokens": tokens, "op": op, "us_p50": us}
            if op in measure_compute.GEMMS:
                r.update(alone_gated_us=us, contended_us_p50=us + slow.get((tokens, op), 0.0))
            rows.append(r)
    doc = {"kind": "overlap-compute", "date": "2026-11-29T00:00:00+00:00", "command": "synthetic",
           "host": "no GPU (synthetic)", "gpus": [], "cpu_only": True, "world_size": 1, "shared_gpu": False,
           "versions": {k: "x" for k in ("torch", "cuda", "nccl", "vllm", "yali_vllm")} | {"git": "abcdef1"},
           "shapes": {"s": shape}, "records": rows}
    path = tmp_path / "compute.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_model_gives_the_hand_computed_step_times(tmp_path):
    doc = model.build(_measurement(tmp_path), _results_dir(tmp_path))
    by = {(r["tokens"], r["candidate"]): r for r in doc["records"]}
    # now, 2 tokens: 2 layers x (7 ops of 1 us + 2 fused calls of 6 us) + the embedding's fused call (6)
    # + embedding (1) + lm_head (1) + logits gather (2 x 512 bf16 = 2 KiB: 2 us) = 38 + 10
    assert by[(2, "split")]["step_us_now"] == pytest.approx(48.0)
    # split: halves of 1 token (attention block 2 us, MLP block 1.5 us, fused call 4 us): 34 us of
    # layers (test_pipeline...) + the same 10 us
    assert by[(2, "split")]["step_us_overlap"] == pytest.approx(44.0)
    assert by[(2, "split")]["predicted_speedup"] == pytest.approx(48 / 44, abs=1e-4)
    assert by[(2, "split")]["overlap_cost_us"] == pytest.approx(0.0)  # 2 x 3.5 - 7
    # flux: tail = 2 (the 2 KiB all-reduce) + (6 - 2) / 1 wave = 6, plus the slowdowns of o_proj and down, 0.3 + 0.2
    assert by[(2, "flux")]["step_us_overlap"] == pytest.approx(2 * (7 + 0.5 + 2 * 6) + 10)
    # dbo: 2 tokens is below vLLM's decode threshold; 1 token cannot be split
    assert not by[(2, "dbo")]["applies"] and by[(2, "dbo")]["step_us_overlap"] == by[(2, "dbo")]["step_us_now"]
    assert not by[(1, "split")]["applies"] and by[(1, "split")]["predicted_speedup"] == 1.0


def test_model_result_passes_the_results_schema(tmp_path):
    out = tmp_path / "out"
    assert model.main(["--compute", _measurement(tmp_path), "--out", str(out),
                       "--results-dir", _results_dir(tmp_path)]) == 0
    check_schema(str(out / "overlap-model.json"))
    assert (out / "overlap-model.md").read_text().startswith("# Overlap model")
    assert (out / "overlap-model.png").stat().st_size > 0


def test_measure_compute_dry_run_writes_a_valid_measurement(tmp_path):
    path = tmp_path / "compute.json"
    assert measure_compute.main(["--dry-run", "--out", str(path), "--tp", "2", "--decode-tokens", "1,8",
                                 "--prefill-tokens", "64", "--replays", "10"]) == 0
    check_schema(str(path))
    doc = json.loads(path.read_text())
    ops = {(r["phase"], r["tokens"], r["op"]) for r in doc["records"]}
    for tokens in (1, 4, 8):  # 4: the half of 8
        assert {("decode", tokens, op) for op in OPS} <= ops
    assert {("prefill", t, "attn") for t in (32, 64)} <= ops
    assert all(r["us_p50"] > 0 for r in doc["records"])
    gemm = next(r for r in doc["records"] if r["op"] == "gate_up")
    assert gemm["standin_ctas"] >= 1 and gemm["contention_measured"] is False
    # the model reads it (tiny shape, committed all-reduce results)
    assert model.build(str(path))["records"]


def test_bad_arguments_are_named():
    with pytest.raises(SystemExit):
        measure_compute.parse_args(["--out", "x", "--shapes", "13b"])
    with pytest.raises(ValueError, match="shape 8b: heads=32 does not split over tp=3"):
        I.SHAPES["8b"].check_tp(3)
    with pytest.raises(ValueError, match="overlap-compute"):
        model.Measured({"kind": "serving-benchmark"})
