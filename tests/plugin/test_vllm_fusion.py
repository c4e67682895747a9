"""CPU tests of YALI's vLLM fusion pass and op (yali_vllm/vllm_fusion.py) and of
the plugin's wiring of it (yali_vllm/plugin/fusion_patch.py), against the real vLLM.

Real vLLM throughout: its IR norm ops, its pattern matcher pass base class, its
PostGradPassManager, and, in the multi-rank tests, its distributed set-up (a TP
group of 2 or 4 spawned CPU processes over gloo) with vLLM's own
``torch.ops.vllm.all_reduce`` in the traced graphs.  Stand-ins, each named
where used:

* ``StandInPass`` for vLLM's ``AllReduceFusionPass``: the real class lives in
  a module that needs vLLM's CUDA ops (``torch.ops._C``) to import, and vLLM's
  pass manager only imports it on a CUDA platform.
* ``StandInYali`` for a YaliCommunicator (needs GPUs): it says whether it
  fuses and records the calls; its "fused" result is vLLM's unfused sequence.
* ``StandInGroup`` (single-process op tests): an object with ``all_reduce``.

The real fused kernel inside a real compiled vLLM model is covered by
tests/gpu/test_vllm_e2e.py::test_yali_fusion_tokens_match_flashinfer_and_unfused.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import vllm.ir.ops  # noqa: E402

from yali_vllm import config, plugin, vllm_fusion, vllm_log  # noqa: E402
from yali_vllm.plugin import fusion_patch  # noqa: E402
from .cpu_ranks import run_cpu_ranks  # noqa: E402

EPS = 1e-5


def reference(ar: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """vLLM's native (fused-add) RMSNorm (vllm/ir/ops/layernorm.py), written
    out op for op, applied to the all-reduce output `ar`."""
    dtype = ar.dtype
    z = ar.to(torch.float32)
    if residual is not None:
        z = z + residual.to(torch.float32)
    res_out = z.to(dtype)
    var = z.pow(2).mean(dim=-1, keepdim=True)
    z = z * torch.rsqrt(var + eps)
    norm = (z.to(weight.dtype) * weight).to(dtype)
    return norm, (res_out if residual is not None else ar)


class StandInPass:
    """Stand-in for vLLM's AllReduceFusionPass (CUDA-only module, see above)."""

    def __init__(self, config):
        self.config = config

    def is_applicable_for_range(self, compile_range):
        return True

    def uuid(self):
        return "stand-in"


class RangedStandInPass(StandInPass):
    """A FlashInfer stand-in that, like vLLM's pass, applies up to `max_token_num` tokens and counts
    its runs; it rewrites nothing, so what it is left is seen in the graph."""

    disabled = False

    def __init__(self, config, max_tokens):
        super().__init__(config)
        self.max_token_num, self.calls = max_tokens, 0

    def is_applicable_for_range(self, compile_range):
        return compile_range.end <= self.max_token_num

    def __call__(self, graph):
        self.calls += 1


class StandInYali:
    """Stand-in for a YaliCommunicator: can_fuse() answers `fuse`; the fused
    call records its arguments and returns vLLM's unfused result computed on
    `group`, so a graph using it must still produce the reference numbers."""

    def __init__(self, fuse: bool, group=None, serve_limit=None):
        self.fuse, self.group, self.calls = fuse, group, []
        if serve_limit is not None:  # the real communicator's largest message (bytes)
            self.serve_limit = serve_limit

    def can_fuse(self, x, residual, weight):
        return self.fuse

    def fused_allreduce_rmsnorm(self, x, residual, weight, eps):
        self.calls.append({"shape": list(x.shape), "residual": residual is not None, "eps": eps})
        return vllm_fusion.unfused(self.group, x, residual, weight, eps)


class StandInYaliQuant(StandInYali):
    """A stand-in YaliCommunicator with the quantising op of the contract: can_fuse_quant answers
    `fuse`; the quantising call records its arguments (the scale_out layout among them) and returns
    vLLM's unfused result quantised by vLLM's QuantFP8 native code, written into the scale_out it is
    given, so a graph using it must still produce the model's numbers and layouts."""

    def can_fuse_quant(self, x, residual, weight, scheme, group_size):
        return self.fuse

    def fused_allreduce_rmsnorm_quant(self, x, residual, weight, eps, scheme, scale, group_size=128,
                                      scale_ue8m0=False, scale_out=None):
        from yali_vllm.quant_schemes import SCHEME_GROUP, SCHEME_STATIC

        self.calls.append({"scheme": scheme, "group_size": group_size if scheme == SCHEME_GROUP else None,
                           "ue8m0": scale_ue8m0, "residual": residual is not None, "eps": eps,
                           "scale_out": None if scale_out is None else [list(scale_out.shape), list(scale_out.stride())]})
        norm, res = vllm_fusion.unfused(self.group, x, residual, weight, eps)
        spec = vllm_fusion.QuantSpec(scheme, group_size if scheme == SCHEME_GROUP else 0, scale_ue8m0)
        q, s = vllm_fusion.quantise(norm, scale, spec)
        if scheme == SCHEME_STATIC:
            return q, res, scale  # the op copies it: its outputs alias no input
        scale_out.copy_(s)
        return q, res, scale_out


class StandInGroup:
    """Stand-in for a GroupCoordinator: all_reduce adds a fixed 'peer' tensor."""

    def __init__(self, peer: torch.Tensor, yali=None):
        self.peer, self.calls = peer, 0
        self.device_communicator = type("Comm", (), {"yali_comm": yali})()

    def all_reduce(self, x):
        self.calls += 1
        return x + self.peer


