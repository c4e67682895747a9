"""One serving-benchmark run: every configuration's servers in the interleaved schedule, each
measured with `vllm bench serve` at every concurrency inside the budget, optionally profiled and
put under locust; the result file is rewritten after every point."""

from __future__ import annotations

import argparse
import json
import shlex
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.common.cli_args import parse_csv_list
from benchmarks.common.gpu_env import MULTICAST_OFF_ENV, child_env
from benchmarks.common.results import default_out, results_header, write_results
from benchmarks.serving.budget import (
    Deadline,
    Estimates,
    Progress,
    Terminated,
    install_signal_handlers,
    interleaved_schedule,
    num_prompts_for,
)
from benchmarks.serving import profile_analysis
from benchmarks.serving.commands import ServerError, pick_port, resolve_command, split_command, tail_lines
from benchmarks.serving.configs import SERVER_CONFIGS, add_variants
from benchmarks.serving.locust import LoadTests
from benchmarks.serving.logs import yali_off_line
from benchmarks.serving.model import (
    default_model_dir,
    model_summary,
    prepare_model,
    quantisation_refusal,
    tensor_parallel_refusal,
)
from benchmarks.serving.profiler import move_traces, profile_prefill, profile_request, profiler_config
from benchmarks.serving.report import write_report
from benchmarks.serving.runners import CliBenchRunner, WorkerBenchRunner, bench_args
from benchmarks.serving.schema import KIND, LONG_PROMPT_RECORDS, RESULT_NAME, make_record, parse_bench_result
from benchmarks.serving.server import server_command_for, server_env, start_server, stop_and_record, wait_ready
from benchmarks.serving.step_times import SERVER_FLAG as STEP_TIMES_SERVER_FLAG, write_step_times


def _g(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.4g}"


def estimates_key(args: argparse.Namespace) -> str:
    """The workload whose start-up and point times an estimates file keeps together."""
    quant = "" if args.quant == "none" else f" {args.quant}"
    return (f"{args.model_size}{quant} tp{args.world_size} len{args.max_model_len} seqs{args.max_num_seqs} "
            f"{args.random_input_len}x{args.random_output_len} prompts{args.min_prompts}/{args.prompts_per_concurrency} "
            f"long{args.long_prompt_len}x{args.long_prompt_count}")


def validate_args(args: argparse.Namespace) -> list[str]:
    configs = parse_csv_list(args.configs)
    add_variants(configs)
    if args.soak_s and "yali" not in configs:
        raise SystemExit("--soak-s soaks the yali server: add yali to --configs")
    need = max(args.random_input_len, args.long_prompt_len) + args.random_output_len
    if args.max_model_len < need:
        raise SystemExit(f"--max-model-len {args.max_model_len} < input+output {need} "
                         f"(--random-input-len / --long-prompt-len + --random-output-len)")
    from yali_vllm.models import MOE_SIZES

    dp_ep = [c for c in configs if SERVER_CONFIGS[c].parallel == "dp-ep"]
    if dp_ep and args.model_size not in MOE_SIZES:
        raise SystemExit(f"config(s) {dp_ep} serve a MoE model with data + expert parallelism: --model-size must be "
                         f"one of {list(MOE_SIZES)}, not {args.model_size}")
    refusal = quantisation_refusal(args.model_size, args.quant)
    if refusal:
        raise SystemExit(f"--quant {args.quant}: {refusal}")
    refusal = tensor_parallel_refusal(args.model_size, args.world_size)
    if refusal and len(dp_ep) < len(configs):
        raise SystemExit(f"--world-size {args.world_size}: {refusal}")
    return configs


def point_prompts(args: argparse.Namespace, c: int, long_prompt: bool) -> tuple[int, int]:
    """(prompts, input tokens) of a point: a concurrency point, or the long-prompt point."""
    if long_prompt:
        return args.long_prompt_count, args.long_prompt_len
    return num_prompts_for(c, args.prompts_per_concurrency, args.min_prompts), args.random_input_len


