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
import csv
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import (  # noqa: E402
    MULTICAST_OFF_ENV,
    child_env,
    load_results_of_kind,
    merge_sources,
    results_header,
    under,
    write_json_and_markdown,
    write_results,
)
from cli_args import float_range, int_range, positive_float, positive_int  # noqa: E402
from serving_bench import (  # noqa: E402
    DEFAULT_CONFIGS,
    SERVER_CONFIGS,
    Deadline,
    Progress,
    ServerError,
    Terminated,
    add_server_args,
    default_out,
    default_model_dir,
    install_signal_handlers,
    model_summary,
    parse_csv_list,
    pick_port,
    prepare_model,
    resolve_command,
    run_bounded,
    server_command_for,
    server_env,
    split_command,
    start_server,
    startup_wait,
    stop_and_scan,
    tail_lines,
    wait_healthy,
    warmup_server,
)

KIND = "load-test"
RESULT_NAME = "load-test.json"
LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
ROW_KEYS = (
    "config",
    "users",
    "duration_s",
    "requests",
    "failures",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "itl_ms_p50",
    "itl_ms_p99",
)
STREAM_TYPES = ("TTFT", "ITL")  # the locustfile's custom request types


# ================================================================ CSV -> row
def _cell_num(val: str | None) -> float | None:
    if val is None:
        return None
    val = val.strip()
    if not val or val.upper() == "N/A":
        return None
    try:
        return float(val)
    except ValueError:
        return None


def read_locust_stats(stats_csv: str | Path) -> list[dict[str, str]]:
    with open(stats_csv, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def locust_csv_to_row(stats_csv: str | Path, config: str, users: int, duration_s: float) -> dict[str, Any]:
    """One ``load-test`` row from locust's ``PREFIX_stats.csv``.

    ``requests``: the generation requests (``POST`` rows); ``failures``:
    failures of every row but Aggregated (a failed model discovery counts); TTFT/ITL
    percentiles: the ``50%``/``99%`` columns of the TTFT/ITL rows (locust rounds
    them to whole milliseconds).
    """
    rows = read_locust_stats(stats_csv)
    requests = 0
    failures = 0
    req_s = 0.0
    by_type: dict[str, dict[str, str]] = {}
    for r in rows:
        typ = (r.get("Type") or "").strip()
        name = (r.get("Name") or "").strip()
        if name == "Aggregated" and not typ:
            continue
        failures += int(_cell_num(r.get("Failure Count")) or 0)
        if typ in STREAM_TYPES:
            by_type.setdefault(typ, r)
            continue
        if typ != "POST":
            continue  # e.g. the model discovery GET /v1/models
        requests += int(_cell_num(r.get("Request Count")) or 0)
        req_s += _cell_num(r.get("Requests/s")) or 0.0

    def pct(typ: str, col: str) -> float | None:
        r = by_type.get(typ)
        return _cell_num(r.get(col)) if r else None

    return {
        "config": config,
        "users": int(users),
        "duration_s": float(duration_s),
        "requests": requests,
        "failures": failures,
        "ttft_ms_p50": pct("TTFT", "50%"),
        "ttft_ms_p99": pct("TTFT", "99%"),
        "itl_ms_p50": pct("ITL", "50%"),
        "itl_ms_p99": pct("ITL", "99%"),
        "req_s": round(req_s, 3),
        "ttft_events": int(_cell_num(by_type.get("TTFT", {}).get("Request Count")) or 0),
        "itl_events": int(_cell_num(by_type.get("ITL", {}).get("Request Count")) or 0),
    }


def locust_failures(failures_csv: str | Path, limit: int = 10) -> list[dict[str, str]]:
    try:
        with open(failures_csv, newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f))[:limit]
    except OSError:
        return []


def soak_verdict(
    row: dict[str, Any] | None,
    log_scan: dict[str, Any] | None,
    locust_rc: int | None,
    yali_on: bool = True,
) -> dict[str, Any]:
    reasons: list[str] = []
    if not yali_on:
        reasons.append("the server never logged 'YALI all-reduce ON': the soak did not exercise yali")
    if row is None:
        reasons.append("no locust result")
    else:
        if row["requests"] <= 0:
            reasons.append("no request completed")
        if row["failures"] != 0:
            reasons.append(f"{row['failures']} failures")
    if locust_rc is None:
        reasons.append("locust did not finish in time")
    if log_scan is None:
        reasons.append("server log not scanned")
    elif log_scan.get("error_count"):
        reasons.append(f"{log_scan['error_count']} ERROR/Traceback line(s) in the server log")
    return {"pass": not reasons, "reasons": reasons}


def locust_command(
    locust_bin: str,
    *,
    users: int,
    spawn_rate: float,
    duration_s: int,
    host: str,
    csv_prefix: Path,
    html: Path,
    stop_timeout_s: int = 30,
) -> list[str]:
    return [
        *split_command(locust_bin),
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "-u",
        str(users),
        "-r",
        str(spawn_rate),
        "-t",
        f"{int(duration_s)}s",
        "--host",
        host,
        "--csv",
        str(csv_prefix),
        "--html",
        str(html),
        "--only-summary",
        "--stop-timeout",
        str(stop_timeout_s),
    ]


