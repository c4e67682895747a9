#!/usr/bin/env python3
"""Measures YALI kernel configurations side by side (one process per rank, one
communicator per variant) to choose the size -> kernel table in
csrc/core/yali/common/plan_table.h. Per-op time inside CUDA graphs, median of replays.

  python -m lab.tune --out /tmp/yali-results --name tune-<date>
  python -m lab.tune --world-size 8 --variants ranks   # the N-rank table's boundary and CTA size
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


from benchmarks.common.cli_args import add_world_size_arg, place_ranks, rank_device
from benchmarks.common.gpu_env import MULTICAST_OFF_ENV
from benchmarks.common.processes import run_ranks
from benchmarks.common.results import output_dir, results_header, write_json_and_markdown
from benchmarks.common.sizes import fmt_size, parse_size
from benchmarks.common.timing import time_graph

os.environ.update(MULTICAST_OFF_ENV)

SMALL = "2K,8K,32K,64K,128K,256K,512K"
MID = "256K,512K,1M,2M,4M,8M,16M"
LARGE = "16M,32M,64M,256M,1G"
# label -> (env, mode, sizes)
# Rounds 1-3 also measured the flash-ll and one-shot kernels (since removed) and the stream ring's
# shape, now fixed at 128 lanes x 8 slots (current/tune/20261122-configs-first,
# current/tune/20261122-configs-second); its slot size stays a knob.
VARIANTS = {
    "stream-64K": ({"YALI_DEV_SLOT_BYTES": "64K"}, "stream", MID + "," + LARGE),
    "stream-32K": ({"YALI_DEV_SLOT_BYTES": "32K"}, "stream", MID + "," + LARGE),
    "stream-128K": ({"YALI_DEV_SLOT_BYTES": "128K"}, "stream", MID + "," + LARGE),
    "stream-16K": ({"YALI_DEV_SLOT_BYTES": "16K"}, "stream", MID),
    # Round 4: flash-push CTA size. (Round 4 also compared a sentinel-in-data stream,
    # YALI_DEV_STREAM_FLAGS=0, with the ready-flag one: 219 vs 199 us at 64 MiB, so it
    # was removed; current/tune/20261122-push-cta-bytes/tune.md has those rows.)
    "push-cta512": ({"YALI_DEV_PUSH_CTA_BYTES": "512"}, "flash", SMALL + ",1M,4M,8M"),
    "push-cta1K": ({"YALI_DEV_PUSH_CTA_BYTES": "1K"}, "flash", SMALL + ",1M,4M,8M"),
    "push-cta4K": ({"YALI_DEV_PUSH_CTA_BYTES": "4K"}, "flash", SMALL + ",1M,4M,8M"),
    "push-cta16K": ({"YALI_DEV_PUSH_CTA_BYTES": "16K"}, "flash", SMALL + ",1M,4M,8M"),
    # Round 5: programmatic dependent launch against plain launches (PDL is the
    # default since round 5 measured it faster at every size).
    "push-nopdl": ({"YALI_DEV_PDL": "0"}, "flash", SMALL + ",1M,4M,8M"),
    "push-pdl": ({"YALI_DEV_PDL": "1"}, "flash", SMALL + ",1M,4M,8M"),
    "stream-nopdl": ({"YALI_DEV_PDL": "0"}, "stream", "16M,64M"),
    "stream-pdl": ({"YALI_DEV_PDL": "1"}, "stream", "16M,64M"),
    # Round 6 (current/tune/20261122-batch-poll) measured flash-push receivers polling all their vectors
    # each round against one after the other: batched was slower at 2K-1M and 8M, so
    # flash-push kept the one-at-a-time wait and the knob (YALI_DEV_BATCH_POLL) was removed.
    # Only the fused op polls batched, from YALI_DEV_FUSED_BATCH_POLL_MIN on.
}
# Above two ranks (--world-size 4, 6 or 8): push one-shot at every size against push two-shot at
# every size (where they cross is YALI_DEV_RANKS_ONESHOT_MAX), and the bytes per CTA.
RANKS_SIZES = "2K,16K,64K,128K,256K,512K,1M,2M,4M,8M"
VARIANTS.update({
    "ranks-oneshot": ({"YALI_DEV_RANKS_ONESHOT_MAX": "8M"}, "auto", RANKS_SIZES),
    "ranks-twoshot": ({"YALI_DEV_RANKS_ONESHOT_MAX": "4K"}, "auto", RANKS_SIZES.replace("2K,", "")),
    "ranks-default": ({}, "auto", RANKS_SIZES),
    "ranks-cta512": ({"YALI_DEV_PUSH_CTA_BYTES": "512"}, "auto", RANKS_SIZES),
    "ranks-cta4K": ({"YALI_DEV_PUSH_CTA_BYTES": "4K"}, "auto", RANKS_SIZES),
})
ROUND4 = [k for k in VARIANTS if k.startswith("push-cta")]
ROUND5 = ["push-nopdl", "push-pdl", "stream-nopdl", "stream-pdl"]
RANKS = [k for k in VARIANTS if k.startswith("ranks-")]


def worker(rank, port, args, q):
    os.environ.update(MULTICAST_OFF_ENV)
    import torch
    import torch.distributed as dist

    from yali_vllm.communicator import YaliCommunicator, YaliUnavailable

    dev = torch.device("cuda", rank_device(rank, args.shared_gpu))
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size)
    rows = []
    names = variant_names(args.variants, args.world_size)
    base_env = {k: v for k, v in os.environ.items() if k.startswith("YALI_")}
    for vi, label in enumerate(names):
        env, mode, sizes = VARIANTS[label]
        for k in [k for k in os.environ if k.startswith("YALI_")]:
            del os.environ[k]
        os.environ.update(base_env)
        os.environ.update(env)
        try:
            comm = YaliCommunicator(dist.group.WORLD, dev)
        except YaliUnavailable as e:  # both ranks: e.g. a variant this machine's GPUs cannot hold
            rows += [{"variant": label, "bytes": parse_size(s), "error": str(e)[:200]} for s in sizes.split(",")]
            if rank == 0:
                print(f"[tune {vi + 1}/{len(names)}] {label:22s} refused: {e}", flush=True)
            continue
        for s in sizes.split(","):
            nbytes = parse_size(s)
            x = torch.randn(nbytes // 2, device=dev).to(torch.bfloat16)
            out = torch.empty_like(x)
            try:
                comm.all_reduce(x, out=out, mode=mode)
                times = time_graph(torch, lambda t, o=out: comm.all_reduce(t, out=o, mode=mode), x,
                                   max(2, min(50, int((64 << 20) // nbytes))), args.replays, None)
                rows.append({"variant": label, "env": env, "mode": mode, "bytes": nbytes, "dtype": "bf16",
                             "us_p50": round(statistics.median(times), 3), "us_min": round(min(times), 3),
                             "busbw_gbps": round(nbytes / statistics.median(times) / 1e3
                                                 * 2 * (args.world_size - 1) / args.world_size, 1)})
            except Exception as e:
                rows.append({"variant": label, "bytes": nbytes, "error": str(e)[:200]})
            del x, out
        comm.close()
        torch.cuda.empty_cache()
        dist.barrier()
        if rank == 0:
            got = [r for r in rows if r["variant"] == label]
            print(f"[tune {vi + 1}/{len(names)}] {label:22s} " + "  ".join(
                f"{fmt_size(r['bytes'])}:{r.get('us_p50', 'ERR')}" for r in got), flush=True)
    q.put((rank, rows))
    dist.destroy_process_group()


def variant_names(spec: str, world_size: int) -> list[str]:
    """The variants `spec` names (a comma list, round4, round5 or ranks; empty: every variant of
    the world size). The N-rank variants run above two ranks only, the others at two only."""
    rounds = {"round4": ROUND4, "round5": ROUND5, "ranks": RANKS}
    names = rounds.get(spec) or ([v.strip() for v in spec.split(",") if v.strip()] if spec else
                                 [k for k in VARIANTS if k.startswith("ranks-") == (world_size > 2)])
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown variant(s) {unknown}; known: round4, round5, ranks, {', '.join(VARIANTS)}")
    wrong = [n for n in names if n.startswith("ranks-") != (world_size > 2)]
    if wrong:
        raise SystemExit(f"--variants {','.join(wrong)}: " + ("N-rank variants need --world-size 4, 6 or 8"
                         if world_size == 2 else f"two-rank variants do not run at --world-size {world_size}"))
    return names


def table(rows):
    sizes = sorted({r["bytes"] for r in rows})
    labels = list(dict.fromkeys(r["variant"] for r in rows))
    get = {(r["variant"], r["bytes"]): r for r in rows}
    out = ["| variant | " + " | ".join(fmt_size(s) for s in sizes) + " |", "|---|" + "---:|" * len(sizes)]
    for lab in labels:
        cells = []
        for s in sizes:
            r = get.get((lab, s))
            cells.append("–" if r is None else ("err" if "error" in r else f"{r['us_p50']:.2f}"))
        out.append(f"| {lab} | " + " | ".join(cells) + " |")
    best = []
    for s in sizes:
        cand = [(r["us_p50"], r["variant"]) for r in rows if r["bytes"] == s and "us_p50" in r]
        if cand:
            best.append(f"{fmt_size(s)}: {min(cand)[1]} ({min(cand)[0]:.2f} us)")
    return "\n".join(out) + "\n\nBest per size: " + "; ".join(best) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--variants", default="", help="comma list of variant labels, or round4 / round5 (default: all)")
    ap.add_argument("--replays", type=int, default=15)
    ap.add_argument("--out", default=str(output_dir()))
    ap.add_argument("--name", default="tune-" + time.strftime("%Y%m%d-%H%M%S"))
    add_world_size_arg(ap)
    args = ap.parse_args()
    variant_names(args.variants, args.world_size)  # refuses a bad --variants before any rank starts
    args.shared_gpu = place_ranks(args.world_size)
    rows = run_ranks(worker, args, 900, "tuning", world_size=args.world_size)
    hdr = results_header("allreduce-tuning", {"method": "bf16, per-op time in CUDA graphs, p50 of replays; busbw "
                                                        "= bytes / time x 2(N-1)/N"},
                         world_size=args.world_size, shared_gpu=args.shared_gpu)
    hdr["records"] = rows
    md = table(rows)
    title = f"# YALI tuning, {args.world_size} ranks ({hdr['host']})\n\n{hdr['date']} · `{hdr['command']}`\n\n"
    write_json_and_markdown(args.out, args.name, hdr, title + md)
    print(md)


if __name__ == "__main__":
    main()
