#!/usr/bin/env python3
"""End-to-end serving benchmark: yali vs vLLM's own all-reduce paths.

For each configuration (``yali``, ``vllm-default``, ``nccl``) x ``--repeats``
(interleaved: yali, vllm-default, nccl, yali, ...) this starts
``vllm serve`` on the embedded dummy model with tensor parallelism ``--world-size``
(2, 4, 6 or 8 ranks, one GPU each; default 2; 6 splits neither embedded model), drives it
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
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common.cli_args import non_negative_int, parse_int_list, positive_float, positive_int
from benchmarks.common.results import default_out, load_results_of_kind, merge_sources, write_results
from benchmarks.serving.bench_run import run
from benchmarks.serving.configs import SERVER_CONFIGS
from benchmarks.serving.report import backfill_extra_keys, merge_results, write_report
from benchmarks.serving.schema import DEFAULT_CONFIGS, KIND, RESULT_NAME
from benchmarks.serving.server_options import add_server_args


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
    p.add_argument("--long-prompt-len", type=non_negative_int, default=0,
                   help="after the concurrency points, one more point on each server: --long-prompt-count prompts of "
                        "this many tokens at concurrency 1 (the time to first token of a long prompt), in its own table; "
                        "0 = none")
    p.add_argument("--long-prompt-count", type=positive_int, default=32, help="prompts of the long-prompt point")
    p.add_argument("--seed", type=non_negative_int, default=0, help="dataset seed; concurrency point i uses seed+i (no prefix-cache reuse between points)")
    p.add_argument("--bench-timeout-s", type=positive_float, default=300.0, help="max time for one vllm bench serve run (clipped to the budget)")
    p.add_argument("--bench-estimate-s", type=positive_float, default=25.0, help="assumed bench time until one is observed (budget planning)")
    p.add_argument("--estimates-file", type=Path, default=None,
                   help="JSON of the start-up and point times observed per workload: read to plan the budget before this "
                        "run observes its own, updated after each observation (lab/gpu_host/serving.sh keeps one in "
                        "~/.cache beside vLLM's compile cache); default none")
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
        "around them, see lab/decode_profile.py) under --out; 0 = no profile. The profiler is configured on the server "
        "but only runs for that request, after the measurements",
    )
    p.add_argument(
        "--profile-prefill-tokens",
        type=non_negative_int,
        default=0,
        help="after the decode profile (or in its place), profile the prefill of one prompt of this many fresh "
        "random tokens (one output token) and write prefill-profile.json/.md: the kernels of that one step; "
        "0 = none",
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
    p.add_argument("--step-times", action="store_true",
                   help="servers log every engine step (vLLM's --enable-logging-iteration-details, 0.33); "
                        "--out/step-times.json/.md table the step times per config by tokens a step carries")
    p.add_argument("--locust-bin", default="locust", help="locust command, shell-split (default: locust on PATH, else this python -m locust)")
    add_server_args(p)
    p.add_argument("--out", type=Path, default=None, help="output dir (default <temp dir>/yali-results-<uid>/serving-DATE)")
    p.add_argument(
        "--report-only",
        type=Path,
        nargs="+",
        default=None,
        metavar="RESULT.json",
        help="regenerate table + plots from a result file and exit; with several files, merge them into --out",
    )
    return p


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