def write_decode_profile(out: Path, tokens: int, model_size: str) -> Path | None:
    """decode-profile.json/.md from out/traces/<config>/ (profile_analysis)."""
    doc = profile_analysis.profile_doc(out / "traces", tokens,
                                     {"model_size": model_size, "source": "serving_bench --profile-tokens"})
    if not doc["records"]:
        return None
    profile_analysis.write_doc(out, doc)
    return out / "decode-profile.json"


def write_prefill_profile(out: Path, prompt_tokens: int, model_size: str) -> Path | None:
    """prefill-profile.json/.md from out/prefill-traces/<config>/: the kernels of one prefill step."""
    if not (out / "prefill-traces").is_dir():
        return None
    doc = profile_analysis.profile_doc(out / "prefill-traces", 1,
                                       {"model_size": model_size, "phase": "prefill", "prompt_tokens": prompt_tokens,
                                        "source": "serving_bench --profile-prefill-tokens"})
    if not doc["records"]:
        return None
    profile_analysis.write_doc(out, doc, profile_analysis.PREFILL_NAME)
    return out / f"{profile_analysis.PREFILL_NAME}.json"


def profile_server(args: argparse.Namespace, server, cfg: str, model_dir: Path, out: Path,
                   deadline: Deadline, reserve_s: float, say: Callable[[str], None]) -> None:
    """The decode profile (--profile-tokens) and the prefill profile (--profile-prefill-tokens) of one
    running server, each moved from the server's profiler directory to out/traces/<cfg> and
    out/prefill-traces/<cfg>. Raises on a failed request."""
    server_dir = out / "profiler" / cfg
    if args.profile_tokens:
        dur = profile_request(server.base_url, str(model_dir), args.profile_tokens, deadline, reserve_s)
        n = move_traces(server_dir, out / "traces" / cfg)
        say(f"{cfg}: profiled a {args.profile_tokens}-token request ({dur:.1f}s with the trace, {n} files)")
    if args.profile_prefill_tokens:
        dur = profile_prefill(server.base_url, str(model_dir), args.profile_prefill_tokens, args.seed, deadline,
                              reserve_s)
        n = move_traces(server_dir, out / "prefill-traces" / cfg)
        say(f"{cfg}: profiled the prefill of a {args.profile_prefill_tokens}-token prompt "
            f"({dur:.1f}s with the trace, {n} files)")