LOCUST_OVERHEAD_S = 45.0  # locust start/stop + spawn + stop-timeout slack around its run time


def run_locust(
    locust_bin: str,
    settings: argparse.Namespace,
    model: str,
    out: Path,
    name: str,
    cfg: str,
    host: str,
    *,
    users: int,
    spawn_rate: float,
    duration_s: int,
    deadline: Deadline,
    reserve_s: float,
) -> tuple[dict[str, Any] | None, int | None, dict[str, Any] | None]:
    """One bounded locust run against ``host`` writing OUT/NAME_stats.csv (and its HTML, log and
    other CSVs): (load-test row, locust's exit code, error entry); the row is None, and the error
    says why, when locust wrote no stats."""
    cmd = locust_command(locust_bin, users=users, spawn_rate=spawn_rate, duration_s=duration_s, host=host,
                         csv_prefix=out / name, html=out / f"{name}.html")
    rc = run_bounded(cmd, env=locust_env(settings, model),
                     timeout_s=deadline.clip(duration_s + LOCUST_OVERHEAD_S, reserve_s), log_path=out / f"{name}.log")
    stats = out / f"{name}_stats.csv"
    if not stats.exists():
        return None, rc, {"config": cfg, "error": f"locust wrote no stats (rc {rc})",
                          "log_tail": tail_lines(out / f"{name}.log", 20)}
    row = locust_csv_to_row(stats, cfg, users, duration_s)
    row["locust_rc"] = rc
    row["top_failures"] = locust_failures(out / f"{name}_failures.csv")
    return row, rc, None


def locust_env(args: argparse.Namespace, model: str) -> dict[str, str]:
    return child_env(
        {
            "YALI_LOAD_MODEL": model,
            "YALI_LOAD_MAX_TOKENS": str(args.max_tokens),
            "YALI_LOAD_PROMPT_WORDS": str(args.prompt_words),
            "YALI_LOAD_CHAT_WEIGHT": str(args.chat_weight),
            "YALI_LOAD_COMPLETIONS_WEIGHT": str(args.completions_weight),
            "YALI_LOAD_TIMEOUT_S": str(args.request_timeout_s),
        }
    )


def render_markdown(doc: dict[str, Any]) -> str:
    L = [f"# Load test ({doc.get('mode')})", ""]
    L.append(f"- date: {doc.get('date')}")
    L.append(f"- host: {doc.get('host')}")
    v = doc.get("versions") or {}
    L.append("- versions: " + ", ".join(f"{k} {v.get(k)}" for k in ("torch", "cuda", "nccl", "vllm", "yali_vllm", "git")))
    L.append(f"- model: {(doc.get('model') or {}).get('size')}; locust: {doc.get('locust')}")
    L.append(f"- command: `{doc.get('command')}`")
    if doc.get("merged_from"):
        L.append("- merged from: " + ", ".join(f"`{m}`" for m in doc["merged_from"]))
    L.append("")
    cols = ["config", "users", "duration (s)", "requests", "failures", "req/s", "TTFT p50 (ms)", "TTFT p99 (ms)", "ITL p50 (ms)", "ITL p99 (ms)"]
    L.append("| " + " | ".join(cols) + " |")
    L.append("|" + "|".join(["---"] * len(cols)) + "|")
    for r in doc.get("records") or []:
        cells = [r["config"], r["users"], r["duration_s"], r["requests"], r["failures"], r.get("req_s"), r["ttft_ms_p50"], r["ttft_ms_p99"], r["itl_ms_p50"], r["itl_ms_p99"]]
        L.append("| " + " | ".join("—" if c is None else str(c) for c in cells) + " |")
    L.append("")
    L.append("TTFT/ITL come from locust's stats (whole milliseconds); for sub-millisecond comparisons use serving_bench.py.")
    L.append("")
    if doc.get("verdict"):
        vd = doc["verdict"]
        L.append(f"## Soak verdict: {'PASS' if vd['pass'] else 'FAIL'}")
        L.append("")
        for reason in vd.get("reasons") or []:
            L.append(f"- {reason}")
        L.append("")
    for s in doc.get("server_logs") or []:
        L.append(f"**{s['config']}** server log `{s['log_file']}`: YALI on: {s.get('yali_on')}, {s.get('error_count', 0)} ERROR/Traceback line(s)")
        for w in s.get("warnings") or []:
            L.append(f"> **WARNING**: {w}")
        if s.get("error_lines"):
            L.append("```")
            L.extend(s["error_lines"])
            L.append("```")
        if s.get("key_lines"):
            L.append("```")
            L.extend(s["key_lines"])
            L.append("```")
        L.append("")
    for e in doc.get("errors") or []:
        src = f" (`{e['source']}`)" if e.get("source") else ""
        L.append(f"- error: {e.get('config')}{src}: {str(e.get('error'))[:300]}")
    return "\n".join(L) + "\n"


