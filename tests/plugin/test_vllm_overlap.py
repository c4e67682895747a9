"""CPU tests of YALI's vLLM overlap pass and op (yali_vllm/vllm_overlap.py) with the real vLLM
(its IR norm ops, its pass base class and config) and real FX graphs.

Stand-ins: ``Group`` for a GroupCoordinator (its all_reduce adds a fixed 'peer' partial) and
``Yali`` for a YaliCommunicator (needs two GPUs): it says whether it overlaps and records the
calls. The overlapped kernel itself is covered by tests/gpu/test_overlap.py."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import vllm.ir.ops  # noqa: E402
from torch import fx  # noqa: E402

from yali_vllm import vllm_fusion, vllm_log, vllm_overlap  # noqa: E402

EPS = 1e-5


class Yali:
    """Stand-in YaliCommunicator: can_overlap answers `overlap`, can_fuse answers False (so the
    fallback is vLLM's unfused sequence); the overlapped call returns markers."""

    def __init__(self, overlap: bool):
        self.overlap, self.calls = overlap, []

    def can_overlap(self, x, weight, residual, norm_weight):
        return self.overlap

    def can_fuse(self, x, residual, weight):
        return False

    def gemm_allreduce_rmsnorm(self, x, weight, residual, norm_weight, eps):
        self.calls.append({"tokens": x.shape[0], "weight": tuple(weight.shape), "residual": residual is not None})
        shape = (x.shape[0], weight.shape[0])
        return torch.ones(shape, dtype=x.dtype), torch.full(shape, 2.0, dtype=x.dtype)


class Group:
    def __init__(self, peer: torch.Tensor, yali=None):
        self.peer, self.calls = peer, 0
        self.device_communicator = type("Comm", (), {"yali_comm": yali})()

    def all_reduce(self, x):
        self.calls += 1
        return x + self.peer


def _layer(tokens, k=32, hidden=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g).bfloat16()
    weight = (torch.randn(hidden, k, generator=g) * k ** -0.5).bfloat16()  # the linear layer's [hidden, k]
    peer, res = (torch.randn(tokens, hidden, generator=g).bfloat16() for _ in range(2))
    nw = torch.randn(hidden, generator=g).bfloat16()
    return x, weight, peer, res, nw


@pytest.mark.parametrize("tokens, overlapped", [(vllm_overlap.MIN_TOKENS - 1, False), (vllm_overlap.MIN_TOKENS, True),
                                                (777, True)])
def test_routing_by_token_count(tokens, overlapped):
    x, weight, peer, res, nw = _layer(tokens)
    yali = Yali(overlap=True)
    group = Group(peer, yali)
    norm, res_out = vllm_overlap.run_on_group(group, x, weight.t(), res, nw, EPS)
    if overlapped:
        assert yali.calls == [{"tokens": tokens, "weight": (64, 32), "residual": True}] and group.calls == 0
        assert torch.equal(norm, torch.ones_like(norm)) and torch.equal(res_out, torch.full_like(res_out, 2.0))
    else:  # the GEMM, then the fused op's path (here vLLM's sequence, the stand-in does not fuse)
        ar = torch.mm(x, weight.t()) + peer
        exp = vllm.ir.ops.fused_add_rms_norm(ar, res, nw, EPS)
        assert yali.calls == [] and group.calls == 1
        assert torch.equal(norm, exp[0]) and torch.equal(res_out, exp[1])


def test_first_call_of_each_path_is_logged_once(caplog, monkeypatch):
    """The overlap op says which path its first call takes (the sign of the overlap in a graph vLLM
    loaded from its compile cache), once per group and path."""
    monkeypatch.setattr(vllm_log, "_first_calls", set())
    group = Group(_layer(vllm_overlap.MIN_TOKENS)[2], Yali(overlap=True))
    group.unique_name = "tp:0"
    with caplog.at_level(logging.INFO, logger="vllm.yali"):
        for tokens in (vllm_overlap.MIN_TOKENS, vllm_overlap.MIN_TOKENS + 1, 8, 9):
            x, weight, _, res, nw = _layer(tokens)
            group.peer = torch.zeros(tokens, 64).bfloat16()
            vllm_overlap.run_on_group(group, x, weight.t(), res, nw, EPS)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("YALI overlap op")]
    assert lines == [
        f"YALI overlap op: first call on group 'tp:0' ({vllm_overlap.MIN_TOKENS} tokens) runs the overlapped "
        "GEMM + all-reduce + RMSNorm",
        "YALI overlap op: first call on group 'tp:0' (8 tokens) runs the GEMM, then the fused all-reduce + RMSNorm path",
    ]