def run(args: argparse.Namespace) -> int:
    configs = validate_args(args)
    deadline = Deadline(args.budget_s)
    say = Progress("serving-bench", deadline)
    model_dir = (args.model_dir or default_model_dir(args.model_size, args.quant)).resolve()
    out = (args.out or default_out("serving")).resolve()
    schedule = interleaved_schedule(configs, args.repeats)
    concs: list[int] = list(args.concurrency)

    def srv_cmd(cfg: str, port: int) -> list[str]:
        cmd = server_command_for(args, model_dir, cfg, port)
        if args.profile_tokens or args.profile_prefill_tokens:
            cmd += ["--profiler-config", json.dumps(profiler_config(out / "profiler" / cfg))]
        if args.step_times:
            cmd.append(STEP_TIMES_SERVER_FLAG)
        return cmd

    def b_args(base_url: str, c: int, j: int, result_dir: Path, name: str, long_prompt: bool = False) -> list[str]:
        n_prompts, input_len = point_prompts(args, c, long_prompt)
        return bench_args(
            base_url,
            model_dir,
            concurrency=c,
            num_prompts=n_prompts,
            input_len=input_len,
            output_len=args.random_output_len,
            seed=args.seed + j,
            result_dir=result_dir,
            result_filename=name,
        )

    if args.dry_run:
        print(f"# model: yali_vllm.models.write_model_dir({str(model_dir)!r}, size={args.model_size!r}, "
              f"quant={args.quant!r})")
        print(f"# out: {out}")
        for rep, cfg in schedule:
            env = server_env(SERVER_CONFIGS[cfg])
            shown = {k: env[k] for k in sorted(env) if k in MULTICAST_OFF_ENV or k.startswith("YALI_")}
            print(f"# {cfg} r{rep}")
            print(" ".join(f"{k}={v}" for k, v in shown.items()) + " " + shlex.join(srv_cmd(cfg, args.port)))
            for j, c in enumerate(concs):
                bargs = b_args(f"http://127.0.0.1:{args.port}", c, j, out / "raw", f"{cfg}-r{rep}-c{c}.json")
                print("  " + shlex.join([*split_command(args.vllm_bin), "bench", "serve", *bargs]))
            if args.long_prompt_len:
                bargs = b_args(f"http://127.0.0.1:{args.port}", 1, len(concs), out / "raw", f"{cfg}-r{rep}-long.json", True)
                print("  " + shlex.join([*split_command(args.vllm_bin), "bench", "serve", *bargs]))
        print(f"# bench runner: {args.bench_runner}")
        if args.locust_users:
            print(f"# then, on each config's first server: locust {args.locust_users} users for {args.locust_duration_s}s "
                  f"-> {out / 'load-test.json'}")
        if args.soak_s:
            print(f"# then, on the yali server: soak, locust {args.soak_users} users for {args.soak_s}s -> {out / 'soak.json'}")
        return 0

    args.vllm_bin = resolve_command(args.vllm_bin, "vllm.entrypoints.cli.main", "--vllm-bin")
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
    b_args: Callable[..., list[str]],
    runner: CliBenchRunner | WorkerBenchRunner,
) -> int:
    say(f"writing {args.model_size} model (quantisation {args.quant}) to {model_dir}")
    model_dir = prepare_model(args.model_size, model_dir, args.quant)
    model = model_summary(model_dir, args.model_size)
    model.update(
        {
            "tensor_parallel_size": args.world_size,
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
    if args.long_prompt_len:
        workload["long_prompt"] = {"input_len": args.long_prompt_len, "concurrency": 1,
                                   "num_prompts": args.long_prompt_count, "seed": args.seed + len(concs)}
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
            LONG_PROMPT_RECORDS: [],
            "server_logs": [],
            "errors": [],
            "skipped": [],
            "budget_s": args.budget_s,
        },
        world_size=args.world_size,
    )
    say(f"host: {doc['host']}; versions: {doc['versions']}")
    write_results(json_path, doc)

    est = Estimates(args.estimates_file, estimates_key(args), args.startup_estimate_s, args.bench_estimate_s)
    if est.startup_saved or est.bench_saved:
        say(f"budget plan: start-up {est.startup_saved} s and points {est.bench_saved} s saved by an earlier "
            f"run ({args.estimates_file})")
    dead_configs: set[str] = set()
    port = args.port
    stop_reserve = args.stop_grace_s + 15.0
    interrupted: BaseException | None = None

    def skip(rep: int, cfg: str, c: int | None, reason: str, mark: dict[str, str] | None = None) -> None:
        doc["skipped"].append({"config": cfg, "repeat": rep, "concurrency": c, "reason": reason, **(mark or {})})

    try:
        for idx, (rep, cfg) in enumerate(schedule):
            tag = f"{cfg} r{rep}/{args.repeats} ({idx + 1}/{len(schedule)})"
            if cfg in dead_configs:
                skip(rep, cfg, None, "server failed earlier in this run")
                say(f"{tag}: skipped (server failed earlier)")
                continue
            need = est.startup(cfg) + est.first_bench() + stop_reserve
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
                est.saw_startup(cfg, waited)
                say(f"{tag}: healthy after {waited:.1f}s" + (f", warm-up {ok} ok, {bad} failed" if args.warmup_requests else ""))
                off = yali_off_line(cfg, log_path)
                if off:  # its points would measure vLLM's own all-reduce under YALI's name
                    raise ServerError(f"the {cfg} server logged 'YALI all-reduce OFF', so it is not measured: {off}")
                points = [(c, f"c{c}", False) for c in concs]
                if args.long_prompt_len:
                    points.append((1, "long", True))
                for j, (c, label, long_prompt) in enumerate(points):
                    mark = {"point": "long"} if long_prompt else {}  # on its skipped / error entries
                    point_s = est.bench(label)
                    if deadline.remaining() < point_s + stop_reserve:
                        skip(rep, cfg, c, f"budget: {deadline.remaining():.0f}s left < ~{point_s + stop_reserve:.0f}s needed",
                             mark)
                        say(f"{tag} {label}: skipped, not enough budget left")
                        continue
                    if not server.alive():
                        raise ServerError(
                            f"server {cfg} exited (code {server.proc.returncode}); last 50 log lines:\n"
                            + "\n".join(tail_lines(log_path, 50))
                        )
                    name = f"{cfg}-r{rep}-{label}"
                    bargs = b_args(server.base_url, c, j, raw_dir, name + ".json", long_prompt)
                    n_prompts, input_len = point_prompts(args, c, long_prompt)
                    say(f"{tag} {label}: vllm bench serve ({runner.name}), {n_prompts} prompts of {input_len} tokens, concurrency {c}")
                    t0 = time.monotonic()
                    rc = runner.run(bargs, raw_dir / f"{name}.log", deadline.clip(args.bench_timeout_s, stop_reserve))
                    dur = time.monotonic() - t0
                    result_file = raw_dir / f"{name}.json"
                    if rc == 0 and result_file.exists():
                        parsed = parse_bench_result(result_file)
                        rec = make_record(cfg, c, rep, parsed, result_file=str(result_file.relative_to(out)), wall_s=round(dur, 1))
                        if long_prompt:
                            rec["input_len"] = input_len
                        doc[LONG_PROMPT_RECORDS if long_prompt else "records"].append(rec)
                        est.saw_bench(label, dur)
                        say(
                            f"{tag} {label}: done in {dur:.1f}s: TPOT p50 {_g(rec['tpot_ms_p50'])} ms, "
                            f"ITL p99 {_g(rec['itl_ms_p99'])} ms, TTFT p50 {_g(rec['ttft_ms_p50'])} ms, "
                            f"{_g(rec['output_tok_s'])} tok/s, failed {rec['failed']}"
                        )
                    else:
                        why = "timed out" if rc is None else f"exit code {rc}"
                        tail = tail_lines(raw_dir / f"{name}.log", 20)
                        doc["errors"].append(
                            {"config": cfg, "repeat": rep, "concurrency": c, "error": f"vllm bench serve {why}", "log_tail": tail,
                             **mark}
                        )
                        say(f"{tag} {label}: FAILED ({why}); see {raw_dir / (name + '.log')}")
                    write_results(json_path, doc)
                if (args.profile_tokens or args.profile_prefill_tokens) and rep == 1:
                    if deadline.remaining() < 90.0 + stop_reserve:
                        say(f"{tag}: profile skipped, not enough budget left")
                    else:
                        try:
                            profile_server(args, server, cfg, model_dir, out, deadline, stop_reserve, say)
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
                entry = stop_and_record(server, out, args.stop_grace_s, doc, tag, say, config=cfg, repeat=rep)
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
        for phase, n, write, traces in (("decode", args.profile_tokens, write_decode_profile, "traces"),
                                         ("prefill", args.profile_prefill_tokens, write_prefill_profile,
                                          "prefill-traces")):
            if n and (out / traces).is_dir():
                try:
                    prof = write(out, n, args.model_size)
                    say(f"{phase} profile: {prof or 'no GPU kernels in the traces'}")
                except Exception as e:
                    say(f"{phase} profile analysis FAILED: {type(e).__name__}: {e}")
        if args.step_times:
            try:
                steps = write_step_times(out, doc)
                say(f"step times: {steps or 'no iteration details in the server logs'}")
            except Exception as e:
                say(f"step times FAILED: {type(e).__name__}: {e}")
        md, plots = write_report(doc, json_path, out)
        say(f"wrote {json_path}, {md}" + (", " + ", ".join(str(p) for p in plots) if plots else ""))
    if interrupted is not None:
        return 130
    return 0 if doc["records"] and not doc["errors"] else 1
