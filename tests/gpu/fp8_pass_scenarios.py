"""vLLM's real compilation passes over an FP8 model's all-reduce + RMSNorm pairs, run inside every
rank of a TP group (pair.run_ranks: one GPU each, or all on GPU 0 with YALI_ALLOW_SHARED_GPU=1).

Each rank builds what a vLLM worker builds for an FP8 checkpoint of the embedded Llama-8B shape
(yali_vllm.models --quant): a VllmConfig from its config.json (vLLM picks the quantisation method,
its custom ops and its fusion passes on its own, as for ``vllm serve``), the TP group with the
plugin registered (YALI serves it), and a decoder stretch of vLLM's own layers quantised by that
config, with the model's three kinds of all-reduce + RMSNorm pair:

    a = all_reduce(x)                 # the embedding's all-reduce
    h = input_layernorm(a)            # pair 1: RMSNorm; mlp_0's FP8 GEMM quantises its output
    d = mlp_0(h)                      # LlamaMLP: FP8 gate_up, SiLU * mul, FP8 down + all-reduce
    h, r = post_layernorm(d, a)       # pair 2: fused-add RMSNorm; mlp_1 quantises its output
    d = mlp_1(h)
    h, r = norm(d, r)                 # pair 3: the final norm, not quantised

A case compiles it with torch.compile through Inductor, whose post-grad custom pass is vLLM's
PostGradPassManager configured from that config (the plugin's factory in place of vLLM's
AllReduceFusionPass, as in a worker; vLLM's FlashInfer all-reduce fusion and its RMSNorm + quant
fusion real), under a compile range (vLLM's pass context), and runs it. It records the kernels the
graph holds after the passes (vLLM's ops, vLLM IR ops, YALI's ops), where YALI's pass sent each pair,
YALI's kernel counters, and the compiled outputs against the eager stretch (the same layers,
unfused). The test (test_vllm_fp8_passes.py) compares each case with vLLM's defaults (YALI_FUSION=0)
of the same range.
"""
from __future__ import annotations

import logging
import os
import traceback

from unittest import mock

import torch

from .scenarios import digest

TOKENS = 37  # odd: rows that fill no tile
INTERMEDIATE = 2048  # per-rank shards stay multiples of the block quantisation's 128 columns
SEED = 1234

YALI_OP = "vllm::yali_fused_allreduce_rmsnorm"
YALI_QUANT_OP = "vllm::yali_fused_allreduce_rmsnorm_quant"
FLASHINFER_OP = "vllm::flashinfer_trtllm_fused_allreduce_norm"
ALL_REDUCE_OP = "vllm::all_reduce"

# The schemes as the test runs them: name -> (yali-vllm-model --quant, the ranks' environment).
#   fp8-block: vLLM's own pick on an H200, FlashInfer's block-scaled FP8 GEMM op (DeepGEMM for 32
#   rows and more), which takes the BF16 activations and quantises them inside: no quantisation
#   node follows the norm. fp8-block-separate-quant: that kernel turned off, so vLLM's next pick
#   (DeepGEMM or CUTLASS) quantises the activations with QuantFP8 (per group of 128, its custom op
#   under +quant_fp8) before the GEMM, the form YALI_FUSE_QUANT=1 fuses.
SCHEMES = {
    "fp8-static": ("fp8-static", {}),
    "fp8-dynamic": ("fp8-dynamic", {}),
    "fp8-block": ("fp8-block", {}),
    "fp8-block-separate-quant": ("fp8-block", {"VLLM_DISABLED_KERNELS": "FlashInferFp8DeepGEMMDynamicBlockScaledKernel"}),
}

BATCH_TOKENS = 8192  # the scheduler's batch (vllm serve's default on an H200)

# The cases: (name, range, YALI_FUSION, YALI_FUSE_QUANT). YALI_FUSION=0 is vLLM's defaults.
#   range "flashinfer": 1 .. the most tokens vLLM's FlashInfer pass serves;
#   range "above": one past that .. the most YALI's fused op serves (or the batch).
CASES = {
    "vllm-flashinfer": ("flashinfer", "0", "0"),
    "yali-flashinfer": ("flashinfer", "1", "0"),
    "yali-quant-flashinfer": ("flashinfer", "1", "1"),
    "vllm-above": ("above", "0", "0"),
    "yali-above": ("above", "1", "0"),
}
# Which cases each world size runs. At two ranks FlashInfer serves the whole batch (64 MiB: 8192
# tokens of hidden 4096), so there is no range above it; at four it serves up to 256 tokens (2 MiB)
# and YALI's fused op up to 2048.
CASES_BY_WORLD = {2: ("vllm-flashinfer", "yali-flashinfer", "yali-quant-flashinfer"),
                  4: ("vllm-flashinfer", "yali-flashinfer", "yali-quant-flashinfer", "vllm-above", "yali-above")}