def test_refused_tensors_take_the_fused_path():
    x, weight, peer, res, nw = _layer(600)
    yali = Yali(overlap=False)
    group = Group(peer, yali)
    norm, _ = vllm_overlap.run_on_group(group, x, weight.t(), None, nw, EPS)
    assert yali.calls == [] and group.calls == 1
    assert torch.equal(norm, vllm.ir.ops.rms_norm(torch.mm(x, weight.t()) + peer, nw, EPS))


def Range(start, end):  # a compile range as the passes read it (vLLM's Range: start, end inclusive)
    return SimpleNamespace(start=start, end=end)


def _graph_of_layer() -> fx.GraphModule:
    """mm -> yali_fused_allreduce_rmsnorm as YALI's fusion pass leaves it, plus a GEMM whose
    output is used twice (not rewritten: the overlap would drop its other use)."""
    fused = vllm_fusion.fused_op()
    g = fx.Graph()
    x, wt, res, nw = (g.placeholder(n) for n in ("x", "wt", "res", "nw"))
    mm = g.call_function(torch.ops.aten.mm.default, (x, wt))
    out = g.call_function(fused, (mm, res, nw, EPS, "tp:0"))
    norm, res_out = (g.call_function(lambda t, i: t[i], (out, i)) for i in range(2))
    mm2 = g.call_function(torch.ops.aten.mm.default, (x, wt))
    out2 = g.call_function(fused, (mm2, None, nw, EPS, "tp:0"))
    g.output((norm, res_out, out2, mm2))
    return fx.GraphModule(torch.nn.Module(), g)


def test_rewrite_replaces_a_gemm_feeding_the_fused_op_alone():
    gm = _graph_of_layer()
    served = vllm_overlap.rewrite(gm.graph)
    gm.graph.lint()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(vllm_overlap.overlap_op()) == 1
    assert targets.count(torch.ops.aten.mm.default) == 1  # the shared GEMM stays
    assert targets.count(vllm_fusion.fused_op()) == 1
    assert served == ["mm"]  # no module stack or shapes recorded in this graph


def test_rewritten_graph_computes_the_same(monkeypatch):
    x, weight, peer, res, nw = _layer(600)
    group = Group(peer, None)  # no YALI: both graphs run the GEMM and vLLM's sequence
    monkeypatch.setattr(vllm_fusion, "_group", lambda name: group)
    before = _graph_of_layer()
    after = _graph_of_layer()
    vllm_overlap.rewrite(after.graph)
    after.recompile()
    for a, b in zip(before(x, weight.t(), res, nw)[:2], after(x, weight.t(), res, nw)[:2]):
        assert torch.equal(a, b)


def test_op_fake_shapes():
    with torch._subclasses.fake_tensor.FakeTensorMode():
        x, wt, nw = torch.empty(9, 32), torch.empty(32, 64), torch.empty(64)
        norm, res = vllm_overlap.overlap_op()(x, wt, None, nw, EPS, "tp:0")
    assert norm.shape == res.shape == (9, 64)


def test_pass_applies_to_ranges_that_reach_the_threshold_and_logs_layers(caplog):
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(cfg):
        p = vllm_overlap.YaliOverlapPass(cfg)
    assert not p.is_applicable_for_range(Range(1, vllm_overlap.MIN_TOKENS - 1))
    assert p.is_applicable_for_range(Range(1, 8192))
    assert p.is_applicable_for_range(Range(vllm_overlap.MIN_TOKENS, vllm_overlap.MIN_TOKENS))
    gm = _graph_of_layer()
    with caplog.at_level(logging.INFO, logger="vllm.yali"):
        p(gm.graph)
    assert "overlapped from 512 tokens for 1 layer(s): mm" in caplog.text


def test_fusion_with_overlap_runs_both_in_order():
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    order = []

    class Fusion:  # stand-in for YaliAllReduceFusionPass (needs a TP group): records its call
        def is_applicable_for_range(self, r):
            return True

        def uuid(self):
            return "fusion"

        def __call__(self, graph):
            order.append(("fusion", sum(n.target == vllm_fusion.fused_op() for n in graph.nodes)))

    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(cfg):
        p = vllm_overlap.with_overlap(Fusion(), cfg)
    gm = _graph_of_layer()
    assert p.is_applicable_for_range(Range(1, 16))
    p(gm.graph)  # a range below the threshold: fusion only
    assert order == [("fusion", 2)]
    assert not any(n.target == vllm_overlap.overlap_op() for n in gm.graph.nodes)
    assert p.is_applicable_for_range(Range(1, 8192))
    p(gm.graph)
    assert sum(n.target == vllm_overlap.overlap_op() for n in gm.graph.nodes) == 1
    assert p.uuid().startswith("fusion")


@pytest.mark.parametrize("world_size", [1, 3, 4, 6, 8])
def test_overlap_serves_two_ranks_only(world_size):
    assert vllm_overlap.overlap_refusal(2) is None
    assert vllm_overlap.overlap_refusal(world_size) == (
        f"TP world size is {world_size}; the overlap serves 2 ranks")
