#!/usr/bin/env python3
"""Where a decode step's time goes, per configuration: vLLM's torch profiler
around one streamed request on the embedded dummy model, then the GPU kernels
of the trace grouped by class (YALI, FlashInfer all-reduce fusion, vLLM custom
all-reduce, NCCL, GEMM, attention, other) with their time and the idle gap
before and after each kernel on its stream.

Why: the 70B serving run (lab/results/archive/serving/20261122-70b-first) shows the
yali server about 1 ms per token slower than vllm-default although the fused
microbenchmark puts the two fused kernels within 0.1 us of each other; the gaps
around the fused kernels inside the model are what this measures.

  python -m lab.decode_profile --model-size 70b --out /tmp/prof   # on the GPU host
  python -m lab.decode_profile --report-only DIR/traces --out DIR  # analyse traces again

Writes decode-profile.json (kind decode-profile: one row per config x rank x
kernel class) and decode-profile.md under --out; the traces stay in --out/traces.
Every server start and request is bounded (serving_bench's helpers).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.common.cli_args import parse_csv_list
from benchmarks.common.results import default_out
from benchmarks.serving.budget import Deadline, Progress
from benchmarks.serving.commands import pick_port
from benchmarks.serving.configs import SERVER_CONFIGS, add_variants
from benchmarks.serving.model import default_model_dir, prepare_model
from benchmarks.serving.profile_analysis import merge, profile_doc, write_doc
from benchmarks.serving.profiler import profile_request, profiler_config
from benchmarks.serving.server import running_server, server_command_for, server_env, warmup_server
from benchmarks.serving.server_options import add_server_args

def profile_config(args, cfg: str, model_dir: Path, out: Path, deadline: "Deadline", say) -> None:
    trace_dir = (out / "traces" / cfg).resolve()
    trace_dir.mkdir(parents=True, exist_ok=True)
    port = pick_port(args.port)
    cmd = server_command_for(args, model_dir, cfg, port) + ["--profiler-config", json.dumps(profiler_config(trace_dir))]
    env = server_env(SERVER_CONFIGS[cfg])
    if args.dry_run:
        print("$ " + " ".join(cmd))
        return
    say(f"{cfg}: starting server on port {port}")
    with running_server(cmd, env, out / "server-logs" / f"{cfg}.log", port, cfg,
                           startup_timeout_s=deadline.clip(args.startup_timeout_s, 60)) as srv:
        say(f"{cfg}: healthy; warm-up")
        warmup_server(srv.base_url, str(model_dir), args.warmup_requests)
        dur = profile_request(srv.base_url, str(model_dir), args.tokens, deadline, 20.0)
        say(f"{cfg}: profiled a {args.tokens}-token request ({dur:.1f}s with the trace)")
    say(f"{cfg}: server stopped; traces: {len(list(trace_dir.rglob('*.json*')))} files")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_args(ap)
    ap.add_argument("--configs", default="yali,vllm-default")
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated in the profiled request")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--report-only", type=Path, default=None, metavar="TRACES_DIR",
                    help="analyse TRACES_DIR/<config>/... again, run nothing")
    ap.add_argument("--merge", type=Path, nargs="+", default=None, metavar="PROFILE.json",
                    help="merge the records of several decode-profile.json files (e.g. one per run) into "
                         "--out/decode-profile.json/.md, run nothing")
    args = ap.parse_args()
    if args.merge:
        if args.out is None:
            ap.error("--merge needs --out")
        return merge(args.merge, args.out)
    out = args.out or default_out("decode-profile")
    out.mkdir(parents=True, exist_ok=True)
    trace_root = args.report_only or out / "traces"
    if args.report_only is None:
        configs = parse_csv_list(args.configs)
        add_variants(configs)  # every name refused or resolved before any work
        deadline = Deadline(args.budget_s)
        say = Progress("decode-profile", deadline)
        model_dir = prepare_model(args.model_size, args.model_dir or default_model_dir(args.model_size, args.quant),
                                  args.quant)
        for cfg in configs:
            try:
                profile_config(args, cfg, model_dir, out, deadline, say)
            except Exception as e:  # keep the other configuration's profile
                say(f"{cfg}: FAILED: {type(e).__name__}: {e}")
        if args.dry_run:
            return 0
    doc = profile_doc(trace_root, args.tokens, {"model_size": args.model_size})
    print(write_doc(out, doc))
    return 0 if doc["records"] else 1


if __name__ == "__main__":
    sys.exit(main())
