#!/usr/bin/env python3
"""End-to-end serving benchmark: yali vs vLLM's own all-reduce paths.

For each configuration (``yali``, ``vllm-default``, ``nccl``) x ``--repeats``
(interleaved: yali, vllm-default, nccl, yali, ...) this starts
``vllm serve`` on the embedded dummy model with tensor parallelism 2, drives it
with vLLM's own ``vllm bench serve`` (random dataset) at each ``--concurrency``,
and writes under ``--out``:

* ``serving-benchmark.json``  -- the result file (schema in docs/BENCHMARKS.md)
* ``serving-benchmark.md``    -- comparison tables with a "no difference" verdict
* ``tpot_p50.png``, ``itl_p99.png`` -- plots (if matplotlib is installed)
* ``server-logs/<config>-r<repeat>.log`` -- every server's full log
* ``raw/`` -- every ``vllm bench serve`` result JSON and client log

The whole run is bounded by ``--budget-s``: every wait has a timeout clipped to
what is left, and every server is stopped (its whole process group) in a
``finally``.  ``--report-only RESULT.json`` regenerates table + plots;
``--report-only A.json B.json ... --out DIR`` merges runs (e.g. one repeat per
run) into one result, renumbering the repeats.
``--dry-run`` prints the commands without running anything.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks import decode_profile, load_test
from benchmarks.common.cli_args import non_negative_int, parse_csv_list, parse_int_list, positive_float, positive_int
from benchmarks.common.gpu_env import MULTICAST_OFF_ENV, child_env
from benchmarks.common.results import (
    default_out,
    load_results_of_kind,
    merge_sources,
    results_header,
    write_json_and_markdown,
    write_results,
)
from benchmarks.serving.budget import (
    Deadline,
    Progress,
    Terminated,
    install_signal_handlers,
    interleaved_schedule,
    num_prompts_for,
)
from benchmarks.serving.commands import ServerError, pick_port, resolve_command, split_command, tail_lines
from benchmarks.serving.configs import SERVER_CONFIGS
from benchmarks.serving.model import default_model_dir, model_summary, prepare_model
from benchmarks.serving.profiler import profile_request, profiler_config
from benchmarks.serving.report import backfill_extra_keys, merge_results, write_report
from benchmarks.serving.runners import CliBenchRunner, WorkerBenchRunner, bench_args
from benchmarks.serving.schema import DEFAULT_CONFIGS, KIND, RESULT_NAME, make_record, parse_bench_result
from benchmarks.serving.server import Server, server_command_for, server_env, start_server, stop_and_scan, wait_ready
from benchmarks.serving.server_options import add_server_args


def _g(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.4g}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"comma list of {list(SERVER_CONFIGS)}")
    p.add_argument("--repeats", type=positive_int, default=2, help="repeats per config, interleaved")
    p.add_argument("--concurrency", type=parse_int_list, default=[1, 8, 32], help="comma list of --max-concurrency values")
    p.add_argument("--prompts-per-concurrency", type=positive_int, default=4, help="num-prompts = max(min-prompts, this x concurrency)")
    p.add_argument("--min-prompts", type=positive_int, default=8)
    p.add_argument("--random-input-len", type=positive_int, default=1024)
    p.add_argument("--random-output-len", type=positive_int, default=256)
    p.add_argument("--seed", type=non_negative_int, default=0, help="dataset seed; concurrency point i uses seed+i (no prefix-cache reuse between points)")
    p.add_argument("--bench-timeout-s", type=positive_float, default=300.0, help="max time for one vllm bench serve run (clipped to the budget)")
    p.add_argument("--bench-estimate-s", type=positive_float, default=25.0, help="assumed bench time until one is observed (budget planning)")
    p.add_argument(
        "--bench-runner",
        choices=("worker", "cli"),
        default="worker",
        help="cli: one `vllm bench serve` process per point; worker: the same vLLM bench code and argv in one "
        "long-lived client process (vLLM imported once, saves seconds per point)",
    )
    p.add_argument("--bench-python", default=sys.executable, help="python (shell-split) for --bench-runner worker")
    p.add_argument("--bench-module", default="vllm.benchmarks.serve", help=argparse.SUPPRESS)
    p.add_argument(
        "--profile-tokens",
        type=non_negative_int,
        default=0,
        help="after the measured points of each config's first repeat, profile one streamed request of this many "
        "tokens with vLLM's torch profiler and write decode-profile.json/.md (kernel time per class and the gaps "
        "around them, see decode_profile.py) under --out; 0 = no profile. The profiler is configured on the server "
        "but only runs for that request, after the measurements",
    )
    p.add_argument("--locust-users", type=non_negative_int, default=0,
                   help="after each config's first-repeat points, a locust load test (benchmarks/locustfile.py) "
                        "with this many users on the same server; rows in --out/load-test.json (kind load-test). 0 = none")
    p.add_argument("--locust-duration-s", type=positive_int, default=60, help="duration of each locust comparison run")
    p.add_argument("--soak-s", type=non_negative_int, default=0,
                   help="after the yali server's first-repeat points (and locust run), a soak of this many seconds "
                        "with --soak-users users on the same server; PASS needs zero failed requests and no "
                        "ERROR/Traceback line in the server log up to its stop (--out/soak.json). 0 = none")
    p.add_argument("--soak-users", type=positive_int, default=64)
    p.add_argument("--locust-bin", default="locust", help="locust command, shell-split (default: locust on PATH, else this python -m locust)")
    add_server_args(p)
    p.add_argument("--out", type=Path, default=None, help="output dir (default benchmarks/results/serving-DATE)")
    p.add_argument(
        "--report-only",
        type=Path,
        nargs="+",
        default=None,
        metavar="RESULT.json",
        help="regenerate table + plots from a result file and exit; with several files, merge them into --out",
    )
    return p


def validate_args(args: argparse.Namespace) -> list[str]:
    configs = parse_csv_list(args.configs)
    unknown = [c for c in configs if c not in SERVER_CONFIGS]
    if unknown:
        raise SystemExit(f"unknown config(s) {unknown}; known: {list(SERVER_CONFIGS)}")
    if args.soak_s and "yali" not in configs:
        raise SystemExit("--soak-s soaks the yali server: add yali to --configs")
    need = args.random_input_len + args.random_output_len
    if args.max_model_len < need:
        raise SystemExit(f"--max-model-len {args.max_model_len} < input+output {need}")
    return configs


class LoadTests:
    """Locust runs on servers serving_bench already started (comparison rows and the yali
    soak), written as load_test.py writes them: load-test.json (mode comparison) and
    soak.json (mode soak, with its verdict), locust's CSV/HTML beside them."""

    def __init__(self, args: argparse.Namespace, out: Path, model_dir: Path):
        self.lt, self.args, self.out, self.model_dir = load_test, args, out, model_dir
        self.settings = argparse.Namespace(max_tokens=64, prompt_words=128, chat_weight=1, completions_weight=1,
                                           request_timeout_s=120.0)
        self.docs: dict[str, dict[str, Any]] = {}
        self.locust_bin = resolve_command(args.locust_bin, "locust")

    def doc(self, mode: str) -> dict[str, Any]:
        if mode not in self.docs:
            users = self.args.soak_users if mode == "soak" else self.args.locust_users
            dur = self.args.soak_s if mode == "soak" else self.args.locust_duration_s
            self.docs[mode] = results_header(self.lt.KIND, {
                "mode": mode, "model": model_summary(self.model_dir, self.args.model_size),
                "locust": {"users": users, "spawn_rate": max(1.0, users / 4.0), "duration_s": dur,
                           **vars(self.settings)},
                "source": "serving_bench (locust on the benchmark's own servers, after their measurements)",
                "records": [], "server_logs": [], "errors": []})
        return self.docs[mode]

    def run(self, server: Server, cfg: str, mode: str, deadline: Deadline, reserve_s: float,
            say: Callable[[str], None]) -> None:
        doc = self.doc(mode)
        users, wanted = doc["locust"]["users"], int(doc["locust"]["duration_s"])
        duration = int(min(wanted, deadline.remaining() - reserve_s - self.lt.LOCUST_OVERHEAD_S))
        if duration < min(5, wanted):
            doc["errors"].append({"config": cfg, "error": "skipped: not enough budget left"})
            say(f"{cfg}: locust {mode} skipped, not enough budget left")
            return
        say(f"{cfg}: locust {mode}, {users} users for {duration}s"
            + (f" (shortened from {wanted}s by the budget)" if duration < wanted else ""))
        row, rc, error = self.lt.run_locust(
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
                doc["verdict"] = self.lt.soak_verdict(row, scan, rc, bool(scan and scan.get("yali_on")))
                say(f"soak verdict: {'PASS' if doc['verdict']['pass'] else 'FAIL'} {doc['verdict']['reasons']}")
            write_json_and_markdown(self.out, "soak" if mode == "soak" else "load-test", doc,
                                    self.lt.render_markdown(doc))


def write_decode_profile(out: Path, tokens: int, model_size: str) -> Path | None:
    """decode-profile.json/.md from out/traces/<config>/ (decode_profile.py's analysis)."""
    doc = decode_profile.profile_doc(out / "traces", tokens,
                                     {"model_size": model_size, "source": "serving_bench --profile-tokens"})
    if not doc["records"]:
        return None
    decode_profile.write_doc(out, doc)
    return out / "decode-profile.json"


def run(args: argparse.Namespace) -> int:
    configs = validate_args(args)
    deadline = Deadline(args.budget_s)
    say = Progress("serving-bench", deadline)
    model_dir = (args.model_dir or default_model_dir(args.model_size)).resolve()
    out = (args.out or default_out("serving")).resolve()
    schedule = interleaved_schedule(configs, args.repeats)
    concs: list[int] = list(args.concurrency)

    def srv_cmd(cfg: str, port: int) -> list[str]:
        cmd = server_command_for(args, model_dir, cfg, port)
        if args.profile_tokens:
            cmd += ["--profiler-config", json.dumps(profiler_config(out / "traces" / cfg))]
        return cmd

    def b_args(base_url: str, c: int, j: int, result_dir: Path, name: str) -> list[str]:
        return bench_args(
            base_url,
            model_dir,
            concurrency=c,
            num_prompts=num_prompts_for(c, args.prompts_per_concurrency, args.min_prompts),
            input_len=args.random_input_len,
            output_len=args.random_output_len,
            seed=args.seed + j,
            result_dir=result_dir,
            result_filename=name,
        )

    if args.dry_run:
        print(f"# model: yali_vllm.models.write_model_dir({str(model_dir)!r}, size={args.model_size!r})")
        print(f"# out: {out}")
        for rep, cfg in schedule:
            env = server_env(SERVER_CONFIGS[cfg])
            shown = {k: env[k] for k in sorted(env) if k in MULTICAST_OFF_ENV or k.startswith("YALI_")}
            print(f"# {cfg} r{rep}")
            print(" ".join(f"{k}={v}" for k, v in shown.items()) + " " + shlex.join(srv_cmd(cfg, args.port)))
            for j, c in enumerate(concs):
                bargs = b_args(f"http://127.0.0.1:{args.port}", c, j, out / "raw", f"{cfg}-r{rep}-c{c}.json")
                print("  " + shlex.join([*split_command(args.vllm_bin), "bench", "serve", *bargs]))
        print(f"# bench runner: {args.bench_runner}")
        if args.locust_users:
            print(f"# then, on each config's first server: locust {args.locust_users} users for {args.locust_duration_s}s "
                  f"-> {out / 'load-test.json'}")
        if args.soak_s:
            print(f"# then, on the yali server: soak, locust {args.soak_users} users for {args.soak_s}s -> {out / 'soak.json'}")
        return 0

    args.vllm_bin = resolve_command(args.vllm_bin, "vllm.entrypoints.cli.main")
    install_signal_handlers()
    raw_dir = out / "raw"
    log_dir = out / "server-logs"
    raw_dir.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    json_path = out / RESULT_NAME

    args.load_tests = LoadTests(args, out, model_dir) if (args.locust_users or args.soak_s) else None
    runner: CliBenchRunner | WorkerBenchRunner
    if args.bench_runner == "cli":
        runner = CliBenchRunner(args.vllm_bin, child_env())
    else:
        runner = WorkerBenchRunner(args.bench_python, child_env(), raw_dir / "bench-worker.log", args.bench_module)
        runner.start()  # imports vLLM while the model is written and the first server starts
    try:
        return _run_all(args, configs, deadline, say, model_dir, out, raw_dir, log_dir, json_path, schedule, concs, srv_cmd, b_args, runner)
    finally:
        runner.close()


def _run_all(
    args: argparse.Namespace,
    configs: list[str],
    deadline: Deadline,
    say: Progress,
    model_dir: Path,
    out: Path,
    raw_dir: Path,
    log_dir: Path,
    json_path: Path,
    schedule: list[tuple[int, str]],
    concs: list[int],
    srv_cmd: Callable[[str, int], list[str]],
    b_args: Callable[[str, int, int, Path, str], list[str]],
    runner: CliBenchRunner | WorkerBenchRunner,
) -> int:
    say(f"writing {args.model_size} model to {model_dir}")
    model_dir = prepare_model(args.model_size, model_dir)
    model = model_summary(model_dir, args.model_size)
    model.update(
        {
            "tensor_parallel_size": 2,
            "load_format": "dummy",
            "tokenizer_mode": "mistral",
            "max_model_len": args.max_model_len,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "max_num_seqs": args.max_num_seqs,
            "extra_server_args": args.extra_server_args,
        }
    )
    workload = {
        "tool": "vllm bench serve",
        "dataset": "random",
        "backend": "vllm",
        "endpoint": "/v1/completions",
        "input_len": args.random_input_len,
        "output_len": args.random_output_len,
        "ignore_eos": True,
        "concurrency": concs,
        "num_prompts": {str(c): num_prompts_for(c, args.prompts_per_concurrency, args.min_prompts) for c in concs},
        "seeds": {str(c): args.seed + j for j, c in enumerate(concs)},
        "repeats": args.repeats,
        "configs": configs,
        "warmup_requests": args.warmup_requests,
        "bench_runner": args.bench_runner,
    }
    say("collecting host and version info")
    doc = results_header(
        KIND,
        {
            "model": model,
            "workload": workload,
            "server_configs": {
                c: {"env": SERVER_CONFIGS[c].env, "args": list(SERVER_CONFIGS[c].args), "description": SERVER_CONFIGS[c].description}
                for c in configs
            },
            "multicast_off_env": dict(MULTICAST_OFF_ENV),
            "records": [],
            "server_logs": [],
            "errors": [],
            "skipped": [],
            "budget_s": args.budget_s,
        },
    )
    say(f"host: {doc['host']}; versions: {doc['versions']}")
    write_results(json_path, doc)

    est_startup: float | None = None
    est_bench: dict[int, float] = {}
    dead_configs: set[str] = set()
    port = args.port
    stop_reserve = args.stop_grace_s + 15.0
    interrupted: BaseException | None = None

    def skip(rep: int, cfg: str, c: int | None, reason: str) -> None:
        doc["skipped"].append({"config": cfg, "repeat": rep, "concurrency": c, "reason": reason})

    try:
        for idx, (rep, cfg) in enumerate(schedule):
            tag = f"{cfg} r{rep}/{args.repeats} ({idx + 1}/{len(schedule)})"
            if cfg in dead_configs:
                skip(rep, cfg, None, "server failed earlier in this run")
                say(f"{tag}: skipped (server failed earlier)")
                continue
            first_bench = min(est_bench.values()) if est_bench else args.bench_estimate_s
            need = (est_startup or args.startup_estimate_s) + first_bench + stop_reserve
            if deadline.remaining() < need:
                skip(rep, cfg, None, f"budget: {deadline.remaining():.0f}s left < ~{need:.0f}s needed")
                say(f"{tag}: skipped, not enough budget left (~{need:.0f}s needed)")
                continue
            port = pick_port(port)
            log_path = log_dir / f"{cfg}-r{rep}.log"
            cmd = srv_cmd(cfg, port)
            say(f"{tag}: starting server on port {port}: {shlex.join(cmd)}")
            server = start_server(cmd, server_env(SERVER_CONFIGS[cfg]), log_path, port, cfg)
            try:
                waited, ok, bad = wait_ready(server, deadline, args.startup_timeout_s, stop_reserve, str(model_dir),
                                             args.warmup_requests)
                est_startup = max(est_startup or 0.0, waited)
                say(f"{tag}: healthy after {waited:.1f}s" + (f", warm-up {ok} ok, {bad} failed" if args.warmup_requests else ""))
                for j, c in enumerate(concs):
                    est = est_bench.get(c, args.bench_estimate_s)
                    if deadline.remaining() < est + stop_reserve:
                        skip(rep, cfg, c, f"budget: {deadline.remaining():.0f}s left < ~{est + stop_reserve:.0f}s needed")
                        say(f"{tag} c={c}: skipped, not enough budget left")
                        continue
                    if not server.alive():
                        raise ServerError(
                            f"server {cfg} exited (code {server.proc.returncode}); last 50 log lines:\n"
                            + "\n".join(tail_lines(log_path, 50))
                        )
                    name = f"{cfg}-r{rep}-c{c}"
                    bargs = b_args(server.base_url, c, j, raw_dir, name + ".json")
                    n_prompts = num_prompts_for(c, args.prompts_per_concurrency, args.min_prompts)
                    say(f"{tag} c={c}: vllm bench serve ({runner.name}), {n_prompts} prompts")
                    t0 = time.monotonic()
                    rc = runner.run(bargs, raw_dir / f"{name}.log", deadline.clip(args.bench_timeout_s, stop_reserve))
                    dur = time.monotonic() - t0
                    result_file = raw_dir / f"{name}.json"
                    if rc == 0 and result_file.exists():
                        parsed = parse_bench_result(result_file)
                        rec = make_record(cfg, c, rep, parsed, result_file=str(result_file.relative_to(out)), wall_s=round(dur, 1))
                        doc["records"].append(rec)
                        est_bench[c] = max(est_bench.get(c, 0.0), dur)
                        say(
                            f"{tag} c={c}: done in {dur:.1f}s: TPOT p50 {_g(rec['tpot_ms_p50'])} ms, "
                            f"ITL p99 {_g(rec['itl_ms_p99'])} ms, TTFT p50 {_g(rec['ttft_ms_p50'])} ms, "
                            f"{_g(rec['output_tok_s'])} tok/s, failed {rec['failed']}"
                        )
                    else:
                        why = "timed out" if rc is None else f"exit code {rc}"
                        tail = tail_lines(raw_dir / f"{name}.log", 20)
                        doc["errors"].append(
                            {"config": cfg, "repeat": rep, "concurrency": c, "error": f"vllm bench serve {why}", "log_tail": tail}
                        )
                        say(f"{tag} c={c}: FAILED ({why}); see {raw_dir / (name + '.log')}")
                    write_results(json_path, doc)
                if args.profile_tokens and rep == 1:
                    if deadline.remaining() < 90.0 + stop_reserve:
                        say(f"{tag}: profile skipped, not enough budget left")
                    else:
                        try:
                            dur = profile_request(server.base_url, str(model_dir), args.profile_tokens, deadline,
                                                  stop_reserve)
                            say(f"{tag}: profiled a {args.profile_tokens}-token request ({dur:.1f}s with the trace)")
                        except Exception as e:  # the measurements stand without it
                            doc["errors"].append({"config": cfg, "repeat": rep, "concurrency": None,
                                                  "error": f"profile: {type(e).__name__}: {e}"})
                            say(f"{tag}: profile FAILED: {type(e).__name__}: {e}")
                if args.load_tests is not None and rep == 1:
                    if args.locust_users:
                        args.load_tests.run(server, cfg, "comparison", deadline, stop_reserve, say)
                    if args.soak_s and cfg == "yali":
                        args.load_tests.run(server, cfg, "soak", deadline, stop_reserve, say)
            except ServerError as e:
                dead_configs.add(cfg)
                doc["errors"].append({"config": cfg, "repeat": rep, "concurrency": None, "error": str(e)})
                say(f"{tag}: SERVER FAILED: {str(e).splitlines()[0]}")
                print(str(e), flush=True)
            finally:
                say(f"{tag}: stopping server (pid {server.proc.pid}, process group)")
                entry = {"config": cfg, "repeat": rep, **stop_and_scan(server, out, args.stop_grace_s)}
                for w in entry["warnings"]:
                    say(f"{tag}: WARNING: {w}")
                doc["server_logs"].append(entry)
                if args.load_tests is not None and rep == 1:
                    args.load_tests.server_stopped(cfg, entry)
                write_results(json_path, doc)
                port += 1
    except (KeyboardInterrupt, Terminated) as e:
        interrupted = e
        say(f"interrupted ({e!r}); writing partial results")
    finally:
        doc["elapsed_s"] = round(deadline.elapsed(), 1)
        write_results(json_path, doc)
        if args.load_tests is not None:
            args.load_tests.write(say)
        if args.profile_tokens and (out / "traces").is_dir():
            try:
                prof = write_decode_profile(out, args.profile_tokens, args.model_size)
                say(f"decode profile: {prof or 'no GPU kernels in the traces'}")
            except Exception as e:
                say(f"decode profile analysis FAILED: {type(e).__name__}: {e}")
        md, plots = write_report(doc, json_path, out)
        say(f"wrote {json_path}, {md}" + (", " + ", ".join(str(p) for p in plots) if plots else ""))
    if interrupted is not None:
        return 130
    return 0 if doc["records"] and not doc["errors"] else 1


def report_only(paths: Sequence[Path], out: Path | None) -> int:
    docs = load_results_of_kind(paths, KIND)
    if len(docs) == 1:
        doc, json_path = docs[0], paths[0]
    else:
        for doc, path in zip(docs, paths):  # the merged file gets what its sources' raw files hold
            backfill_extra_keys(doc, Path(path).parent)
        out = out or default_out("serving-merged")
        doc = merge_results(docs, *merge_sources(paths, out))
        json_path = write_results(out / RESULT_NAME, doc)
        print(f"merged {len(paths)} results into {json_path}")
    md, plots = write_report(doc, json_path, out)
    print(f"wrote {md}" + (", " + ", ".join(str(p) for p in plots) if plots else ""))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report_only:
        return report_only([p.resolve() for p in args.report_only], args.out.resolve() if args.out else None)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
