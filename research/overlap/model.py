"""The overlap model: a decode or prefill step's time now and with the TP all-reduce overlapped
with compute, per model shape, TP size, phase and token count (CPU only).

Inputs: the one-GPU measurement of `measure_compute.py` (kind overlap-compute) and the committed
two- and four-rank fused-op and all-reduce results (`inputs.py` names each file; H200 except the
four-rank fused op at 1-2 tokens, H100 scaled to H200; sizes between two measured ones are
interpolated as a power law between the two).

A step now: layers x (compute + 2 fused calls) + the embedding's all-reduce + RMSNorm (a fused call
too: 2 x layers + 1 calls a step) + the embedding lookup + the lm_head GEMM of the sampled rows +
the logits' gather (taken as an all-reduce of rows x vocab bf16). Per layer compute is qkv, rope,
attention, o_proj, gate_up, SiLU-and-mul and down (the norms are inside the fused calls). Not in the
model: sampling, the scheduler and the host's step preparation (the error against the serving
runs' step times shows them).

Candidates:
  split  the batch's tokens in two halves, one half's fused call under the other half's compute
         (a compile pass splitting the token dimension; 2 tokens and more). Each half's compute is
         measured at half the tokens (prefill attention: half of the whole step's, as the two
         halves of a prompt together do its causal attention); a block that starts while an
         all-reduce runs is slowed by the first GEMM's measured slowdown under the stand-in, in
         proportion to the overlap. In eager prefill steps each compute block pays SPLIT_HOST_US
         on the host (stream events); decode steps run in CUDA graphs.
  dbo    vLLM's two micro-batches with the TP all-reduce as a yield point: the same arithmetic,
         only above vLLM's thresholds (decode > 32 tokens, prefill > 512: dbo_decode_token_threshold,
         dbo_prefill_token_threshold), and in eager steps each block costs at least DBO_YIELD_US
         (the host's switch between the two micro-batch threads).
  flux   a row-parallel GEMM whose epilogue pushes its output tiles to the peers (o_proj, down):
         per layer the compute plus, for each of the two GEMMs, its measured slowdown under the
         stand-in plus the tail: the 2 KiB all-reduce's time (launch, one trip, the flags: what no
         push hides) + the rest of the fused call's time over the GEMM's waves of 128x128 tiles on
         132 SMs (the last wave's share is pushed after the GEMM).

Decision (`docs`: issue thresholds): 70B at TP=2 or 4 predicted at >= 1.10x concurrency-32 tokens/s
or <= 0.93x concurrency-1 TPOT. Concurrency 32 is taken as the serving runs' workload (1024 in /
128 out): per request one 1024-token prefill in steps of 8192 tokens and 127 decode steps of 32.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from research.overlap import inputs as I  # noqa: E402

KIND = "overlap-model"
ATTN_BLOCK = ("qkv", "rope", "attn", "o_proj")
MLP_BLOCK = ("gate_up", "act", "down")
CANDIDATES = ("split", "dbo", "flux")
SMS = 132  # H200
TILE = 128
SPLIT_HOST_US = 5.0  # assumed, not measured: an event record + wait per block in an eager step
DBO_YIELD_US = 15.0  # assumed, not measured: a Python thread hand-off per yield
DBO_THRESHOLDS = {"decode": 32, "prefill": 512}
GRAPH_MAX_TOKENS = 512  # vLLM 0.33's largest CUDA-graph size: decode steps of the model run in graphs
C32 = {"prefill_tokens": 8192, "decode_tokens": 32, "prompt": 1024, "output": 128}
THRESHOLDS = {"c32_tokps": 1.10, "c1_tpot": 0.93}
# The serving runs' step bucket of the concurrency runs' largest steps (checked against 8192 tokens).
LARGE_BUCKET = "4097-8192"
# The committed serving runs the no-overlap prediction is checked against (YALI's starts).
SERVING = {
    ("8b", 2): ("current/serving/20261128-8b-tp2-h200-alternated", ["run-a2", "run-b2"]),
    ("70b", 4): ("current/serving/20261128-70b-tp4-h200-alternated", ["run-a", "run-c"]),
}


class Measured:
    """The one-GPU measurement (kind overlap-compute), by (shape, tp, phase, tokens, op)."""

    def __init__(self, doc: dict):
        if doc.get("kind") != "overlap-compute":
            raise ValueError(f"expected a kind overlap-compute measurement, got kind {doc.get('kind')!r}")
        self.doc = doc
        self.shapes = {n: I.Shape(**s) for n, s in doc["shapes"].items()}
        self.rows = {(r["model_shape"], r["tp"], r["phase"], r["tokens"], r["op"]): r for r in doc["records"]}

    def row(self, shape: str, tp: int, phase: str, tokens: int, op: str) -> dict:
        key = (shape, tp, phase, tokens, op)
        if key not in self.rows:
            raise KeyError(f"measurement has no row for shape={shape} tp={tp} {phase} tokens={tokens} op={op}")
        return self.rows[key]

    def us(self, shape, tp, phase, tokens, op) -> float:
        return float(self.row(shape, tp, phase, tokens, op)["us_p50"])

    def slowdown(self, shape, tp, phase, tokens, gemm) -> float:
        """us the GEMM gains while the stand-in of this token count's all-reduce runs (>= 0)."""
        r = self.row(shape, tp, phase, tokens, gemm)
        return max(0.0, float(r["contended_us_p50"]) - float(r["alone_gated_us"]))

    def configs(self):
        return sorted({k[:4] for k in self.rows}, key=lambda k: (k[0], k[1], k[2] != "decode", k[3]))