def _tensors(dtype=torch.bfloat16, tokens=3, hidden=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, peer, res = (torch.randn(tokens, hidden, generator=g).to(dtype) for _ in range(3))
    w = torch.randn(hidden, generator=g).to(dtype)
    return x, peer, res, w


# ------------------------------------------------------------------ YALI_FUSION
@pytest.mark.parametrize("raw, value", [(None, True), ("", True), ("1", True), ("on", True),
                                        ("0", False), ("false", False), (" OFF ", False)])
def test_fusion_flag(raw, value):
    env = {} if raw is None else {"YALI_FUSION": raw}
    assert vllm_fusion.fusion_enabled(env) is value


@pytest.mark.parametrize("raw", ["2", "maybe", "fused"])
def test_fusion_flag_bad_value_names_variable(raw):
    with pytest.raises(ValueError, match=f"invalid YALI_FUSION={raw!r}"):
        vllm_fusion.fusion_enabled({"YALI_FUSION": raw})


def test_every_listed_reason_names_a_committed_result():
    """The reasons of ON_BY_DEFAULT and OFF_BY_DEFAULT that name a result directory name one that is
    committed (with its README); every world size on by default names its serving run."""
    repo = Path(__file__).resolve().parents[2]
    reasons = [*config.ON_BY_DEFAULT.values(), *config.OFF_BY_DEFAULT.values()]
    named = [path for reason in reasons for path in re.findall(r"lab/results/[\w./-]+[\w-]", reason)]
    assert all("lab/results/current/serving/" in why for why in config.ON_BY_DEFAULT.values())
    for path in named:
        assert (repo / path / "README.md").is_file(), path


def test_factory_raises_naming_bad_yali_fusion(monkeypatch):
    monkeypatch.setenv("YALI_FUSION", "sometimes")
    factory = fusion_patch.fusion_pass_factory(StandInPass)
    with pytest.raises(ValueError, match="YALI_FUSION='sometimes'"):
        factory(object())


def test_factory_off_without_tp_group(monkeypatch, caplog):
    """In a process without a TP group (no distributed set-up here) the factory
    builds vLLM's pass and says why."""
    monkeypatch.delenv("YALI_FUSION", raising=False)
    vllm_log.forget_logged()
    factory = fusion_patch.fusion_pass_factory(StandInPass)
    cfg = object()
    with caplog.at_level(logging.INFO, logger="vllm.yali"):
        built = factory(cfg)
    assert type(built) is StandInPass and built.config is cfg
    lines = [r.getMessage() for r in caplog.records if "YALI fusion pass" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("YALI fusion pass OFF: no tensor-parallel group")
    assert lines[0].endswith("using vLLM's FlashInfer all-reduce+RMSNorm fusion")
    monkeypatch.setenv("YALI_FUSION", "0")
    assert vllm_fusion.fusion_decision() == (False, "disabled by YALI_FUSION")


class FailingYaliPass:
    """Stand-in for a pass whose build fails (as on a vLLM whose pattern API changed): YALI's, or vLLM's."""

    def __init__(self, config, flashinfer=None):
        raise RuntimeError("pattern API changed")


def _model_config(quantization: str | None):
    """A vLLM config as the factory reads it: the model's quantisation method (None: bf16)."""
    return SimpleNamespace(model_config=SimpleNamespace(quantization=quantization))


def _yali_serves(monkeypatch):
    """Stands in for YALI serving a TP group (no TP group in this process)."""
    monkeypatch.setattr(vllm_fusion, "fusion_decision", lambda environ=None: (True, "YALI serves TP group 'tp:0'"))


@pytest.mark.parametrize("quantization", [None, "fp8"], ids=["bf16", "fp8"])
def test_factory_falls_back_to_vllms_pass_when_yalis_build_fails(monkeypatch, caplog, quantization):
    """YALI's pass failing to build leaves vLLM's pass in place, built once (for a quantised model the
    one built to go inside YALI's), with a warning: a start-up never fails on it."""
    built: list = []

    class CountedPass(StandInPass):
        def __init__(self, config):
            super().__init__(config)
            built.append(self)

    _yali_serves(monkeypatch)
    monkeypatch.setattr(vllm_fusion, "YaliAllReduceFusionPass", FailingYaliPass)
    cfg = _model_config(quantization)
    with caplog.at_level(logging.WARNING, logger="vllm.yali"):
        got = fusion_patch.fusion_pass_factory(CountedPass)(cfg)
    assert type(got) is CountedPass and got.config is cfg and built == [got]
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert lines == ["YALI fusion pass OFF: building it failed (RuntimeError: pattern API changed); using vLLM's "
                     "FlashInfer fusion"], lines


class RecordingYaliPass:
    """Stand-in for YALI's pass that records the vLLM pass it is given."""

    def __init__(self, config, flashinfer=None):
        self.config, self.flashinfer = config, flashinfer


@pytest.mark.parametrize("quantization", [None, "fp8", "compressed-tensors"])
def test_factory_builds_vllms_pass_inside_yalis_for_a_quantised_model_only(monkeypatch, quantization):
    """A bf16 model never builds vLLM's pass (no FlashInfer workspace beside YALI's); a quantised one
    builds it once and hands it to YALI's pass (fusion_routing leaves it the pairs it fuses)."""
    built: list = []

    def counted(config):
        built.append(StandInPass(config))
        return built[-1]

    _yali_serves(monkeypatch)
    monkeypatch.setattr(vllm_fusion, "YaliAllReduceFusionPass", RecordingYaliPass)
    cfg = _model_config(quantization)
    assert fusion_patch.model_quantisation(cfg) == quantization
    got = fusion_patch.fusion_pass_factory(counted)(cfg)
    assert type(got) is RecordingYaliPass and got.config is cfg
    assert got.flashinfer is (built[0] if quantization else None) and len(built) == (1 if quantization else 0)


def test_factory_leaves_yalis_pass_alone_when_vllms_fails_to_build(monkeypatch, caplog):
    """For a quantised model, vLLM's pass failing to build leaves YALI's pass alone (its quantised
    pairs stay unfused), with a warning: a start-up never fails on it."""
    _yali_serves(monkeypatch)
    monkeypatch.setattr(vllm_fusion, "YaliAllReduceFusionPass", RecordingYaliPass)
    cfg = _model_config("fp8")
    with caplog.at_level(logging.WARNING, logger="vllm.yali"):
        got = fusion_patch.fusion_pass_factory(FailingYaliPass)(cfg)
    assert type(got) is RecordingYaliPass and got.flashinfer is None
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert lines == ["YALI: building vLLM's FlashInfer fusion pass failed (RuntimeError: pattern API changed); the "
                     "quantised pairs stay unfused"], lines
    assert fusion_patch.model_quantisation(SimpleNamespace()) is None  # no model config: not quantised


# ------------------------------------------------------------------- the op
def test_op_registered_once_functional_schema():
    vllm_fusion.register_op()
    vllm_fusion.register_op()  # idempotent
    fusion_patch.register_fusion_op()
    op = torch.ops.vllm.yali_fused_allreduce_rmsnorm.default
    schema = op._schema
    assert str(schema) == (
        "vllm::yali_fused_allreduce_rmsnorm(Tensor input, Tensor? residual, Tensor weight, "
        "float eps, str group_name) -> (Tensor, Tensor)"
    )
    assert not schema.is_mutable


def test_op_fake_impl_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    vllm_fusion.register_op()
    with FakeTensorMode():
        x = torch.empty(7, 32, dtype=torch.bfloat16)
        w = torch.empty(32, dtype=torch.bfloat16)
        norm, res = torch.ops.vllm.yali_fused_allreduce_rmsnorm(x, None, w, EPS, "tp:0")
    assert norm.shape == res.shape == (7, 32) and norm.dtype == res.dtype == torch.bfloat16


def test_op_names_unknown_group():
    vllm_fusion.register_op()
    x = torch.zeros(2, 16)
    with pytest.raises(ValueError, match="'no-such-group' is not found"):
        torch.ops.vllm.yali_fused_allreduce_rmsnorm(x, x, torch.ones(16), EPS, "no-such-group")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_residual", [True, False])
def test_fallback_is_the_unfused_sequence(dtype, with_residual):
    """No YALI communicator: all-reduce through the group, then vLLM's norm;
    bit-identical to vLLM's native (fused-add) RMSNorm of the all-reduce output."""
    x, peer, res, w = _tensors(dtype)
    res_in = res.clone() if with_residual else None
    group = StandInGroup(peer)
    norm, res_out = vllm_fusion.run_on_group(group, x, res_in, w, EPS)
    exp_norm, exp_res = reference(x + peer, res if with_residual else None, w, EPS)
    assert group.calls == 1
    assert torch.equal(norm, exp_norm) and torch.equal(res_out, exp_res)
    if with_residual:
        assert torch.equal(res_in, res)  # functional: the residual input is untouched
    # The same through vLLM's IR ops themselves.
    ar = x + peer
    if with_residual:
        ir = vllm.ir.ops.fused_add_rms_norm(ar, res, w, EPS)
    else:
        ir = (vllm.ir.ops.rms_norm(ar, w, EPS), ar)
    assert torch.equal(norm, ir[0]) and torch.equal(res_out, ir[1])


def test_first_call_of_each_path_is_logged_once(caplog):
    """The op says once per group and path what it runs: the sign of YALI's fused op in a graph
    that vLLM loaded from its compile cache (no fusion pass is built then)."""
    x, peer, res, w = _tensors()
    vllm_log.forget_logged()
    group = StandInGroup(peer, StandInYali(fuse=True, group=StandInGroup(peer)))
    group.unique_name = "tp:7"
    with caplog.at_level("INFO", logger="vllm.yali"):
        for _ in range(3):
            vllm_fusion.run_on_group(group, x, res, w, EPS)
        group.device_communicator.yali_comm = StandInYali(fuse=False)
        vllm_fusion.run_on_group(group, x, res, w, EPS)
    lines = [r.getMessage() for r in caplog.records if "first call" in r.getMessage()]
    assert lines == ["YALI fused all-reduce + RMSNorm op: first call on group 'tp:7' runs YALI's fused kernel",
                     "YALI fused all-reduce + RMSNorm op: first call on group 'tp:7' runs the group's all-reduce, "
                     "then vLLM's RMSNorm"]


def test_fallback_when_yali_refuses_the_tensors():
    """Stand-in YALI communicator (see module docstring) that refuses: the
    unfused sequence runs, the fused call does not."""
    x, peer, res, w = _tensors()
    yali = StandInYali(fuse=False)
    group = StandInGroup(peer, yali)
    norm, res_out = vllm_fusion.run_on_group(group, x, res, w, 1e-6)
    exp = reference(x + peer, res, w, 1e-6)
    assert yali.calls == [] and group.calls == 1
    assert torch.equal(norm, exp[0]) and torch.equal(res_out, exp[1])


def test_yali_serves_when_it_can_fuse():
    """Stand-in YALI communicator that fuses: its result is returned and the
    group's all-reduce is not called again."""
    x, peer, res, w = _tensors()

    class Marked(StandInYali):
        def fused_allreduce_rmsnorm(self, x, residual, weight, eps):
            self.calls.append((residual is not None, eps))
            return torch.full_like(x, 1.0), torch.full_like(x, 2.0)

    yali = Marked(fuse=True)
    group = StandInGroup(peer, yali)
    norm, res_out = vllm_fusion.run_on_group(group, x, None, w, 1e-6)
    assert yali.calls == [(False, 1e-6)] and group.calls == 0
    assert torch.equal(norm, torch.ones_like(x)) and torch.equal(res_out, torch.full_like(x, 2.0))


# ------------------------------------------------------- the quantising op
def test_fuse_quant_setting_is_declared_once_and_read():
    """YALI_FUSE_QUANT: one line of settings.def (the list both C++ and Python read), a flag off by
    default, read through yali_vllm.config; a bad value is refused naming it."""
    lines = [ln for ln in config.SETTINGS_FILE.read_text().splitlines() if "YALI_FUSE_QUANT" in ln]
    assert len(lines) == 1 and lines[0].startswith("YALI_PLUGIN_SETTING(YALI_FUSE_QUANT, flag, \"0\"")
    s = config.SETTINGS[config.FUSE_QUANT_VAR]
    assert (s.name, s.type, s.default, s.field) == ("YALI_FUSE_QUANT", "flag", "0", None)
    assert config.fuse_quant_enabled({}) is False and config.fuse_quant_enabled({"YALI_FUSE_QUANT": ""}) is False
    assert config.fuse_quant_enabled({"YALI_FUSE_QUANT": "1"}) is True
    assert config.fuse_quant_enabled({"YALI_FUSE_QUANT": "off"}) is False
    assert "YALI_FUSE_QUANT" not in config.unknown_variables({"YALI_FUSE_QUANT": "1"})
    with pytest.raises(ValueError, match="invalid YALI_FUSE_QUANT='2'"):
        config.fuse_quant_enabled({"YALI_FUSE_QUANT": "2"})


def test_quant_op_registered_once_functional_schema():
    vllm_fusion.register_op()  # registers both ops, idempotent
    vllm_fusion.register_quant_op()
    schema = torch.ops.vllm.yali_fused_allreduce_rmsnorm_quant.default._schema
    # torch's schema inference writes a Python int as SymInt
    assert str(schema).replace("SymInt ", "int ") == (
        "vllm::yali_fused_allreduce_rmsnorm_quant(Tensor input, Tensor? residual, Tensor weight, float eps, "
        "Tensor? scale, str group_name, int scheme, int group_size, bool scale_ue8m0, int scale_layout, "
        "bool custom_quant) -> (Tensor, Tensor, Tensor)")
    assert not schema.is_mutable


@pytest.mark.parametrize("scheme, layout, shape, strides", [
    (1, 0, (7, 1), (1, 1)),
    (2, vllm_fusion.SCALE_ROW_MAJOR, (7, 2), (2, 1)),
    (2, vllm_fusion.SCALE_COLUMN_MAJOR, (7, 2), (1, 7)),
    (2, vllm_fusion.SCALE_TMA_ALIGNED, (7, 2), (1, 8)),  # 7 rows rounded up to 8
])
def test_quant_op_fake_impl_allocates_the_scale_as_vllm(scheme, layout, shape, strides):
    """The fake impl (what Inductor plans the graph with) and the op allocate one scale layout each:
    vLLM's per_token_group_quant_fp8 allocation for the same flags."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    vllm_fusion.register_op()
    with FakeTensorMode():
        x = torch.empty(7, 256, dtype=torch.bfloat16)
        w = torch.empty(256, dtype=torch.bfloat16)
        q, res, s = torch.ops.vllm.yali_fused_allreduce_rmsnorm_quant(x, x, w, EPS, None, "tp:0", scheme, 128, False,
                                                                     layout, False)
    assert q.shape == res.shape == (7, 256) and q.dtype == torch.float8_e4m3fn and res.dtype == torch.bfloat16
    assert (tuple(s.shape), s.stride(), s.dtype) == (shape, strides, torch.float32)
    real = vllm_fusion.allocate_scale(torch.empty(7, 256), vllm_fusion.QuantSpec(scheme, 128, False, layout))
    assert (tuple(real.shape), real.stride()) == (shape, strides)


def test_quant_op_refuses_bad_arguments_naming_them():
    vllm_fusion.register_op()
    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    op = torch.ops.vllm.yali_fused_allreduce_rmsnorm_quant
    with pytest.raises(ValueError, match="scheme 5 is not one of 0, 1, 2"):
        op(x, None, x[0], EPS, None, "tp:0", 5, 128, False, 0, False)
    with pytest.raises(ValueError, match="scale_layout 3 is not one of 0, 1, 2"):
        op(x, None, x[0], EPS, None, "tp:0", 2, 128, False, 3, False)
    with pytest.raises(ValueError, match="the static FP8 scheme needs its scale"):
        op(x, None, x[0], EPS, None, "tp:0", 0, 0, False, 0, False)


QUANT_SPECS = {
    "static": vllm_fusion.QuantSpec(0),
    "per-token": vllm_fusion.QuantSpec(1),
    "group-128": vllm_fusion.QuantSpec(2, 128),
    "group-128-column-major-ue8m0": vllm_fusion.QuantSpec(2, 128, True, vllm_fusion.SCALE_COLUMN_MAJOR),
}


def _native_quant(spec, h, scale):
    """vLLM's QuantFP8 native code for `spec`, built here as a model builds it."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    shape = {0: GroupShape.PER_TENSOR, 1: GroupShape.PER_TOKEN}.get(spec.scheme, GroupShape(1, spec.group_size))
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        q = QuantFP8(spec.scheme == 0, shape, column_major_scales=spec.layout == vllm_fusion.SCALE_COLUMN_MAJOR,
                     use_ue8m0=spec.ue8m0, compile_native=False)
    return q.forward_native(h, scale) if spec.scheme == 0 else q.forward_native(h)


COMMUNICATORS = {
    "no-communicator": lambda: None,
    "communicator-without-quant-op": lambda: StandInYali(fuse=True),  # one built before the quantising op
    "quant-op-refuses": lambda: StandInYaliQuant(fuse=False),
}


@pytest.mark.parametrize("communicator", sorted(COMMUNICATORS))
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("kind", sorted(QUANT_SPECS))
def test_quant_fallback_is_the_unfused_sequence(kind, with_residual, communicator):
    """Where YALI's quantising op does not run (no communicator, one without can_fuse_quant, or one
    that refuses the tensors): the group's all-reduce, vLLM's RMSNorm, then vLLM's QuantFP8 native
    code of the scheme; bit for bit, scales in the same layout, and a static scale that is a copy."""
    yali = COMMUNICATORS[communicator]()
    spec = QUANT_SPECS[kind]
    x, peer, res, w = _tensors(hidden=256)
    scale = torch.tensor([0.03]) if spec.scheme == 0 else None  # the static scale is an input
    group = StandInGroup(peer, yali)
    q, res_out, s = vllm_fusion.run_quant_on_group(group, x, res.clone() if with_residual else None, w, EPS, scale,
                                                   spec)
    norm, exp_res = reference(x + peer, res if with_residual else None, w, EPS)
    exp_q, exp_s = _native_quant(spec, norm, scale)
    assert group.calls == 1 and (yali is None or yali.calls == [])
    assert torch.equal(q.float(), exp_q.float()) and q.dtype == torch.float8_e4m3fn
    assert torch.equal(res_out, exp_res)
    assert torch.equal(s, exp_s) and s.stride() == exp_s.stride()
    if spec.scheme == 0:
        assert s.data_ptr() != scale.data_ptr()


def test_quant_op_runs_yalis_quantising_kernel_when_it_takes_the_tensors():
    """A communicator whose can_fuse_quant accepts: its quantising call gets the scheme, group size,
    ue8m0 and a scale buffer in the graph's layout; the group's all-reduce is not called again."""
    x, peer, res, w = _tensors(hidden=256)
    yali = StandInYaliQuant(fuse=True, group=StandInGroup(peer))
    group = StandInGroup(peer, yali)
    spec = QUANT_SPECS["group-128-column-major-ue8m0"]
    q, res_out, s = vllm_fusion.run_quant_on_group(group, x, res, w, EPS, None, spec)
    assert group.calls == 0 and yali.group.calls == 1
    assert yali.calls == [{"scheme": 2, "group_size": 128, "ue8m0": True, "residual": True, "eps": EPS,
                           "scale_out": [[3, 2], [1, 3]]}]
    norm, exp_res = reference(x + peer, res, w, EPS)
    exp_q, exp_s = _native_quant(spec, norm, None)
    assert torch.equal(q.float(), exp_q.float()) and torch.equal(res_out, exp_res)
    assert torch.equal(s, exp_s) and s.stride() == (1, 3)


# ------------------------------------------------------------ patching vLLM
@pytest.fixture
def pass_manager_module():
    """vLLM's real pass_manager module; its AllReduceFusionPass name and the
    plugin's compile-cache factor are restored afterwards."""
    from vllm import envs
    from vllm.compilation.passes import pass_manager

    original = pass_manager.__dict__.get("AllReduceFusionPass")
    factor = envs.environment_variables.pop(fusion_patch.CACHE_FACTOR, None)
    yield pass_manager
    if original is None:
        pass_manager.__dict__.pop("AllReduceFusionPass", None)
    else:
        pass_manager.AllReduceFusionPass = original
    envs.environment_variables.pop(fusion_patch.CACHE_FACTOR, None)
    if factor is not None:
        envs.environment_variables[fusion_patch.CACHE_FACTOR] = factor


def test_patch_skips_missing_symbol(pass_manager_module, caplog):
    pass_manager_module.__dict__.pop("AllReduceFusionPass", None)  # as on a CPU platform
    with caplog.at_level(logging.WARNING, logger="vllm.yali"):
        assert fusion_patch.patch_fusion_pass() is False
    assert "AllReduceFusionPass" not in pass_manager_module.__dict__
    assert any("AllReduceFusionPass is missing" in r.getMessage() for r in caplog.records)


def test_patch_replaces_symbol_once_and_unpatch_restores(pass_manager_module):
    pass_manager_module.AllReduceFusionPass = StandInPass
    assert fusion_patch.patch_fusion_pass() is True
    factory = pass_manager_module.AllReduceFusionPass
    assert factory is not StandInPass and factory._yali_original is StandInPass
    assert fusion_patch.patch_fusion_pass() is True  # idempotent: not wrapped twice
    assert pass_manager_module.AllReduceFusionPass is factory
    fusion_patch.unpatch_fusion_pass()
    assert pass_manager_module.AllReduceFusionPass is StandInPass


def test_install_hooks_follow_vllm_config(pass_manager_module, monkeypatch):
    """Eager / fusion off: nothing is patched; VLLM_COMPILE with the fusion on:
    the factory and the compile-cache factor are installed."""
    from vllm import envs
    from vllm.config import CompilationConfig, DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.config.compilation import CompilationMode, PassConfig

    pass_manager_module.AllReduceFusionPass = StandInPass

    def install(mode, fuse):
        cfg = VllmConfig(
            device_config=DeviceConfig(device="cpu"),
            compilation_config=CompilationConfig(mode=mode, pass_config=PassConfig(fuse_allreduce_rms=fuse)),
        )
        with set_current_vllm_config(cfg):
            fusion_patch.install_fusion_hooks()

    install(CompilationMode.NONE, True)
    install(CompilationMode.VLLM_COMPILE, False)
    assert pass_manager_module.AllReduceFusionPass is StandInPass
    assert fusion_patch.CACHE_FACTOR not in envs.environment_variables
    install(CompilationMode.VLLM_COMPILE, True)
    assert pass_manager_module.AllReduceFusionPass._yali_original is StandInPass
    # No TP group in this process: vLLM's pass, and the cache key says so.
    assert envs.compile_factors()[fusion_patch.CACHE_FACTOR] == "vllm"
    monkeypatch.setenv("YALI_FUSION", "bogus")
    assert envs.compile_factors()[fusion_patch.CACHE_FACTOR] == "invalid (ValueError)"


# ------------------------------------------- N real ranks on CPU (gloo)
# The TP world sizes of the multi-rank tests: YALI's two-rank path and its N-rank one; and one
# it does not serve.
CPU_WORLD_SIZES = (2, 4)
UNSERVED_WORLD_SIZE = 3
QUANT_OP = "vllm.yali_fused_allreduce_rmsnorm_quant.default"


def _write_model_config(path: Path) -> str:
    from yali_vllm.models import model_config

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model_config("8b")))
    return str(path)