def op_names(graph) -> list[str]:
    """'namespace::name' of every vLLM, vLLM IR and vLLM CUDA op the graph calls (through
    auto_functionalized too), in graph order; aten and Python ops are left out."""
    from yali_vllm.fusion_routing import _op_name

    wrappers = {torch.ops.higher_order.auto_functionalized}
    v2 = getattr(torch.ops.higher_order, "auto_functionalized_v2", None)
    if v2 is not None:
        wrappers.add(v2)
    names = []
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        target = n.args[0] if n.target in wrappers and n.args else n.target
        name = _op_name(target)
        if name and name.split("::")[0] in ("vllm", "vllm_ir", "_C"):
            names.append(name)
    return names


def norm_quantisations(graph) -> list[str | None]:
    """Per RMSNorm of the graph, in graph order, the quantisation its output gets
    (fusion_routing.norm_output_quant: "static FP8", "dynamic FP8", or None)."""
    from yali_vllm import fusion_routing

    norms = [n for n in graph.nodes
             if n.op == "call_function" and fusion_routing._op_name(n.target) in fusion_routing._NORM_OUTPUT_INDEX]
    return [fusion_routing.norm_output_quant(n) for n in norms]


def vllm_config(model_dir: str, world_size: int):
    """The VllmConfig a worker of `vllm serve MODEL --tensor-parallel-size N` holds, for the model
    in `model_dir` (vLLM fills in the quantisation, custom ops and passes itself)."""
    from vllm.config import ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig

    return VllmConfig(
        model_config=ModelConfig(model=model_dir, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=2048),
        # "mp" named: left to pick, vLLM refuses a TP size above the visible GPUs (ranks sharing one).
        parallel_config=ParallelConfig(tensor_parallel_size=world_size, distributed_executor_backend="mp"),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=BATCH_TOKENS, max_model_len=2048,
                                         is_encoder_decoder=False),
    )


def tp_setup(rank: int, world_size: int, cfg):
    """vLLM's TP group of `world_size` ranks as a worker builds it under `cfg`, the plugin
    registered first (YALI serves the group) and its fusion pass factory installed."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.device_communicators import custom_all_reduce
    from vllm.distributed.parallel_state import get_tp_group, init_distributed_environment, initialize_model_parallel

    from yali_vllm.communicator import shared_gpu_allowed
    from yali_vllm.plugin import fusion_patch, register

    from .pair import rank_device

    if shared_gpu_allowed():
        # vLLM's custom all-reduce checks P2P with the rank as the device index (cuda:1 does not
        # exist on one GPU): it is told there is none and stays off, as on such a machine.
        custom_all_reduce._can_p2p = lambda rank, world_size: False
    register()
    with set_current_vllm_config(cfg):
        # pair.run_ranks' gloo world group becomes vLLM's; the device groups are gloo too (NCCL
        # refuses two ranks on one GPU); YALI serves the all-reduces.
        init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank_device(rank),
                                     distributed_init_method="env://", backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=world_size)
    assert fusion_patch.patch_fusion_pass(), "the plugin's fusion pass factory is not installed"
    return get_tp_group()


def compile_ranges(cfg, tp) -> dict:
    """The compile ranges of the cases, by vLLM's and YALI's own limits for `cfg`'s model: vLLM's
    FlashInfer pass serves flashinfer_max_size(N) bytes of rows (at most the batch), YALI's fused op
    its communicator's message limit (vllm_fusion.fused_max_tokens)."""
    from vllm.config.utils import Range

    from yali_vllm.vllm_fusion import fused_max_tokens

    batch = cfg.scheduler_config.max_num_batched_tokens
    row = cfg.model_config.get_hidden_size() * cfg.model_config.dtype.itemsize
    fi_bytes = cfg.compilation_config.pass_config.flashinfer_max_size(tp.world_size)
    fi_max = min(fi_bytes // row, batch) if fi_bytes else 0
    yali_max = min(fused_max_tokens(tp, cfg) or batch, batch)
    ranges = {"flashinfer": Range(start=1, end=fi_max)} if fi_max else {}
    if fi_max < yali_max:
        ranges["above"] = Range(start=fi_max + 1, end=yali_max)
    return ranges


class Stretch(torch.nn.Module):
    """The decoder stretch of the module docstring, of vLLM's layers under `cfg`'s quantisation."""

    def __init__(self, cfg):
        super().__init__()
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.model_executor.models.llama import LlamaMLP

        hidden = cfg.model_config.get_hidden_size()
        eps = cfg.model_config.hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps=eps)
        self.post_layernorm = RMSNorm(hidden, eps=eps)
        self.norm = RMSNorm(hidden, eps=eps)
        self.mlp_0 = LlamaMLP(hidden, INTERMEDIATE, "silu", quant_config=cfg.quant_config, prefix="model.layers.0.mlp")
        self.mlp_1 = LlamaMLP(hidden, INTERMEDIATE, "silu", quant_config=cfg.quant_config, prefix="model.layers.1.mlp")

    def forward(self, x):
        from vllm.distributed import tensor_model_parallel_all_reduce

        a = tensor_model_parallel_all_reduce(x)
        h = self.input_layernorm(a)
        h, r = self.post_layernorm(self.mlp_0(h), a)
        return self.norm(self.mlp_1(h), r)