class Model:
    def __init__(self, meas: Measured, results_dir: str = I.RESULTS):
        self.m = meas
        self.results_dir = results_dir
        self._comm: dict[int, I.CommTimes] = {}

    def comm(self, tp: int) -> I.CommTimes:
        if tp not in self._comm:
            self._comm[tp] = I.CommTimes(tp, self.results_dir)
        return self._comm[tp]

    def fused(self, shape: str, tp: int, phase: str, tokens: int) -> tuple[float, str]:
        norm = self.m.us(shape, tp, phase, tokens, "norm")
        return self.comm(tp).fused_us(self.m.shapes[shape].hidden, tokens, norm, I.yali_serves(tp))

    def blocks(self, shape, tp, phase, tokens, attn_us=None) -> tuple[float, float]:
        """(attention block, MLP block) compute of one layer at `tokens`."""
        us = lambda op: self.m.us(shape, tp, phase, tokens, op)  # noqa: E731
        c1 = sum(us(o) for o in ATTN_BLOCK if o != "attn") + (us("attn") if attn_us is None else attn_us)
        return c1, sum(us(o) for o in MLP_BLOCK)

    def extra(self, shape, tp, phase, tokens) -> float:
        """What a step has besides its layers: the embedding's fused call and lookup, the lm_head
        GEMM and the logits' gather."""
        s = self.m.shapes[shape]
        rows = tokens if phase == "decode" else I.prefill_prompts(tokens)[0]
        logits = rows * s.vocab * 2
        serves = I.yali_serves(tp)(logits)
        gather = self.comm(tp).allreduce_us(max(logits, min(self.comm(tp).allreduce["yali"])),
                                            "yali" if serves else "nccl")
        return (self.fused(shape, tp, phase, tokens)[0] + self.m.us(shape, tp, phase, tokens, "embed")
                + self.m.us(shape, tp, phase, tokens, "lm_head") + gather)

    def now(self, shape, tp, phase, tokens) -> dict:
        c1, c2 = self.blocks(shape, tp, phase, tokens)
        f, src = self.fused(shape, tp, phase, tokens)
        layers = self.m.shapes[shape].layers
        step = layers * (c1 + c2 + 2 * f) + self.extra(shape, tp, phase, tokens)
        return {"compute_us": c1 + c2, "allreduce_us": f, "allreduce_source": src, "step_us_now": step}

    def split(self, shape, tp, phase, tokens, host_us: float) -> dict:
        """Two halves, each half's fused call under the other half's compute."""
        h = I.half(tokens)
        attn = self.m.us(shape, tp, phase, tokens, "attn") / 2 if phase == "prefill" else None
        c1, c2 = self.blocks(shape, tp, phase, h, attn)
        a, _ = self.fused(shape, tp, phase, h)
        d1 = self.m.slowdown(shape, tp, phase, h, ATTN_BLOCK[0])
        d2 = self.m.slowdown(shape, tp, phase, h, MLP_BLOCK[0])
        layers_us = pipeline_us(self.m.shapes[shape].layers, c1, c2, a, d1, d2, host_us)
        full = self.now(shape, tp, phase, tokens)
        step = layers_us + self.extra(shape, tp, phase, tokens)
        per_layer_extra = layers_us / self.m.shapes[shape].layers - full["compute_us"]
        return {"step_us_overlap": step, "overlap_cost_us": 2 * (c1 + c2) - full["compute_us"],
                "exposed_per_layer_us": per_layer_extra}

    def flux(self, shape, tp, phase, tokens) -> dict:
        s = self.m.shapes[shape]
        full = self.now(shape, tp, phase, tokens)
        f = full["allreduce_us"]
        floor = min(self.comm(tp).ar_floor_us(), f)
        waves = math.ceil(math.ceil(tokens / TILE) * math.ceil(s.hidden / TILE) / SMS)
        tail = floor + (f - floor) / waves
        cost = self.m.slowdown(shape, tp, phase, tokens, "o_proj") + self.m.slowdown(shape, tp, phase, tokens, "down")
        step = s.layers * (full["compute_us"] + cost + 2 * tail) + self.extra(shape, tp, phase, tokens)
        return {"step_us_overlap": step, "overlap_cost_us": cost, "tail_us": tail, "waves": waves}

    def candidate(self, name, shape, tp, phase, tokens) -> dict:
        """The candidate's step, or the step now where the candidate does not apply (`applies`)."""
        eager = phase == "prefill" and tokens > GRAPH_MAX_TOKENS
        if name == "split":
            if tokens < 2:
                return {"applies": False, "why": "one token: nothing to split"}
            return {"applies": True, **self.split(shape, tp, phase, tokens, SPLIT_HOST_US if eager else 0.0)}
        if name == "dbo":
            if tokens <= DBO_THRESHOLDS[phase]:
                return {"applies": False, "why": f"at most vLLM's {phase} threshold ({DBO_THRESHOLDS[phase]} tokens)"}
            return {"applies": True, **self.split(shape, tp, phase, tokens, DBO_YIELD_US if eager else 0.0)}
        if name == "flux":
            return {"applies": True, **self.flux(shape, tp, phase, tokens)}
        raise ValueError(f"unknown candidate {name!r} (have {', '.join(CANDIDATES)})")

    def rows(self) -> list[dict]:
        out = []
        for shape, tp, phase, tokens in self.m.configs():
            now = self.now(shape, tp, phase, tokens)
            for cand in CANDIDATES:
                try:
                    c = self.candidate(cand, shape, tp, phase, tokens)
                except KeyError as e:  # a half not measured: the largest counts' halves always are
                    c = {"applies": False, "why": str(e)}
                step = c.get("step_us_overlap", now["step_us_now"])
                out.append({"model_shape": shape, "tp": tp, "tokens": tokens, "phase": phase, "candidate": cand,
                            "compute_us": round(now["compute_us"], 3), "allreduce_us": round(now["allreduce_us"], 3),
                            "allreduce_source": now["allreduce_source"],
                            "overlap_cost_us": round(c.get("overlap_cost_us", 0.0), 3),
                            "step_us_now": round(now["step_us_now"], 3), "step_us_overlap": round(step, 3),
                            "predicted_speedup": round(now["step_us_now"] / step, 4),
                            "applies": c["applies"], **({"why": c["why"]} if "why" in c else {}),
                            **{k: round(v, 3) for k, v in c.items() if k in ("tail_us", "exposed_per_layer_us")}})
        return out


