#!/usr/bin/env python3
"""The main job: write the embedded Llama-shaped dummy model (no download), serve
it with `vllm serve --tensor-parallel-size 2` and the YALI plugin, send one real
completion request, print the answer and the YALI lines of the server log, stop
the server.

Without 2 GPUs (or without vLLM) it says so and exits 0 after writing the model.
  python -m examples.serve_demo [--size 8b|70b] [--dir DIR [--force]]

The model goes to a directory of this user's own (<temp dir>/yali-model-<uid>), rewritten on
every run; another --dir that is not empty (and holds no copy of the same model) needs --force.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks.common.cli_args import positive_float
from benchmarks.serving.commands import pick_port
from benchmarks.serving.configs import SERVER_CONFIGS
from benchmarks.serving.http import http_post_json
from benchmarks.serving.server import running_server, server_command, server_env

DEFAULT_DIR = os.path.join(tempfile.gettempdir(), f"yali-model-{os.getuid()}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="8b", choices=["8b", "70b"])
    ap.add_argument("--dir", default=DEFAULT_DIR, help="model directory (default %(default)s)")
    ap.add_argument("--force", action="store_true",
                    help="write the model into a --dir that is not empty (config.json and tekken.json are replaced)")
    ap.add_argument("--startup-timeout", type=positive_float, default=900)
    ap.add_argument("--prompt", default="The fastest way to add two tensors across two GPUs is")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)

    import torch

    import yali_vllm
    from yali_vllm.models import write_model_dir

    try:
        # Its own default directory is rewritten on every run.
        model = write_model_dir(args.dir, args.size, force=args.force or args.dir == DEFAULT_DIR)
    except (OSError, ValueError) as e:
        ap.error(str(e))
    print(f"[demo] wrote the embedded {args.size} model to {model}")
    print(f"[demo] YALI extension: {'available' if yali_vllm.available() else yali_vllm.unavailable_reason()}")
    vllm_bin = shutil.which("vllm")
    if torch.cuda.device_count() < 2 or not vllm_bin:
        print(f"[demo] serving needs 2 NVLink GPUs and vLLM ({torch.cuda.device_count()} GPUs, vllm "
              f"{'found' if vllm_bin else 'not installed'}): stopping after the set-up")
        return 0

    cfg = SERVER_CONFIGS["yali"]
    port = pick_port(8000)
    log = Path(args.dir) / "serve.log"
    cmd = server_command(vllm_bin, model, cfg, port, max_model_len=2048, gpu_memory_utilization=0.85)
    print(f"[demo] starting: {' '.join(cmd)}  (log: {log})", flush=True)
    with running_server(cmd, server_env(cfg), log, port, "yali", startup_timeout_s=args.startup_timeout,
                        on_started=lambda s, w: print(f"[demo] server healthy after {w:.0f}s", flush=True)) as srv:
        resp = http_post_json(srv.base_url + "/v1/completions",
                              {"model": str(model), "prompt": args.prompt, "max_tokens": 32, "temperature": 0},
                              timeout_s=120)
    text = resp["choices"][0]["text"]
    print(f"[demo] completion ({resp['usage']['completion_tokens']} tokens, random weights): {text!r}")
    yali_lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if "YALI" in ln]
    print("[demo] YALI lines in the server log:\n  " + "\n  ".join(yali_lines[-6:]))
    return 0 if any("YALI all-reduce ON" in ln for ln in yali_lines) else 1


if __name__ == "__main__":
    sys.exit(main())