# =================================================================== merge
def merge_load_tests(docs: Sequence[dict[str, Any]], sources: Sequence[str], prefixes: Sequence[str]) -> dict[str, Any]:
    """One load-test result from several of the same mode and locust settings (run time
    aside): header from the first, rows, server logs and errors concatenated; each row
    names its source, and log files are prefixed with their source's directory
    (relative to the merged result) so they stay findable."""
    if not docs:
        raise ValueError("nothing to merge")

    def settings(d: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in (d.get("locust") or {}).items() if k != "duration_s"}

    for d, src in zip(docs, sources):
        if d.get("mode") != docs[0].get("mode") or settings(d) != settings(docs[0]):
            raise SystemExit(f"{src}: mode {d.get('mode')!r} / locust settings {settings(d)} differ from "
                             f"{sources[0]}'s ({docs[0].get('mode')!r} / {settings(docs[0])}): not comparable")
    merged = dict(docs[0])
    merged["merged_from"] = list(sources)
    merged["commands"] = [d.get("command") for d in docs]
    for key in ("records", "server_logs", "errors"):
        merged[key] = []
    for d, src, prefix in zip(docs, sources, prefixes):
        merged["records"] += [{**r, "source": src} for r in d.get("records") or []]
        merged["server_logs"] += [{**e, "log_file": under(prefix, e.get("log_file"))} for e in d.get("server_logs") or []]
        merged["errors"] += [{**e, "source": src} for e in d.get("errors") or []]
    return merged


def merge_main(paths: Sequence[Path], out: Path) -> int:
    doc = merge_load_tests(load_results_of_kind(paths, KIND), *merge_sources(paths, out))
    json_path = write_json_and_markdown(out, "soak" if doc.get("mode") == "soak" else "load-test", doc,
                                        render_markdown(doc))
    print(f"merged {len(paths)} results into {json_path} and its .md")
    return 0


# ===================================================================== run
# The ranges benchmarks/locustfile.py accepts for its YALI_LOAD_* settings (it clamps other values).
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
    unknown = [c for c in configs if c not in SERVER_CONFIGS]
    if unknown:
        raise SystemExit(f"unknown config(s) {unknown}; known: {list(SERVER_CONFIGS)}")
    if args.chat_weight == 0 and args.completions_weight == 0:
        raise SystemExit("--chat-weight and --completions-weight are both 0: no user to run")
    args.spawn_rate = args.spawn_rate or max(1.0, args.users / 4.0)
    return configs


def run(args: argparse.Namespace) -> int:
    configs = resolve_args(args)
    mode = "soak" if args.soak else "comparison"
    deadline = Deadline(args.budget_s)
    say = Progress("load-test", deadline)
    model_dir = (args.model_dir or default_model_dir(args.model_size)).resolve()
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
        print(f"# model: yali_vllm.models.write_model_dir({str(model_dir)!r}, size={args.model_size!r}); mode {mode}")
        for cfg in configs:
            env = server_env(SERVER_CONFIGS[cfg])
            shown = " ".join(f"{k}={env[k]}" for k in sorted(env) if k in MULTICAST_OFF_ENV or k.startswith("YALI_"))
            print(f"{shown} {shlex.join(srv_cmd(cfg, args.port))}")
            print("  " + shlex.join(l_cmd(args.port, cfg, args.duration_s)))
        return 0

    args.vllm_bin = resolve_command(args.vllm_bin, "vllm.entrypoints.cli.main")
    args.locust_bin = resolve_command(args.locust_bin, "locust")
    install_signal_handlers()
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / RESULT_NAME
    say(f"writing {args.model_size} model to {model_dir}")
    model_dir = prepare_model(args.model_size, model_dir)
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
            "model": {**model_summary(model_dir, args.model_size), "tensor_parallel_size": 2, "max_model_len": args.max_model_len,
                      "gpu_memory_utilization": args.gpu_memory_utilization, "max_num_seqs": args.max_num_seqs,
                      "extra_server_args": args.extra_server_args},
            "locust": locust_settings,
            "records": [],
            "server_logs": [],
            "errors": [],
            "budget_s": args.budget_s,
        },
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
                wait_s, bound = startup_wait(deadline, args.startup_timeout_s, stop_reserve)
                waited = wait_healthy(server, wait_s, bound=bound)
                say(f"{cfg}: healthy after {waited:.1f}s")
                warmup_server(server.base_url, str(model_dir), args.warmup_requests, timeout_s=deadline.clip(60.0, stop_reserve))
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
                say(f"{cfg}: stopping server (pid {server.proc.pid}, process group)")
                entry = {"config": cfg, **stop_and_scan(server, out, args.stop_grace_s)}
                for w in entry["warnings"]:
                    say(f"{cfg}: WARNING: {w}")
                doc["server_logs"].append(entry)
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