def build_stretch(cfg, device: torch.device) -> Stretch:
    """The stretch on `device` with seeded weights: FP8 weights N(0, 0.5), weight scales 0.01,
    static activation scales 0.02 (the norms' outputs are about N(0, 1)), norm weights 1 + N(0, 0.1);
    then vLLM's post-loading processing, as after a checkpoint load."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.llama import LlamaForCausalLM

    if cfg.quant_config is not None:  # gate_up_proj is packed, as the model class tells its quant config
        cfg.quant_config.packed_modules_mapping.update(LlamaForCausalLM.packed_modules_mapping)
    default = torch.get_default_dtype()
    torch.set_default_dtype(cfg.model_config.dtype)
    try:
        with set_current_vllm_config(cfg), torch.device(device):
            stretch = Stretch(cfg)
    finally:
        torch.set_default_dtype(default)
    g = torch.Generator(device=device).manual_seed(SEED)  # the replicated norm weights alike on every rank
    with torch.no_grad():
        for name, p in stretch.named_parameters():
            if p.dtype == torch.float8_e4m3fn:
                p.copy_((torch.randn(p.shape, generator=g, device=device) * 0.5).to(p.dtype))
            elif "input_scale" in name:
                p.fill_(0.02)
            elif "scale" in name:
                p.fill_(0.01)
            else:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g, device=device))
    with set_current_vllm_config(cfg):
        process_weights_after_loading(stretch, cfg.model_config, device)
    return stretch


def _pass_manager(cfg, fusion: str, fuse_quant: str):
    """vLLM's PostGradPassManager configured from `cfg` with YALI_FUSION / YALI_FUSE_QUANT set as
    given (read when the passes are built)."""
    from vllm.compilation.passes.pass_manager import PostGradPassManager

    with mock.patch.dict(os.environ, YALI_FUSION=fusion, YALI_FUSE_QUANT=fuse_quant):
        pm = PostGradPassManager()
        pm.configure(cfg)
    return pm


def _fusion_passes(pm) -> tuple:
    """(YALI's pass or None, vLLM's FlashInfer pass or None) among `pm`'s passes."""
    from yali_vllm.vllm_fusion import YaliAllReduceFusionPass

    yali = next((p for p in pm.passes if isinstance(p, YaliAllReduceFusionPass)), None)
    if yali is not None:
        return yali, yali.flashinfer
    vllm_pass = next((p for p in pm.passes if type(p).__name__ == "AllReduceFusionPass"), None)
    return None, vllm_pass