def pipeline_us(layers: int, c1: float, c2: float, a: float, d1: float, d2: float, host_us: float = 0.0) -> float:
    """Time of `layers` layers run as two halves: compute blocks in the order (A attn, B attn,
    A mlp, B mlp) per layer, each after its own half's previous all-reduce; one all-reduce at a
    time, each of `a` us, starting when its block ends. A block that runs while an all-reduce does
    takes its first GEMM's slowdown (d1 attention block, d2 MLP block) times the share of the
    all-reduce it overlaps; a block takes at least `host_us` (the host issuing it)."""
    t_comp = t_comm = 0.0
    ready = [0.0, 0.0]
    last = (0.0, 0.0)
    for _ in range(layers):
        for base, d in ((c1, d1), (c2, d2)):
            for hh in (0, 1):
                start = max(t_comp, ready[hh])
                dur = max(base, host_us)
                overlap = max(0.0, min(last[1], start + dur) - max(last[0], start))
                if a > 0:
                    dur += d * min(1.0, overlap / a)
                t_comp = start + dur
                ar_start = max(t_comp, t_comm)
                t_comm = ar_start + a
                last = (ar_start, t_comm)
                ready[hh] = t_comm
    return max(t_comp, t_comm)


def used(row: dict) -> float:
    """The step a server with the candidate runs: the candidate only where it predicts a gain
    (a split pass, micro-batching or the GEMM's epilogue is chosen per compile range, as the
    fusion passes are), else the step now."""
    return min(row["step_us_now"], row["step_us_overlap"])