def _node_targets(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _count(targets: list[str], name: str) -> int:
    return sum(1 for t in targets if t == name)


def _tp_setup(rank: int, port: int, world_size: int, model_dir: str):
    """In a spawned rank: a real vLLM TP group of `world_size` CPU ranks (gloo), with
    the plugin registered.  Returns (its VllmConfig, the TP GroupCoordinator)."""
    os.environ["VLLM_DISABLE_PYNCCL"] = "1"  # no NCCL library on a CPU box
    os.environ.pop("YALI_FUSION", None)
    from vllm.config import CompilationConfig, DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.config.compilation import CompilationMode, PassConfig
    from vllm.distributed.parallel_state import get_tp_group, init_distributed_environment, initialize_model_parallel

    cfg = VllmConfig(
        model_config=ModelConfig(model=model_dir, dtype="bfloat16", skip_tokenizer_init=True),
        device_config=DeviceConfig(device="cpu"),
        compilation_config=CompilationConfig(
            mode=CompilationMode.VLLM_COMPILE, pass_config=PassConfig(fuse_allreduce_rms=True)
        ),
    )
    with set_current_vllm_config(cfg):
        init_distributed_environment(
            world_size=world_size, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=rank, backend="gloo",
        )
        initialize_model_parallel(tensor_model_parallel_size=world_size)
    tp = get_tp_group()
    # As on the CUDA platform (use_custom_op_collectives): collectives are
    # traced as torch.ops.vllm.all_reduce, the op vLLM's patterns match.
    tp.use_custom_op_call = True
    plugin.register()  # registers the op, as in every vLLM process
    return cfg, tp


def _factory_choices(cfg, tp) -> dict:
    """What the plugin's pass factory and vLLM's pass manager build for `tp`, with
    and without a (stand-in) YALI communicator and with YALI_FUSION=0 or 1, and the lines the
    factory logs."""
    from vllm.compilation.passes import pass_manager

    res: dict = {}
    comm = tp.device_communicator
    factory = fusion_patch.fusion_pass_factory(StandInPass)
    handler_lines: list[str] = []

    class H(logging.Handler):
        def emit(self, record):
            handler_lines.append(record.getMessage())

    logging.getLogger("vllm.yali").addHandler(H())
    logging.getLogger("vllm.yali").setLevel(logging.INFO)

    comm.yali_comm = None
    res["off_decision"] = list(vllm_fusion.fusion_decision())
    res["off_pass"] = type(factory(cfg)).__name__
    res["off_factor"] = fusion_patch.fusion_cache_factor()
    comm.yali_comm = StandInYali(fuse=False, group=tp)
    res["on_decision"] = list(vllm_fusion.fusion_decision())
    res["on_pass"] = type(factory(cfg)).__name__
    res["on_factor"] = fusion_patch.fusion_cache_factor()
    os.environ["YALI_FUSION"] = "0"
    res["disabled_pass"] = type(factory(cfg)).__name__
    res["disabled_factor"] = fusion_patch.fusion_cache_factor()
    os.environ["YALI_FUSION"] = "1"  # set explicitly: the same as unset
    res["set_decision"] = list(vllm_fusion.fusion_decision())
    res["set_pass"] = type(factory(cfg)).__name__
    res["set_factor"] = fusion_patch.fusion_cache_factor()
    del os.environ["YALI_FUSION"]
    res["log"] = [ln for ln in handler_lines if ln.startswith(("YALI fusion pass ON", "YALI fusion pass OFF"))]
    res["patterns_log"] = [ln for ln in handler_lines if ln.startswith("YALI fusion pass: patterns")]

    # vLLM's own pass manager, with the symbol patched (a stand-in original:
    # see the module docstring), builds one fusion pass.
    pass_manager.AllReduceFusionPass = StandInPass
    fusion_patch.patch_fusion_pass()
    pm = pass_manager.PostGradPassManager()
    pm.configure(cfg)
    res["configured"] = [type(p).__name__ for p in pm.passes]

    # Which vLLM passes YALI's pass holds: none for a bf16 model (vLLM's pass is never built), vLLM's
    # (a FlashInfer stand-in up to 256 tokens, built once) for a quantised one, which the ON line names.
    built: list = []

    def flashinfer(c):
        built.append(RangedStandInPass(c, max_tokens=256))
        return built[-1]

    if not vllm_fusion.fusion_decision()[0]:  # a world size YALI does not serve
        return res
    ranged_factory = fusion_patch.fusion_pass_factory(flashinfer)
    bf16 = ranged_factory(cfg)
    res["bf16_flashinfer"] = [bf16.flashinfer is None, len(built)]
    vllm_log.forget_logged()
    del handler_lines[:]
    cfg.model_config.quantization = "fp8"
    try:
        fp8 = ranged_factory(cfg)
    finally:
        cfg.model_config.quantization = None
    res["fp8_flashinfer"] = [type(fp8).__name__, fp8.flashinfer is built[0], len(built)]
    res["fp8_log"] = [ln for ln in handler_lines if ln.startswith("YALI fusion pass ON")]

    # YALI_FUSE_QUANT=1: the ON line of a quantised model says so, and the compile-cache factor differs.
    vllm_log.forget_logged()
    del handler_lines[:]
    os.environ["YALI_FUSE_QUANT"] = "1"
    cfg.model_config.quantization = "fp8"
    try:
        res["fuse_quant_factor"] = fusion_patch.fusion_cache_factor()
        fp8 = ranged_factory(cfg)
        res["fuse_quant_pass"] = [fp8.fuse_quant, fp8.uuid() != bf16.uuid()]
    finally:
        cfg.model_config.quantization = None
        del os.environ["YALI_FUSE_QUANT"]
    res["fuse_quant_log"] = [ln for ln in handler_lines if ln.startswith("YALI fusion pass ON")]

    return res


def _rewrite_results(cfg, tp, rank: int) -> dict:
    """What YALI's pass does to traced graphs with vLLM's all-reduce and norm ops, and
    what the rewritten graphs compute over the real group."""
    import copy

    import vllm.ir.ops
    from torch.fx.experimental.proxy_tensor import make_fx
    from vllm.distributed import tensor_model_parallel_all_reduce

    res: dict = {}
    comm = tp.device_communicator
    # A three-norm stretch of a decoder: embedding all-reduce -> rms_norm, then
    # all_reduce -> fused_add_rms_norm twice, the last with its residual output
    # dead (as at the final norm).
    yali_pass = vllm_fusion.YaliAllReduceFusionPass(cfg)

    def model(x, w0, w1, w2):
        a = tensor_model_parallel_all_reduce(x)
        h = vllm.ir.ops.rms_norm(a, w0, 1e-5)
        res_ = a
        b = tensor_model_parallel_all_reduce(h * 2)
        h, res_ = vllm.ir.ops.fused_add_rms_norm(b, res_, w1, 1e-5)
        c = tensor_model_parallel_all_reduce(h + 1)
        h, _ = vllm.ir.ops.fused_add_rms_norm(c, res_, w2, 1e-6)
        return h, res_

    g = torch.Generator().manual_seed(rank)  # different per rank: a real sum
    hidden = 64
    args = [torch.randn(5, hidden, generator=g).bfloat16()]
    args += [torch.randn(hidden, generator=torch.Generator().manual_seed(10 + i)).bfloat16() for i in range(3)]

    def fresh():  # vLLM's CPU device communicator all-reduces in place
        return [a.clone() for a in args]

    expected = model(*fresh())

    def trace(fn):
        gm = make_fx(fn, tracing_mode="fake")(*fresh())
        gm.graph.eliminate_dead_code()  # the unused residual of the last norm goes
        gm.recompile()
        return gm

    gm = trace(model)
    res["before"] = _node_targets(gm)
    unchanged = copy.deepcopy(gm)
    yali_pass(gm.graph)
    gm.recompile()
    res["after"] = _node_targets(gm)
    res["matched"] = yali_pass.matched_count
    res["uuid"] = yali_pass.uuid()  # part of Inductor's cache key

    comm.yali_comm = StandInYali(fuse=False, group=tp)  # refuses: unfused fallback
    out = gm(*fresh())
    res["fallback_equal"] = [torch.equal(o, e) for o, e in zip(out, expected)]
    res["unchanged_equal"] = [torch.equal(o, e) for o, e in zip(unchanged(*fresh()), expected)]
    yali = StandInYali(fuse=True, group=tp)
    comm.yali_comm = yali
    out = gm(*fresh())
    res["fused_equal"] = [torch.equal(o, e) for o, e in zip(out, expected)]
    res["fused_calls"] = yali.calls

    # What stays unfused: an eps vLLM has no pattern for, and a Gemma-style
    # fp32 weight (input/weight dtypes differ).
    def odd(x, w):
        a = tensor_model_parallel_all_reduce(x)
        return vllm.ir.ops.rms_norm(a, w, 1e-4), a

    def gemma(x, w):
        a = tensor_model_parallel_all_reduce(x)
        return vllm.ir.ops.rms_norm(a, w.float() + 1.0, 1e-6), a

    for name, fn in (("odd_eps", odd), ("gemma", gemma)):
        gm2 = make_fx(fn, tracing_mode="fake")(args[0].clone(), args[1])
        yali_pass(gm2.graph)
        res[name] = [yali_pass.matched_count, _node_targets(gm2)]
    return res


# Compile ranges as vLLM splits them at four ranks on Hopper (FlashInfer's 2 MiB: 256 rows of
# hidden 4096 bf16) and at its default max_num_batched_tokens, plus a range straddling YALI's limit.
RANGES = ((1, 256), (257, 1024), (257, 8192), (1025, 8192))


def _range_results(cfg, tp) -> dict:
    """Which compile ranges YALI's pass applies to, for communicators serving up to 8 MiB (the
    N-rank limit above 4 ranks: 1024 rows of the 8B model's hidden 4096 bf16) and 2 GiB (two ranks), and for
    a stand-in that states no limit."""
    from vllm.config.utils import Range

    comm = tp.device_communicator
    out = {}
    for limit in (8 << 20, 2 << 30, None):
        comm.yali_comm = StandInYali(fuse=True, group=tp, serve_limit=limit)
        p = vllm_fusion.YaliAllReduceFusionPass(cfg)
        out[str(limit)] = [p.max_token_num, [p.is_applicable_for_range(Range(start=a, end=b)) for a, b in RANGES]]
    # With vLLM's pass (a quantised model; a FlashInfer stand-in serving up to 256 tokens) beside
    # YALI's (up to 1024: 8 MiB of hidden 4096 bf16): a range applies where either does, and vLLM's
    # pass runs only in its own ranges, after YALI's.
    comm.yali_comm = StandInYali(fuse=True, group=tp, serve_limit=8 << 20)
    flashinfer = RangedStandInPass(cfg, max_tokens=256)
    both = vllm_fusion.YaliAllReduceFusionPass(cfg, flashinfer=flashinfer)
    alone = vllm_fusion.YaliAllReduceFusionPass(cfg)
    routed = []
    for a, b in RANGES:
        r = Range(start=a, end=b)
        applies = both.is_applicable_for_range(r)
        calls = flashinfer.calls
        graph = torch.fx.Graph()  # nothing to rewrite: only which passes run is looked at
        graph.output(graph.placeholder("x"))
        both(torch.fx.GraphModule(torch.nn.Module(), graph).graph)
        routed.append([applies, flashinfer.calls - calls])
    out["with_flashinfer"] = routed
    out["uuids"] = [both.uuid(), alone.uuid(), flashinfer.uuid()]
    comm.yali_comm = None
    return out


def _quant_model():
    """A decoder stretch of an FP8 model, as vLLM traces it with its custom ops off: four
    all-reduce + RMSNorm pairs whose norm outputs are quantised by vLLM's QuantFP8 (native code) with
    a static per-tensor scale, dynamic per-token scales and per-group-of-128 scales, and the final
    norm, not quantised."""
    import vllm.ir.ops
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import tensor_model_parallel_all_reduce as ar
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        static = QuantFP8(True, GroupShape.PER_TENSOR, compile_native=False)
        token = QuantFP8(False, GroupShape.PER_TOKEN, compile_native=False)
        group = QuantFP8(False, GroupShape(1, 128), compile_native=False)

    def model(x, w, scale):
        a = ar(x)
        h = vllm.ir.ops.rms_norm(a, w, 1e-5)
        q1, _ = static.forward_native(h, scale)
        h, r = vllm.ir.ops.fused_add_rms_norm(ar(x * 2), a, w, 1e-5)
        q2, s2 = token.forward_native(h)
        h, r = vllm.ir.ops.fused_add_rms_norm(ar(x + 1), r, w, 1e-5)
        q3, s3 = group.forward_native(h)
        h, _ = vllm.ir.ops.fused_add_rms_norm(ar(x - 1), r, w, 1e-6)
        return q1, q2, s2, q3, s3, h

    return model


def _quant_results(cfg, tp, rank: int) -> dict:
    """Where YALI's pass sends each pair of _quant_model in a range FlashInfer serves, one above it,
    and without vLLM's pass; and that every rewritten graph computes what the model does."""
    import copy

    from torch.fx.experimental.proxy_tensor import make_fx
    from vllm.config.utils import Range

    from yali_vllm import fusion_routing

    model = _quant_model()
    g = torch.Generator().manual_seed(rank)
    hidden = 256
    args = [torch.randn(5, hidden, generator=g).bfloat16(),
            torch.randn(hidden, generator=torch.Generator().manual_seed(7)).bfloat16(), torch.tensor([0.02])]

    def fresh():
        return [a.clone() for a in args]

    expected = [t.float() for t in model(*fresh())]
    traced = make_fx(model, tracing_mode="fake")(*fresh())
    traced.graph.eliminate_dead_code()
    traced.recompile()
    out: dict = {"before": _node_targets(traced)}
    comm = tp.device_communicator
    for name, flashinfer_max, r in (("flashinfer_range", 256, Range(start=1, end=256)),
                                    ("above_flashinfer", 256, Range(start=257, end=1024)),
                                    ("no_flashinfer", None, Range(start=1, end=256))):
        comm.yali_comm = StandInYali(fuse=True, group=tp, serve_limit=8 << 20)
        flashinfer = RangedStandInPass(cfg, max_tokens=flashinfer_max) if flashinfer_max else None
        p = vllm_fusion.YaliAllReduceFusionPass(cfg, flashinfer=flashinfer)
        gm = copy.deepcopy(traced)
        assert p.is_applicable_for_range(r)
        p(gm.graph)
        gm.recompile()
        got = [t.float() for t in gm(*fresh())]
        out[name] = {
            "targets": _node_targets(gm),
            "routes": p.route_counts,
            "flashinfer_calls": flashinfer.calls if flashinfer else None,
            "equal": [torch.equal(a, b) for a, b in zip(got, expected)],
            "fused_calls": len(comm.yali_comm.calls),
        }
    comm.yali_comm = None
    out["route_names"] = [fusion_routing.YALI, fusion_routing.FLASHINFER, fusion_routing.VLLM]
    return out


def _all_schemes_model():
    """A decoder stretch of an FP8 model with every quantisation YALI_FUSE_QUANT rewrites, as vLLM
    traces them with its custom ops off (vLLM's QuantFP8 native code): static per-tensor after the
    first norm (no residual), then after fused-add norms dynamic per-token, per-group-of-128 with
    row-major scales, per-group-of-128 with column-major ue8m0 scales (DeepGEMM's request) and static
    per-tensor again; the final norm is not quantised."""
    import vllm.ir.ops
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import tensor_model_parallel_all_reduce as ar
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        static = QuantFP8(True, GroupShape.PER_TENSOR, compile_native=False)
        token = QuantFP8(False, GroupShape.PER_TOKEN, compile_native=False)
        group = QuantFP8(False, GroupShape(1, 128), use_ue8m0=False, compile_native=False)
        group_cm = QuantFP8(False, GroupShape(1, 128), column_major_scales=True, use_ue8m0=True, compile_native=False)

    def model(x, w, scale):
        a = ar(x)
        h = vllm.ir.ops.rms_norm(a, w, 1e-5)
        q1, _ = static.forward_native(h, scale)
        h, r = vllm.ir.ops.fused_add_rms_norm(ar(x * 2), a, w, 1e-5)
        q2, s2 = token.forward_native(h)
        h, r = vllm.ir.ops.fused_add_rms_norm(ar(x + 1), r, w, 1e-6)
        q3, s3 = group.forward_native(h)
        h, r = vllm.ir.ops.fused_add_rms_norm(ar(x - 1), r, w, 1e-5)
        q4, s4 = group_cm.forward_native(h)
        h, r = vllm.ir.ops.fused_add_rms_norm(ar(x * 3), r, w, 1e-5)
        q5, _ = static.forward_native(h, scale)
        h, _ = vllm.ir.ops.fused_add_rms_norm(ar(x - 2), r, w, 1e-6)
        return q1, q2, s2, q3, s3, q4, s4, q5, h

    return model


def _post_grad_trace(fn, args):
    """`fn` traced as Inductor's post-grad passes see it: Inductor's decompositions, no-op ops removed
    (what the pattern matcher traces patterns with, pm.fwd_only), in fake mode."""
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.post_grad import remove_noop_ops
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(fn, select_decomp_table(), tracing_mode="fake")(*args)
    remove_noop_ops(gm.graph)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _fuse_quant_results(cfg, tp, rank: int) -> dict:
    """What YALI's pass makes of _all_schemes_model with YALI_FUSE_QUANT=1 (in FlashInfer's range, above
    it, without vLLM's pass, and in a range YALI does not serve) and with it 0; what each rewritten
    graph computes, with the op's fallback and with a stand-in quantising communicator."""
    import copy

    from torch.fx.experimental.proxy_tensor import make_fx
    from vllm.config.utils import Range

    model = _all_schemes_model()
    g = torch.Generator().manual_seed(rank)
    hidden = 256
    args = [torch.randn(5, hidden, generator=g).bfloat16(),
            torch.randn(hidden, generator=torch.Generator().manual_seed(7)).bfloat16(), torch.tensor([0.02])]

    def fresh():
        return [a.clone() for a in args]

    expected = model(*fresh())
    traced = _post_grad_trace(model, fresh())
    comm = tp.device_communicator
    out: dict = {"before": _node_targets(traced)}

    def run(name, setting, flashinfer_max, serve_limit, r):
        os.environ["YALI_FUSE_QUANT"] = setting
        try:
            comm.yali_comm = StandInYaliQuant(fuse=False, group=tp, serve_limit=serve_limit)
            flashinfer = RangedStandInPass(cfg, max_tokens=flashinfer_max) if flashinfer_max else None
            p = vllm_fusion.YaliAllReduceFusionPass(cfg, flashinfer=flashinfer)
        finally:
            del os.environ["YALI_FUSE_QUANT"]
        gm = copy.deepcopy(traced)
        applies = p.is_applicable_for_range(r)
        if applies:
            p(gm.graph)
            gm.recompile()
        res = {"applies": applies, "targets": _node_targets(gm), "routes": p.route_counts,
               "flashinfer_calls": flashinfer.calls if flashinfer else None,
               "quant_ops": [[n.args[6], n.args[7], n.args[8], n.args[9], n.args[1] is not None, n.args[3]]
                             for n in gm.graph.nodes if str(n.target) == QUANT_OP]}
        for path, fuse in (("fallback", False), ("fused", True)):
            comm.yali_comm = StandInYaliQuant(fuse=fuse, group=tp, serve_limit=serve_limit)
            got = gm(*fresh())
            res[path] = {"equal": [torch.equal(a.float(), b.float()) for a, b in zip(got, expected)],
                         "strides": [a.stride() == b.stride() for a, b in zip(got, expected)],
                         "calls": comm.yali_comm.calls}
        out[name] = res

    yali_8m = 8 << 20  # 1024 rows of the model's hidden 4096 bf16
    run("flashinfer_range", "1", 256, yali_8m, Range(start=1, end=256))
    run("above_flashinfer", "1", 256, yali_8m, Range(start=257, end=1024))
    run("no_flashinfer", "1", None, yali_8m, Range(start=1, end=256))
    run("yali_not_serving", "1", 256, 128 * 4096 * 2, Range(start=129, end=256))
    run("off_flashinfer_range", "0", 256, yali_8m, Range(start=1, end=256))
    run("off_above_flashinfer", "0", 256, yali_8m, Range(start=257, end=1024))
    comm.yali_comm = None
    from yali_vllm import fusion_routing

    out["route_names"] = [fusion_routing.YALI, fusion_routing.YALI_QUANT, fusion_routing.FLASHINFER,
                          fusion_routing.VLLM]
    return out


def _record(rank: int, outdir: str, body) -> None:
    """Runs `body()` in a spawned rank and writes its dict, or the error, to rank<N>.json."""
    res: dict = {}
    try:
        res = body()
    except Exception as e:  # reported to the parent
        import traceback

        res["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    finally:
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(res))
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _rank_worker(rank: int, port: int, world_size: int, model_dir: str, outdir: str) -> None:
    """Spawned `world_size` times: a real vLLM TP group of that many CPU ranks
    (gloo).  Records the factory's choices, what vLLM's pass manager builds,
    and what YALI's pass does to traced graphs."""

    def body() -> dict:
        cfg, tp = _tp_setup(rank, port, world_size, model_dir)
        return {**_factory_choices(cfg, tp), **_rewrite_results(cfg, tp, rank), "ranges": _range_results(cfg, tp),
                "quant": _quant_results(cfg, tp, rank), "fuse_quant": _fuse_quant_results(cfg, tp, rank)}

    _record(rank, outdir, body)


def _choices_worker(rank: int, port: int, world_size: int, model_dir: str, outdir: str) -> None:
    """Spawned `world_size` times: the factory's choices only, on a real vLLM TP group."""
    _record(rank, outdir, lambda: _factory_choices(*_tp_setup(rank, port, world_size, model_dir)))


@pytest.fixture(scope="module", params=CPU_WORLD_SIZES, ids=lambda n: f"tp{n}")
def tp_ranks(request, tmp_path_factory):
    """Every rank's result of _rank_worker on a vLLM TP group of `request.param` ranks."""
    world_size = request.param
    outdir = tmp_path_factory.mktemp(f"fusion_tp{world_size}")
    model_dir = _write_model_config(outdir / "model")
    return run_cpu_ranks(_rank_worker, world_size, model_dir, outdir=outdir, world_size=world_size)


def test_ranks_factory_follows_yali_and_yali_fusion(tp_ranks):
    n = len(tp_ranks)
    served = f"YALI serves TP group 'tp:0' ({n} ranks)"
    on_line = f"YALI fusion pass ON (replaces vLLM's FlashInfer all-reduce+RMSNorm fusion): {served}"
    for res in tp_ranks:
        assert res["off_decision"] == [False, "YALI all-reduce is OFF for group 'tp:0'"]
        assert res["off_pass"] == "StandInPass" and res["off_factor"] == "vllm"
        assert res["disabled_pass"] == "StandInPass" and res["disabled_factor"] == "vllm"
        assert res["on_decision"] == res["set_decision"] == [True, served]
        assert res["on_pass"] == res["set_pass"] == "YaliAllReduceFusionPass"
        assert _choice(res["on_factor"]) == _choice(res["set_factor"]) == "yali"
        # each distinct line once per process
        assert res["log"] == [
            "YALI fusion pass OFF: YALI all-reduce is OFF for group 'tp:0'; "
            "using vLLM's FlashInfer all-reduce+RMSNorm fusion",
            on_line,
            "YALI fusion pass OFF: disabled by YALI_FUSION; "
            "using vLLM's FlashInfer all-reduce+RMSNorm fusion",
        ]
        assert len(res["patterns_log"]) == 1, res["patterns_log"]
        assert "all_reduce+fused_add_rms_norm[norm only]" in res["patterns_log"][0]
        assert "eps 1e-05, 1e-06" in res["patterns_log"][0]


def test_ranks_quantised_model_gets_vllms_pass_inside_yalis(tp_ranks):
    """A bf16 model never builds vLLM's pass (no FlashInfer workspace beside YALI's); a quantised one
    builds it once, inside YALI's pass, and the ON line says where its quantised pairs go."""
    n = len(tp_ranks)
    for res in tp_ranks:
        assert res["bf16_flashinfer"] == [True, 0]
        assert res["fp8_flashinfer"] == ["YaliAllReduceFusionPass", True, 1]
        assert res["fp8_log"] == [
            f"YALI fusion pass ON (replaces vLLM's FlashInfer all-reduce+RMSNorm fusion): YALI serves TP group "
            f"'tp:0' ({n} ranks); the model is quantised (fp8): up to 256 tokens (FlashInfer's compile ranges) a "
            "pair whose RMSNorm output is quantised to static FP8 goes to vLLM's FlashInfer all-reduce + RMSNorm + "
            "quant kernel and a dynamic or per-group one to YALI's fused op, then vLLM's quant; above that every "
            "quantised pair stays with YALI's all-reduce, then vLLM's RMSNorm + quant"]


def test_ranks_fuse_quant_names_itself_in_the_on_line_and_the_cache_key(tp_ranks):
    """YALI_FUSE_QUANT=1: the ON line of a quantised model says where its quantised pairs go, the
    compile-cache factor and the pass's uuid differ from the setting off (a graph rewritten without
    YALI's quantising op is not reused with it, nor the reverse)."""
    n = len(tp_ranks)
    for res in tp_ranks:
        assert res["fuse_quant_factor"] == res["on_factor"] + "+quant"
        assert res["fuse_quant_pass"] == [True, True]
        assert res["fuse_quant_log"] == [
            f"YALI fusion pass ON (replaces vLLM's FlashInfer all-reduce+RMSNorm fusion): YALI serves TP group "
            f"'tp:0' ({n} ranks); the model is quantised (fp8) and YALI_FUSE_QUANT=1: where YALI serves the "
            "compile range a pair whose RMSNorm output is quantised to static, per-token or group-128 FP8 goes to "
            "YALI's fused all-reduce + RMSNorm + FP8 quant op; any other quantised pair as with YALI_FUSE_QUANT=0 "
            "(the model is quantised (fp8): up to 256 tokens (FlashInfer's compile ranges) a pair whose RMSNorm "
            "output is quantised to static FP8 goes to vLLM's FlashInfer all-reduce + RMSNorm + quant kernel and a "
            "dynamic or per-group one to YALI's fused op, then vLLM's quant; above that every quantised pair stays "
            "with YALI's all-reduce, then vLLM's RMSNorm + quant)"]


def test_ranks_quantised_pairs_go_where_vllm_fuses_their_quantisation(tp_ranks):
    """The FP8 decoder stretch: in FlashInfer's range the static-FP8 pair is left to vLLM's
    FlashInfer pass (which then runs), the dynamic per-token and per-group pairs and the unquantised
    final norm go to YALI's op; above FlashInfer's range, and without vLLM's pass, every quantised
    pair stays unfused (the all-reduce for YALI, the norm + quant for vLLM's RMSNorm + quant pass)
    and only the final norm goes to YALI's op. Every rewritten graph computes what the model does."""
    op, ar = "vllm.yali_fused_allreduce_rmsnorm.default", "vllm.all_reduce.default"
    norms = ("vllm_ir.rms_norm.default", "vllm_ir.fused_add_rms_norm.default")
    for res in tp_ranks:
        q = res["quant"]
        yali, flashinfer, vllm_ = q["route_names"]
        assert _count(q["before"], ar) == 4 and _count(q["before"], op) == 0
        inside = q["flashinfer_range"]
        assert inside["routes"] == {yali: 3, flashinfer: 1}
        assert inside["flashinfer_calls"] == 1
        assert _count(inside["targets"], op) == 3 and _count(inside["targets"], ar) == 1
        assert _count(inside["targets"], norms[0]) == 1 and _count(inside["targets"], norms[1]) == 0
        for name in ("above_flashinfer", "no_flashinfer"):
            left = q[name]
            assert left["routes"] == {yali: 1, vllm_: 3}, name
            assert _count(left["targets"], op) == 1 and _count(left["targets"], ar) == 3, name
            assert sum(_count(left["targets"], n) for n in norms) == 3, name
        assert q["above_flashinfer"]["flashinfer_calls"] == 0
        assert q["no_flashinfer"]["flashinfer_calls"] is None
        for name in ("flashinfer_range", "above_flashinfer", "no_flashinfer"):
            assert q[name]["equal"] == [True] * 6, name
        assert [q[name]["fused_calls"] for name in ("flashinfer_range", "above_flashinfer")] == [3, 1]


@pytest.fixture(scope="module")
def unserved_tp_ranks(tmp_path_factory):
    """Every rank's factory choices on a vLLM TP group of UNSERVED_WORLD_SIZE ranks."""
    outdir = tmp_path_factory.mktemp(f"fusion_tp{UNSERVED_WORLD_SIZE}")
    model_dir = _write_model_config(outdir / "model")
    return run_cpu_ranks(_choices_worker, UNSERVED_WORLD_SIZE, model_dir, outdir=outdir,
                         world_size=UNSERVED_WORLD_SIZE)


def test_unserved_tp_world_size_keeps_vllms_fusion_pass(unserved_tp_ranks):
    """Even with a YALI communicator on the group, a TP world size YALI does not serve gets
    vLLM's pass, on every rank, with the reason naming the world size."""
    refusal = config.world_size_refusal(UNSERVED_WORLD_SIZE)
    assert refusal is not None and f"world size is {UNSERVED_WORLD_SIZE}" in refusal
    why = f"TP group 'tp:0': {refusal}"
    for res in unserved_tp_ranks:
        assert res["off_decision"] == res["on_decision"] == [False, why]
        assert res["off_pass"] == res["on_pass"] == "StandInPass"
        assert res["on_factor"] == "vllm"
        assert res["log"] == [
            f"YALI fusion pass OFF: {why}; using vLLM's FlashInfer all-reduce+RMSNorm fusion",
            "YALI fusion pass OFF: disabled by YALI_FUSION; using vLLM's FlashInfer all-reduce+RMSNorm fusion",
        ]
        assert "StandInPass" in res["configured"] and "YaliAllReduceFusionPass" not in res["configured"]


def _choice(factor: str) -> str:
    """The pass choice of a compile-cache factor ("yali@<sources hash>" -> "yali")."""
    return factor.split("@")[0]


def test_ranks_cache_factor_names_the_pass_sources(tp_ranks):
    """The compile-cache factor carries the hash of YALI's pass sources, the same on every rank,
    so a graph rewritten by another version of the passes is not reused."""
    hashes = {res["on_factor"].split("@")[1] for res in tp_ranks}
    assert len(hashes) == 1 and len(hashes.pop()) == 16
    assert all(res["on_factor"] == res["set_factor"] for res in tp_ranks)


def test_ranks_pass_applies_only_to_the_token_counts_yali_serves(tp_ranks):
    """Like vLLM's FlashInfer pass: a compile range whose largest token count is above what YALI's
    communicator serves keeps vLLM's compiled all-reduce + RMSNorm (no eager fallback inside
    YALI's op for every prefill layer)."""
    for res in tp_ranks:
        assert res["ranges"][str(8 << 20)] == [1024, [True, True, False, False]]
        assert res["ranges"][str(2 << 30)] == [262144, [True, True, True, True]]
        assert res["ranges"]["None"] == [None, [True, True, True, True]]
    assert any("compile ranges up to" in ln or "every token count" in ln for ln in tp_ranks[0]["patterns_log"])


def test_ranks_vllms_pass_runs_only_in_its_own_ranges(tp_ranks):
    """With vLLM's pass inside (up to 256 tokens here) YALI's pass applies where either serves
    (YALI up to 1024) and runs vLLM's only in vLLM's ranges; the cache key covers both."""
    for res in tp_ranks:
        assert res["ranges"]["with_flashinfer"] == [[True, 1], [True, 0], [False, 0], [False, 0]]
        both, alone, flashinfer = res["ranges"]["uuids"]
        assert both == alone + flashinfer and both != alone


def test_ranks_vllm_pass_manager_builds_one_fusion_pass(tp_ranks):
    """vLLM's pass manager builds YALI's pass, never two fusion passes side by side."""
    for res in tp_ranks:
        fusion = [p for p in res["configured"] if p in ("YaliAllReduceFusionPass", "StandInPass")]
        assert fusion == ["YaliAllReduceFusionPass"], res["configured"]


def test_ranks_rewrite_replaces_all_reduce_and_norms(tp_ranks):
    op = "vllm.yali_fused_allreduce_rmsnorm.default"
    for res in tp_ranks:
        before, after = res["before"], res["after"]
        assert _count(before, "vllm.all_reduce.default") == 3
        assert _count(before, "vllm_ir.rms_norm.default") == 1
        assert _count(before, "vllm_ir.fused_add_rms_norm.default") == 2
        assert _count(before, op) == 0
        # One YALI op per all-reduce; no all-reduce or norm left: the first
        # (rms_norm), the second (fused add, both outputs used) and the third
        # (fused add, residual dead: the first-return-only pattern, eps 1e-6).
        assert res["matched"] == 3
        assert len(res["uuid"]) == 64 and res["uuid"] == tp_ranks[0]["uuid"]
        assert _count(after, op) == 3
        for gone in ("vllm.all_reduce.default", "vllm_ir.rms_norm.default",
                     "vllm_ir.fused_add_rms_norm.default"):
            assert _count(after, gone) == 0, after


def test_ranks_rewritten_graph_computes_the_same(tp_ranks):
    for res in tp_ranks:
        assert res["unchanged_equal"] == [True, True]
        assert res["fallback_equal"] == [True, True]  # op's unfused fallback, real gloo sums
        assert res["fused_equal"] == [True, True]  # stand-in YALI called with the right arguments
        assert res["fused_calls"] == [
            {"shape": [5, 64], "residual": False, "eps": 1e-5},
            {"shape": [5, 64], "residual": True, "eps": 1e-5},
            {"shape": [5, 64], "residual": True, "eps": 1e-6},
        ]


def test_ranks_unmatched_variants_stay_unfused(tp_ranks):
    for res in tp_ranks:
        for name in ("odd_eps", "gemma"):
            matched, targets = res[name]
            assert matched == 0, name
            assert "vllm.yali_fused_allreduce_rmsnorm.default" not in targets, name
            assert _count(targets, "vllm.all_reduce.default") == 1, name



def test_ranks_fuse_quant_rewrites_each_scheme_into_yalis_quant_op(tp_ranks):
    """YALI_FUSE_QUANT=1, every compile range YALI serves (in FlashInfer's range, above it, without
    vLLM's pass): each quantised pair (static after the first norm, then per-token, group-128
    row-major, group-128 column-major ue8m0, static) becomes one YALI quant op node with its scheme,
    group size, ue8m0 and scale layout, the final (unquantised) norm YALI's plain op; no all-reduce
    or norm is left. The rewritten graph computes bit for bit what the model does, with the op's
    fallback (the group's all-reduce, vLLM's RMSNorm, the graph's own QuantFP8 code) and through a
    quantising communicator, which gets the scale buffer in the graph's layout."""
    norms = ("vllm_ir.rms_norm.default", "vllm_ir.fused_add_rms_norm.default")
    op, ar = "vllm.yali_fused_allreduce_rmsnorm.default", "vllm.all_reduce.default"
    # [scheme, group size, ue8m0, scale layout, residual, eps] per pair, in graph order
    want = [[0, 0, False, 0, False, 1e-5], [1, 0, False, 0, True, 1e-5], [2, 128, False, 0, True, 1e-6],
            [2, 128, True, 1, True, 1e-5], [0, 0, False, 0, True, 1e-5]]
    scale_out = [None, [[5, 1], [1, 1]], [[5, 2], [2, 1]], [[5, 2], [1, 5]], None]
    for res in tp_ranks:
        q = res["fuse_quant"]
        yali, yali_quant = q["route_names"][:2]
        assert _count(q["before"], ar) == 6 and _count(q["before"], QUANT_OP) == 0
        for name, flashinfer_calls in (("flashinfer_range", 1), ("above_flashinfer", 0), ("no_flashinfer", None)):
            r = q[name]
            assert r["applies"] and r["routes"] == {yali: 1, yali_quant: 5}, name
            assert r["flashinfer_calls"] == flashinfer_calls, name
            assert r["quant_ops"] == want, name
            assert _count(r["targets"], QUANT_OP) == 5 and _count(r["targets"], op) == 1, name
            assert _count(r["targets"], ar) == 0 and sum(_count(r["targets"], n) for n in norms) == 0, name
            for path in ("fallback", "fused"):
                assert r[path]["equal"] == [True] * 9 and r[path]["strides"] == [True] * 9, (name, path)
            assert r["fallback"]["calls"] == []
            quant_calls = [c for c in r["fused"]["calls"] if "scheme" in c]
            assert [[c["scheme"], c["ue8m0"], c["residual"], c["eps"]] for c in quant_calls] == [
                [w[0], w[2], w[4], w[5]] for w in want], name
            assert [c["scale_out"] for c in quant_calls] == scale_out, name


def test_ranks_fuse_quant_leaves_item_routing_where_yali_does_not_serve_or_when_off(tp_ranks):
    """Where YALI does not serve the compile range (here: YALI up to 128 tokens, FlashInfer up to 256)
    YALI_FUSE_QUANT=1 changes nothing: vLLM's pass gets the graph as it was. With YALI_FUSE_QUANT=0
    every pair goes where fusion_routing.route says: in FlashInfer's range the two static pairs to
    vLLM's FlashInfer pass, the dynamic ones and the final norm to YALI's op; above it the
    quantised pairs stay unfused."""
    for res in tp_ranks:
        q = res["fuse_quant"]
        yali, _, flashinfer, vllm_ = q["route_names"]
        r = q["yali_not_serving"]
        assert r["applies"] and r["routes"] == {yali: 0} and r["flashinfer_calls"] == 1
        assert r["targets"] == q["before"]
        inside, above = q["off_flashinfer_range"], q["off_above_flashinfer"]
        assert inside["routes"] == {yali: 4, flashinfer: 2} and inside["flashinfer_calls"] == 1
        assert above["routes"] == {yali: 1, vllm_: 5} and above["flashinfer_calls"] == 0
        for r in (inside, above):
            assert r["quant_ops"] == [] and _count(r["targets"], QUANT_OP) == 0
            assert r["fallback"]["equal"] == r["fused"]["equal"] == [True] * 9
        assert _count(inside["targets"], "vllm.yali_fused_allreduce_rmsnorm.default") == 4
        assert _count(above["targets"], "vllm.yali_fused_allreduce_rmsnorm.default") == 1