def _compile(cfg, stretch, pm, compile_range, seen: dict):
    """torch.compile of `stretch` through Inductor configured as vLLM's backend configures it for
    `compile_range` (vLLM's Inductor settings, its pre-grad pass that makes vLLM IR's in-place ops
    functional, `pm` as the post-grad custom pass, in vLLM's pass context); `seen` gets the ops
    before and after `pm`."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.custom_graph_pass import CustomGraphPass
    from vllm.compilation.compiler_interface import set_inductor_config
    from vllm.compilation.passes.inductor_pass import pass_context
    from vllm.compilation.passes.ir.inplace_functionalization import VllmIRInplaceFunctionalizationPass

    class Recorded(CustomGraphPass):
        def __call__(self, graph):
            seen["before"] = op_names(graph)
            seen["norm_quant"] = norm_quantisations(graph)
            pm(graph)
            seen["after"] = op_names(graph)

        def uuid(self):
            return pm.uuid()

    patches = dict(cfg.compilation_config.inductor_compile_config)
    patches.update(pre_grad_custom_pass=VllmIRInplaceFunctionalizationPass(cfg), post_grad_custom_post_pass=Recorded(),
                   force_disable_caches=True, compile_threads=1)
    set_inductor_config(patches, compile_range)

    def backend(gm, example_inputs):
        with pass_context(compile_range):
            return compile_fx(gm, example_inputs, config_patches=patches)

    torch._dynamo.reset()
    return torch.compile(stretch, backend=backend, fullgraph=True, dynamic=False)


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def run_case(cfg, tp, stretch, fusion: str, fuse_quant: str, compile_range, x: torch.Tensor, ref) -> dict:
    """One case: the passes built with YALI_FUSION=`fusion`, YALI_FUSE_QUANT=`fuse_quant`, the
    stretch compiled under `compile_range` and run on `x`; `ref` is the eager stretch's output."""
    from vllm.config import set_current_vllm_config

    res: dict = {"range": [compile_range.start, compile_range.end]}
    try:
        with set_current_vllm_config(cfg):
            pm = _pass_manager(cfg, fusion, fuse_quant)
            yali, flashinfer = _fusion_passes(pm)
            res["passes"] = [type(p).__name__ for p in pm.passes]
            res["flashinfer_max_tokens"] = getattr(flashinfer, "max_token_num", None)
            res["flashinfer_quant"] = getattr(flashinfer, "supports_quant_fusion", None)
            res["yali_max_tokens"] = getattr(yali, "max_token_num", None) if yali else None
            seen: dict = {}
            compiled = _compile(cfg, stretch, pm, compile_range, seen)
            comm = tp.device_communicator.yali_comm
            calls0 = (comm.device_calls(), comm.device_fused_calls()) if comm else (0, 0)
            with torch.no_grad():
                h, res_out = compiled(x.clone())
            torch.cuda.synchronize()
            calls1 = (comm.device_calls(), comm.device_fused_calls()) if comm else (0, 0)
        res.update(before=seen.get("before"), after=seen.get("after"), norm_quant=seen.get("norm_quant"),
                   routes=dict(yali.route_counts) if yali else None,
                   quant_matched=getattr(yali, "quant_matched_count", None) if yali else None,
                   yali_calls=calls1[0] - calls0[0], yali_fused_calls=calls1[1] - calls0[1],
                   err_norm=_rel_err(h, ref[0]), err_residual=_rel_err(res_out, ref[1]),
                   finite=bool(torch.isfinite(h.float()).all() and torch.isfinite(res_out.float()).all()),
                   digest=[digest(h), digest(res_out)])
    except Exception as e:  # recorded: the other cases still run
        res["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-4000:]}"
    return res


def fp8_passes_rank(rank: int, group, world_size: int, scheme: str, workdir: str) -> dict:
    """The cases of CASES_BY_WORLD[world_size] for `scheme` (of SCHEMES), in one rank of a TP group."""
    from vllm.config import set_current_vllm_config

    from yali_vllm.models import write_model_dir

    quant, env = SCHEMES[scheme]
    os.environ.update(VLLM_DISABLE_PYNCCL="1", VLLM_ALLREDUCE_USE_SYMM_MEM="0", VLLM_ALLREDUCE_USE_FLASHINFER="0", **env)
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logging.getLogger("vllm").addHandler(Keep())  # vllm.yali's lines propagate to it
    logging.getLogger("vllm.yali").setLevel(logging.INFO)
    out: dict = {"rank": rank, "scheme": scheme}
    try:
        model = write_model_dir(os.path.join(workdir, f"{scheme}-rank{rank}"), "8b", quant=quant)
        cfg = vllm_config(str(model), world_size)
        tp = tp_setup(rank, world_size, cfg)
        out["yali"] = tp.device_communicator.yali_comm is not None
        cc = cfg.compilation_config
        out["config"] = {"quantization": cfg.model_config.quantization, "custom_ops": list(cc.custom_ops),
                         "fuse_allreduce_rms": cc.pass_config.fuse_allreduce_rms,
                         "fuse_norm_quant": cc.pass_config.fuse_norm_quant, "mode": str(cc.mode)}
        ranges = compile_ranges(cfg, tp)
        out["ranges"] = {k: [r.start, r.end] for k, r in ranges.items()}
        device = torch.device("cuda", torch.cuda.current_device())
        stretch = build_stretch(cfg, device)
        g = torch.Generator(device=device).manual_seed(SEED * 7 + rank)
        x = torch.randn(TOKENS, cfg.model_config.get_hidden_size(), generator=g, device=device).to(torch.bfloat16)
        with set_current_vllm_config(cfg), torch.no_grad():
            ref = stretch(x.clone())
        torch.cuda.synchronize()
        out["eager_digest"] = [digest(ref[0]), digest(ref[1])]
        out["cases"] = {}
        for name in CASES_BY_WORLD[world_size]:
            where, fusion, fuse_quant = CASES[name]
            if where not in ranges:
                out["cases"][name] = {"error": f"no {where!r} range here: {out['ranges']}"}
                continue
            out["cases"][name] = run_case(cfg, tp, stretch, fusion, fuse_quant, ranges[where], x, ref)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-4000:]}"
    out["log"] = [ln for ln in lines if "YALI" in ln or "lashinfer" in ln][-60:]
    return out