def decision(rows: list[dict]) -> list[dict]:
    """Per (shape, tp, candidate): the concurrency-1 TPOT ratio (decode, 1 token) and the
    concurrency-32 tokens/s ratio (C32), against the issue's thresholds; each step with the
    candidate where it predicts a gain (`used`)."""
    by = {(r["model_shape"], r["tp"], r["phase"], r["tokens"], r["candidate"]): r for r in rows}
    out = []
    for shape, tp, cand in sorted({(r["model_shape"], r["tp"], r["candidate"]) for r in rows}):
        d1 = by.get((shape, tp, "decode", 1, cand))
        p = by.get((shape, tp, "prefill", C32["prefill_tokens"], cand))
        d32 = by.get((shape, tp, "decode", C32["decode_tokens"], cand))
        res = {"model_shape": shape, "tp": tp, "candidate": cand, "c1_tpot_ratio": None, "c32_tokps_ratio": None}
        if d1:
            res["c1_tpot_ratio"] = round(used(d1) / d1["step_us_now"], 4)
        if p and d32:
            per_prompt = C32["prefill_tokens"] / C32["prompt"]
            decode_steps = (C32["output"] - 1) / C32["decode_tokens"]
            now = p["step_us_now"] / per_prompt + decode_steps * d32["step_us_now"]
            new = used(p) / per_prompt + decode_steps * used(d32)
            res["c32_tokps_ratio"] = round(now / new, 4)
        res["meets"] = bool((res["c32_tokps_ratio"] or 0) >= THRESHOLDS["c32_tokps"]
                            or (res["c1_tpot_ratio"] or 9) <= THRESHOLDS["c1_tpot"])
        out.append(res)
    return out


