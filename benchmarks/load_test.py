#!/usr/bin/env python3
"""Locust load test (and yali soak test) against vLLM servers this script starts.

Comparison mode (default): for each configuration in ``--configs`` start
``vllm serve`` (same configurations and helpers as ``serving_bench.py``), run

    locust -f benchmarks/locustfile.py --headless -u USERS -r RATE -t DURATION \
        --host http://127.0.0.1:PORT --csv PREFIX --html FILE --only-summary

bounded by a timeout, stop the server, and turn locust's stats CSV into one
``load-test`` row per configuration.

``--soak``: the yali configuration only, 64 users by default; the verdict is
PASS only with requests > 0, zero failures, locust finished in time, the server
logged ``YALI all-reduce ON``, and no ``ERROR``/``Traceback`` line in the server
log (up to the moment the server is asked to stop).

Writes ``load-test.json`` (schema in docs/BENCHMARKS.md), ``load-test.md``, and
keeps locust's CSV/HTML and every server log under ``--out``.

``--merge A.json B.json ... --out DIR`` combines load-test results of the same mode
and locust settings written by separate runs (e.g. one run per configuration)
into one table.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common.cli_args import float_range, int_range, parse_csv_list, positive_float, positive_int
from benchmarks.common.gpu_env import MULTICAST_OFF_ENV
from benchmarks.common.results import (
    default_out,
    load_results_of_kind,
    merge_sources,
    results_header,
    write_json_and_markdown,
    write_results,
)
from benchmarks.serving.budget import Deadline, Progress, Terminated, install_signal_handlers
from benchmarks.serving.commands import ServerError, pick_port, resolve_command
from benchmarks.serving.configs import SERVER_CONFIGS, add_variants
from benchmarks.serving.locust import (
    KIND,
    RESULT_NAME,
    LOCUST_OVERHEAD_S,
    locust_command,
    merge_load_tests,
    render_markdown,
    run_locust,
    soak_verdict,
)
from benchmarks.serving.model import (
    default_model_dir,
    model_summary,
    prepare_model,
    quantisation_refusal,
    tensor_parallel_refusal,
)
from benchmarks.serving.schema import DEFAULT_CONFIGS
from benchmarks.serving.server import server_command_for, server_env, start_server, stop_and_record, wait_ready
from benchmarks.serving.server_options import add_server_args

def merge_main(paths: Sequence[Path], out: Path) -> int:
    doc = merge_load_tests(load_results_of_kind(paths, KIND), *merge_sources(paths, out))
    json_path = write_json_and_markdown(out, "soak" if doc.get("mode") == "soak" else "load-test", doc,
                                        render_markdown(doc))
    print(f"merged {len(paths)} results into {json_path} and its .md")
    return 0


# ===================================================================== run
# The ranges benchmarks/locustfile.py accepts for its LOAD_* settings (it clamps other values).
MAX_TOKENS = int_range(1, 4096)
PROMPT_WORDS = int_range(1, 8192)
WEIGHT = int_range(0, 1000)
REQUEST_TIMEOUT_S = float_range(1.0, 3600.0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"comma list of {list(SERVER_CONFIGS)} (ignored with --soak)")
    p.add_argument("--soak", action="store_true", help="soak test of the yali configuration with a PASS/FAIL verdict")
    p.add_argument("--users", type=positive_int, default=None, help="locust users (default 32; 64 with --soak)")
    p.add_argument("--spawn-rate", type=positive_float, default=None, help="users started per second (default users/4)")
    p.add_argument("--duration-s", type=positive_int, default=None, help="locust run time per config (default 60; 120 with --soak)")
    p.add_argument("--max-tokens", type=MAX_TOKENS, default=64)
    p.add_argument("--prompt-words", type=PROMPT_WORDS, default=128)
    p.add_argument("--chat-weight", type=WEIGHT, default=1, help="weight of the chat user (0 = off)")
    p.add_argument("--completions-weight", type=WEIGHT, default=1, help="weight of the completions user (0 = off)")
    p.add_argument("--request-timeout-s", type=REQUEST_TIMEOUT_S, default=120.0)
    p.add_argument("--locust-bin", default="locust", help="locust command, shell-split (default: locust on PATH, else this python -m locust)")
    add_server_args(p)
    p.add_argument("--out", type=Path, default=None, help="output dir (default <temp dir>/yali-results-<uid>/load-DATE or soak-DATE)")
    p.add_argument("--merge", type=Path, nargs="+", default=None, metavar="LOAD_TEST.json",
                   help="merge these load-test results (same mode and locust settings) into --out and exit")
    return p


def resolve_args(args: argparse.Namespace) -> list[str]:
    if args.soak:
        configs = ["yali"]
        args.users = args.users or 64
        args.duration_s = args.duration_s or 120
    else:
        configs = parse_csv_list(args.configs)
        args.users = args.users or 32
        args.duration_s = args.duration_s or 60
    add_variants(configs)
    if args.chat_weight == 0 and args.completions_weight == 0:
        raise SystemExit("--chat-weight and --completions-weight are both 0: no user to run")
    refusal = quantisation_refusal(args.model_size, args.quant)
    if refusal:
        raise SystemExit(f"--quant {args.quant}: {refusal}")
    refusal = tensor_parallel_refusal(args.model_size, args.world_size)
    if refusal:
        raise SystemExit(refusal)
    args.spawn_rate = args.spawn_rate or max(1.0, args.users / 4.0)
    return configs


def run(args: argparse.Namespace) -> int:
    configs = resolve_args(args)
    mode = "soak" if args.soak else "comparison"
    deadline = Deadline(args.budget_s)
    say = Progress("load-test", deadline)
    model_dir = (args.model_dir or default_model_dir(args.model_size, args.quant)).resolve()
    out = (args.out or default_out("soak" if args.soak else "load")).resolve()

    def srv_cmd(cfg: str, port: int) -> list[str]:
        return server_command_for(args, model_dir, cfg, port)

    def l_cmd(port: int, cfg: str, duration: int) -> list[str]:
        return locust_command(
            args.locust_bin,
            users=args.users,
            spawn_rate=args.spawn_rate,
            duration_s=duration,
            host=f"http://127.0.0.1:{port}",
            csv_prefix=out / f"locust-{cfg}",
            html=out / f"locust-{cfg}.html",
        )

    if args.dry_run:
        print(f"# model: yali_vllm.models.write_model_dir({str(model_dir)!r}, size={args.model_size!r}, "
              f"quant={args.quant!r}); mode {mode}")
        for cfg in configs:
            env = server_env(SERVER_CONFIGS[cfg])
            shown = " ".join(f"{k}={env[k]}" for k in sorted(env) if k in MULTICAST_OFF_ENV or k.startswith("YALI_"))
            print(f"{shown} {shlex.join(srv_cmd(cfg, args.port))}")
            print("  " + shlex.join(l_cmd(args.port, cfg, args.duration_s)))
        return 0

    args.vllm_bin = resolve_command(args.vllm_bin, "vllm.entrypoints.cli.main", "--vllm-bin")
    args.locust_bin = resolve_command(args.locust_bin, "locust", "--locust-bin")
    install_signal_handlers()
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / RESULT_NAME
    say(f"writing {args.model_size} model (quantisation {args.quant}) to {model_dir}")
    model_dir = prepare_model(args.model_size, model_dir, args.quant)
    locust_settings = {
        "users": args.users,
        "spawn_rate": args.spawn_rate,
        "duration_s": args.duration_s,
        "max_tokens": args.max_tokens,
        "prompt_words": args.prompt_words,
        "chat_weight": args.chat_weight,
        "completions_weight": args.completions_weight,
    }
    doc = results_header(
        KIND,
        {
            "mode": mode,
            "model": {**model_summary(model_dir, args.model_size), "tensor_parallel_size": args.world_size, "max_model_len": args.max_model_len,
                      "gpu_memory_utilization": args.gpu_memory_utilization, "max_num_seqs": args.max_num_seqs,
                      "extra_server_args": args.extra_server_args},
            "locust": locust_settings,
            "records": [],
            "server_logs": [],
            "errors": [],
            "budget_s": args.budget_s,
        },
        world_size=args.world_size,
    )
    write_results(json_path, doc)
    port = args.port
    stop_reserve = args.stop_grace_s + 15.0
    overhead = LOCUST_OVERHEAD_S
    interrupted: BaseException | None = None
    soak_row: dict[str, Any] | None = None
    soak_scan: dict[str, Any] | None = None
    soak_rc: int | None = None
    soak_yali_on = False
    try:
        for cfg in configs:
            if deadline.remaining() < args.startup_estimate_s + 20 + overhead + stop_reserve:
                doc["errors"].append({"config": cfg, "error": "skipped: not enough budget left"})
                say(f"{cfg}: skipped, not enough budget left")
                continue
            port = pick_port(port)
            log_path = out / "server-logs" / f"{cfg}.log"
            cmd = srv_cmd(cfg, port)
            say(f"{cfg}: starting server on port {port}: {shlex.join(cmd)}")
            server = start_server(cmd, server_env(SERVER_CONFIGS[cfg]), log_path, port, cfg)
            rc: int | None = None
            row: dict[str, Any] | None = None
            try:
                waited, _, _ = wait_ready(server, deadline, args.startup_timeout_s, stop_reserve, str(model_dir),
                                          args.warmup_requests)
                say(f"{cfg}: healthy after {waited:.1f}s, warmed up")
                duration = int(min(args.duration_s, deadline.remaining() - stop_reserve - overhead))
                if duration < min(5, args.duration_s):
                    raise ServerError("not enough budget left to run locust")
                if duration < args.duration_s:
                    say(f"{cfg}: budget: shortening the locust run to {duration}s")
                say(f"{cfg}: locust {args.users} users for {duration}s")
                row, rc, error = run_locust(
                    args.locust_bin, args, str(model_dir), out, f"locust-{cfg}", cfg, f"http://127.0.0.1:{port}",
                    users=args.users, spawn_rate=args.spawn_rate, duration_s=duration, deadline=deadline,
                    reserve_s=stop_reserve,
                )
                if row is not None:
                    doc["records"].append(row)
                    say(
                        f"{cfg}: {row['requests']} requests, {row['failures']} failures, TTFT p50 {row['ttft_ms_p50']} ms, "
                        f"ITL p50 {row['itl_ms_p50']} ms (locust rc {rc})"
                    )
                else:
                    doc["errors"].append(error)
                    say(f"{cfg}: locust wrote no stats (rc {rc})")
                if not server.alive():
                    doc["errors"].append({"config": cfg, "error": f"server exited during the load test (code {server.proc.returncode})"})
            except ServerError as e:
                doc["errors"].append({"config": cfg, "error": str(e)})
                say(f"{cfg}: FAILED: {str(e).splitlines()[0]}")
                print(str(e), flush=True)
            finally:
                entry = stop_and_record(server, out, args.stop_grace_s, doc, cfg, say, config=cfg)
                if row is not None:
                    row["server_log_errors"] = entry["error_count"]
                if args.soak:
                    soak_row, soak_scan, soak_rc, soak_yali_on = row, entry, rc, entry["yali_on"]
                write_results(json_path, doc)
                port += 1
    except (KeyboardInterrupt, Terminated) as e:
        interrupted = e
        say(f"interrupted ({e!r}); writing partial results")
    finally:
        if args.soak:
            doc["verdict"] = soak_verdict(soak_row, soak_scan, soak_rc, soak_yali_on)
            if interrupted is not None:
                doc["verdict"] = {"pass": False, "reasons": [*doc["verdict"]["reasons"], "interrupted"]}
            say(f"soak verdict: {'PASS' if doc['verdict']['pass'] else 'FAIL'} {doc['verdict']['reasons']}")
        doc["elapsed_s"] = round(deadline.elapsed(), 1)
        write_results(json_path, doc)
        (out / "load-test.md").write_text(render_markdown(doc), encoding="utf-8")
        say(f"wrote {json_path} and {out / 'load-test.md'}")
    if interrupted is not None:
        return 130
    if args.soak:
        return 0 if doc["verdict"]["pass"] else 1
    return 0 if doc["records"] and not doc["errors"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.merge:
        if args.out is None:
            parser.error("--merge needs --out")
        return merge_main([p.resolve() for p in args.merge], args.out.resolve())
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
