"""Locust on vLLM servers: the command, its run bounded by the budget, its stats CSV as a
``load-test`` row, the soak verdict, the report and merging; LoadTests runs locust on servers
serving_bench already started."""

from __future__ import annotations

from collections.abc import Callable

import argparse
import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common.gpu_env import child_env
from benchmarks.common.results import results_header, under, write_json_and_markdown
from benchmarks.serving.budget import Deadline
from benchmarks.serving.commands import resolve_command, run_bounded, split_command, tail_lines
from benchmarks.serving.model import model_summary
from benchmarks.serving.server import Server


KIND = "load-test"
RESULT_NAME = "load-test.json"
LOCUSTFILE = Path(__file__).resolve().parents[1] / "locustfile.py"
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
            "LOAD_MODEL": model,
            "LOAD_MAX_TOKENS": str(args.max_tokens),
            "LOAD_PROMPT_WORDS": str(args.prompt_words),
            "LOAD_CHAT_WEIGHT": str(args.chat_weight),
            "LOAD_COMPLETIONS_WEIGHT": str(args.completions_weight),
            "LOAD_TIMEOUT_S": str(args.request_timeout_s),
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


class LoadTests:
    """Locust runs on servers serving_bench already started (comparison rows and the yali
    soak), written as load_test.py writes them: load-test.json (mode comparison) and
    soak.json (mode soak, with its verdict), locust's CSV/HTML beside them."""

    def __init__(self, args: argparse.Namespace, out: Path, model_dir: Path):
        self.args, self.out, self.model_dir = args, out, model_dir
        self.settings = argparse.Namespace(max_tokens=64, prompt_words=128, chat_weight=1, completions_weight=1,
                                           request_timeout_s=120.0)
        self.docs: dict[str, dict[str, Any]] = {}
        self.locust_bin = resolve_command(args.locust_bin, "locust", "--locust-bin")

    def doc(self, mode: str) -> dict[str, Any]:
        if mode not in self.docs:
            users = self.args.soak_users if mode == "soak" else self.args.locust_users
            dur = self.args.soak_s if mode == "soak" else self.args.locust_duration_s
            self.docs[mode] = results_header(KIND, {
                "mode": mode, "model": model_summary(self.model_dir, self.args.model_size),
                "locust": {"users": users, "spawn_rate": max(1.0, users / 4.0), "duration_s": dur,
                           **vars(self.settings)},
                "source": "serving_bench (locust on the benchmark's own servers, after their measurements)",
                "records": [], "server_logs": [], "errors": []}, world_size=self.args.world_size)
        return self.docs[mode]

    def run(self, server: Server, cfg: str, mode: str, deadline: Deadline, reserve_s: float,
            say: Callable[[str], None]) -> None:
        doc = self.doc(mode)
        users, wanted = doc["locust"]["users"], int(doc["locust"]["duration_s"])
        duration = int(min(wanted, deadline.remaining() - reserve_s - LOCUST_OVERHEAD_S))
        if duration < min(5, wanted):
            doc["errors"].append({"config": cfg, "error": "skipped: not enough budget left"})
            say(f"{cfg}: locust {mode} skipped, not enough budget left")
            return
        say(f"{cfg}: locust {mode}, {users} users for {duration}s"
            + (f" (shortened from {wanted}s by the budget)" if duration < wanted else ""))
        row, rc, error = run_locust(
            self.locust_bin, self.settings, str(self.model_dir), self.out, f"locust-{mode}-{cfg}", cfg,
            server.base_url, users=users, spawn_rate=doc["locust"]["spawn_rate"], duration_s=duration,
            deadline=deadline, reserve_s=reserve_s)
        if row is None:
            doc["errors"].append(error)
            say(f"{cfg}: locust {mode} wrote no stats (rc {rc})")
            return
        doc["records"].append(row)
        say(f"{cfg}: locust {mode}: {row['requests']} requests, {row['failures']} failures, TTFT p50 "
            f"{row['ttft_ms_p50']} ms, ITL p50 {row['itl_ms_p50']} ms (rc {rc})")

    def server_stopped(self, cfg: str, entry: dict[str, Any]) -> None:
        """Records the stopped server's log scan with every mode that ran on it."""
        for doc in self.docs.values():
            if any(r["config"] == cfg for r in doc["records"]) or any(e["config"] == cfg for e in doc["errors"]):
                doc["server_logs"].append({"config": cfg, **entry})
                for r in doc["records"]:
                    if r["config"] == cfg:
                        r["server_log_errors"] = entry["error_count"]

    def write(self, say: Callable[[str], None]) -> None:
        for mode, doc in self.docs.items():
            if mode == "soak":
                row = doc["records"][0] if doc["records"] else None
                scan = doc["server_logs"][0] if doc["server_logs"] else None
                rc = row.get("locust_rc") if row else None
                doc["verdict"] = soak_verdict(row, scan, rc, bool(scan and scan.get("yali_on")))
                say(f"soak verdict: {'PASS' if doc['verdict']['pass'] else 'FAIL'} {doc['verdict']['reasons']}")
            write_json_and_markdown(self.out, "soak" if mode == "soak" else "load-test", doc,
                                    render_markdown(doc))