def serving_reference(shape: str, tp: int, results_dir: str = I.RESULTS) -> dict | None:
    """YALI's measured c=1 TPOT p50, decode step (1-8 tokens) p50 and lone 1024-token prefill step
    p50 (ms) of the committed serving run of this shape and TP, with the files read."""
    if (shape, tp) not in SERVING:
        return None
    run, starts = SERVING[(shape, tp)]
    bench = I.load_json(f"{run}/serving-benchmark.json", results_dir)
    tpot = [r["tpot_ms_p50"] for r in bench["records"] if r["config"] == "yali" and r["concurrency"] == 1]
    decode, prefill, large, files = [], [], [], [f"{run}/serving-benchmark.json"]
    for s in starts:
        st = I.load_json(f"{run}/{s}/step-times.json", results_dir)
        files.append(f"{run}/{s}/step-times.json")
        decode += [r["elapsed_ms_p50"] for r in st["records"] if r["config"] == "yali" and r["tokens"] == "1-8"]
        large += [(r["elapsed_ms_p50"], r["mean_tokens"]) for r in st["records"]
                  if r["config"] == "yali" and r["tokens"] == LARGE_BUCKET]
        prefill += [r["elapsed_ms_p50"] for r in st.get("lone_prefill_steps", [])
                    if r["config"] == "yali" and r["tokens"] == "513-1152"]
    if not (tpot and decode and prefill):
        raise ValueError(f"{run}: no YALI c=1 TPOT, 1-8 token step or lone 513-1152 token prefill step")
    ref = {"files": files, "tpot_ms_p50": statistics.mean(tpot), "decode_step_ms_p50": statistics.mean(decode),
           "prefill_1024_step_ms_p50": statistics.mean(prefill)}
    if large:  # the concurrency runs' largest steps (mostly prefill): p50 and their mean tokens
        ref["large_step_ms_p50"] = statistics.mean(ms for ms, _ in large)
        ref["large_step_tokens"] = statistics.mean(t for _, t in large)
    return ref


def check_against_serving(model: Model, results_dir: str = I.RESULTS) -> list[dict]:
    out = []
    for (shape, tp) in SERVING:
        if shape not in model.m.shapes or not any(k[:2] == (shape, tp) for k in model.m.rows):
            continue
        ref = serving_reference(shape, tp, results_dir)
        d = model.now(shape, tp, "decode", 1)["step_us_now"] / 1e3
        row = {"model_shape": shape, "tp": tp, "files": ref["files"], "predicted_decode_ms": round(d, 3),
               "measured_decode_step_ms": round(ref["decode_step_ms_p50"], 3), "measured_tpot_ms": round(ref["tpot_ms_p50"], 3),
               "decode_error_vs_step": round(d / ref["decode_step_ms_p50"] - 1, 4),
               "decode_error_vs_tpot": round(d / ref["tpot_ms_p50"] - 1, 4)}
        if (shape, tp, "prefill", 1024, "norm") in model.m.rows:
            p = model.now(shape, tp, "prefill", 1024)["step_us_now"] / 1e3
            row.update(predicted_prefill_1024_ms=round(p, 3), measured_prefill_1024_ms=round(ref["prefill_1024_step_ms_p50"], 3),
                       prefill_error=round(p / ref["prefill_1024_step_ms_p50"] - 1, 4))
        if "large_step_ms_p50" in ref and (shape, tp, "prefill", C32["prefill_tokens"], "norm") in model.m.rows:
            # the 8192-token prediction scaled to the bucket's mean tokens (time ~ tokens at this size)
            p = (model.now(shape, tp, "prefill", C32["prefill_tokens"])["step_us_now"] / 1e3
                 * ref["large_step_tokens"] / C32["prefill_tokens"])
            row.update(large_step_tokens=round(ref["large_step_tokens"], 1), predicted_large_step_ms=round(p, 3),
                       measured_large_step_ms=round(ref["large_step_ms_p50"], 3),
                       large_step_error=round(p / ref["large_step_ms_p50"] - 1, 4))
        out.append(row)
    return out


def markdown(doc: dict) -> str:
    lines = ["# Overlap model: predicted step times", "",
             f"Measurement: `{doc['inputs']['measurement']}` ({doc['host']}); committed results: "
             + ", ".join(f"`{f}`" for f in doc["inputs"]["comm_files"]) + ".", "",
             "Sizes between two measured ones: a power law between the two. Above the fused op's measured sizes: "
             "the all-reduce of the backend serving that size plus the measured add + RMSNorm.", "",
             "| shape | TP | phase | tokens | compute/layer us | fused call us | step now ms | split | dbo | flux |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    by = {}
    for r in doc["records"]:
        by.setdefault((r["model_shape"], r["tp"], r["phase"], r["tokens"]), {})[r["candidate"]] = r
    for (shape, tp, phase, tokens), c in by.items():
        r0 = next(iter(c.values()))
        cells = [f"{c[k]['predicted_speedup']:.3f}" if c[k]["applies"] else "–" for k in CANDIDATES if k in c]
        lines.append(f"| {shape} | {tp} | {phase} | {tokens} | {r0['compute_us']:.1f} | {r0['allreduce_us']:.2f} | "
                     f"{r0['step_us_now'] / 1e3:.3f} | " + " | ".join(cells) + " |")
    lines += ["", "Speedup = step now / step with the candidate (– : does not apply).", "",
              "## Decision metrics (thresholds: c=32 tokens/s >= 1.10x or c=1 TPOT <= 0.93x, 70B at TP=2 or 4)", "",
              "| shape | TP | candidate | c=1 TPOT ratio | c=32 tokens/s ratio | meets |", "| --- | ---: | --- | ---: | ---: | --- |"]
    for d in doc["decision"]:
        lines.append(f"| {d['model_shape']} | {d['tp']} | {d['candidate']} | {d['c1_tpot_ratio']} | "
                     f"{d['c32_tokps_ratio']} | {'yes' if d['meets'] else 'no'} |")
    lines += ["", "## The no-overlap prediction against the serving runs", ""]
    for v in doc["validation"]:
        lines.append(f"- {v['model_shape']} TP={v['tp']} ({', '.join('`' + f + '`' for f in v['files'])}): decode "
                     f"{v['predicted_decode_ms']} ms predicted against a {v['measured_decode_step_ms']} ms step "
                     f"({v['decode_error_vs_step']:+.1%}) and {v['measured_tpot_ms']} ms TPOT ({v['decode_error_vs_tpot']:+.1%})"
                     + (f"; 1024-token prefill {v['predicted_prefill_1024_ms']} against {v['measured_prefill_1024_ms']} ms "
                        f"({v['prefill_error']:+.1%})" if "prefill_error" in v else "")
                     + (f"; {v['large_step_tokens']}-token steps ({LARGE_BUCKET} bucket, the 8192-token "
                        f"prediction scaled) {v['predicted_large_step_ms']} against {v['measured_large_step_ms']} ms "
                        f"({v['large_step_error']:+.1%})" if "large_step_error" in v else ""))
    lines += ["", "## Assumptions", ""] + [f"- {a}" for a in doc["assumptions"]]
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["model_shape"], r["tp"]) for r in doc["records"]})
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for ax, (shape, tp) in zip(axes[0], keys):
        for cand, color in zip(CANDIDATES, ("C0", "C1", "C2")):
            for phase, mark in (("decode", "o-"), ("prefill", "s--")):
                rs = sorted((r for r in doc["records"] if (r["model_shape"], r["tp"], r["candidate"], r["phase"])
                             == (shape, tp, cand, phase) and r["applies"]), key=lambda r: r["tokens"])
                if rs:
                    ax.plot([r["tokens"] for r in rs], [r["predicted_speedup"] for r in rs], mark, color=color,
                            label=f"{cand} {phase}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.axhline(THRESHOLDS["c32_tokps"], color="red", lw=0.6, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{shape} TP={tp}")
        ax.set_xlabel("tokens in the step")
        ax.set_ylabel("predicted step speedup")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


ASSUMPTIONS = [
    "per layer: qkv, rope, attention, o_proj, gate_up, SiLU-and-mul, down; the norms inside the fused calls",
    "a step: layers x (compute + 2 fused calls) + 1 fused call (embedding) + embedding lookup + lm_head of the "
    "sampled rows + the logits' gather as an all-reduce of rows x vocab bf16; sampling, the scheduler and "
    "the host's step preparation are left out",
    "four-rank fused op at hidden 4096 (8B, TP=4): the hidden-8192 timing at the same bytes; at 1-2 tokens the "
    "4xH100 timing scaled to H200; below every measured size the smallest measured call (an upper bound)",
    "sizes YALI does not serve (above 16 MiB at TP=4) run NCCL's all-reduce + the measured add + RMSNorm; its stand-in "
    f"holds {I.NCCL_CTAS} CTAs (assumed)",
    f"split: eager prefill blocks cost at least {SPLIT_HOST_US} us of host time each (assumed); decode in CUDA graphs",
    f"dbo: vLLM's thresholds (decode > {DBO_THRESHOLDS['decode']}, prefill > {DBO_THRESHOLDS['prefill']} tokens); "
    f"eager blocks at least {DBO_YIELD_US} us each (assumed thread hand-off); needs the TP all-reduce made a yield point",
    f"flux: tail = the 2 KiB all-reduce + (fused call - it) / waves of {TILE}x{TILE} tiles on {SMS} SMs; "
    "slowdown of o_proj and down under the stand-in of the whole call",
    "the stand-in leaves out the NVLink traffic (peers' stores into this GPU's memory, the fabric), the wait for the "
    "slowest rank and a sending GPU's clocks",
    "concurrency 32: per request one 1024-token prefill in 8192-token steps and 127 decode steps of 32 tokens; "
    "the decision metrics take a candidate only for the steps where it predicts a gain",
]


def build(compute_path: str, results_dir: str = I.RESULTS) -> dict:
    with open(compute_path) as f:
        meas = Measured(json.load(f))
    model = Model(meas, results_dir)
    rows = model.rows()
    tps = sorted({r["tp"] for r in rows})
    comm_files = sorted({f for tp in tps for f in model.comm(tp).files})
    from benchmarks.common.results import now_iso

    m = meas.doc
    return {"kind": KIND, "date": now_iso(), "command": " ".join(sys.argv), "host": m["host"],
            "versions": m["versions"], "gpus": m.get("gpus", []), "world_size": 1, "shared_gpu": False,
            **({"cpu_only": True} if m.get("cpu_only") else {}),
            "inputs": {"measurement": compute_path, "measurement_date": m["date"], "comm_files": comm_files,
                       "serving_files": [f for (s, tp), (run, st) in SERVING.items() for f in
                                         [f"{run}/serving-benchmark.json"] + [f"{run}/{x}/step-times.json" for x in st]]},
            "assumptions": ASSUMPTIONS, "records": rows, "decision": decision(rows),
            "validation": check_against_serving(model, results_dir)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compute", required=True, help="measure_compute.py's JSON (kind overlap-compute)")
    p.add_argument("--out", required=True, help="directory for overlap-model.json, .md and .png")
    p.add_argument("--results-dir", default=I.RESULTS, help="the committed results (lab/results)")
    a = p.parse_args(argv)
    doc = build(a.compute, a.results_dir)
    from benchmarks.common.results import write_results

    os.makedirs(a.out, exist_ok=True)
    path = write_results(os.path.join(a.out, "overlap-model.json"), doc)
    md = markdown(doc)
    with open(os.path.join(a.out, "overlap-model.md"), "w") as f:
        f.write(md)
    plot(doc, os.path.join(a.out, "overlap-model.png"))
    print(md)
    print(f"wrote {path} (+ .md, .png)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
