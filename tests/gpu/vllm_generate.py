"""Run one vLLM offline generation (TP=2, dummy weights) and report as JSON.

Used by tests/gpu/test_vllm_e2e.py, one configuration per fresh process
(vLLM does not give GPUs back reliably in-process).  YALI is switched by the
YALI_ENABLE environment variable, as in production.

    PYTHONPATH=. python tests/gpu/vllm_generate.py --model-dir DIR --out result.json \\
        [--eager] [--nccl] [--fuse default|off] [--max-tokens 32]

The JSON has: token_ids (one list per prompt), logprobs (per prompt and
position: {token id: logprob} for the top 20 tokens and the chosen one),
stats_before / stats_after (per TP rank: whether YALI serves the group and
its device-side kernel counters, from yali_vllm.plugin.yali_tp_stats),
num_layers, and the configuration.  The same JSON is printed on the last stdout line after the
marker "YALI_RESULT ".
"""

from __future__ import annotations

import argparse
import json
import os
import time

from benchmarks.common.gpu_env import MULTICAST_OFF_ENV

PROMPTS = [
    "The capital of France is",
    "Write a haiku about graphics cards:",
    "1, 2, 3, 4,",
    "In a distant galaxy, a small robot named Pip discovered that",
]
# --long-prompts: prefills of several hundred tokens each (above the CUDA graph sizes).
LONG_PROMPTS = [" ".join([p] * 60) for p in PROMPTS]

MARKER = "YALI_RESULT "


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--out", required=True, help="JSON result file")
    p.add_argument("--eager", action="store_true", help="enforce_eager=True")
    p.add_argument("--nccl", action="store_true", help="disable_custom_all_reduce=True")
    p.add_argument(
        "--fuse",
        choices=["default", "off"],
        default="default",
        help="vLLM's all-reduce+RMSNorm fusion: as vLLM configures it, or off",
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--long-prompts", action="store_true", help="prefills of several hundred tokens")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    args = p.parse_args()

    # NVLink multicast stays off (also inherited by vLLM's engine-core and worker processes).
    os.environ.update(MULTICAST_OFF_ENV)
    # collective_rpc with a function (yali_tp_stats) is pickled to the workers.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"

    from vllm import LLM, SamplingParams

    from yali_vllm.plugin import yali_tp_stats

    kwargs: dict = dict(
        model=args.model_dir,
        tokenizer_mode="mistral",
        load_format="dummy",
        tensor_parallel_size=2,
        seed=0,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=2048,
        max_num_batched_tokens=2048,
        max_num_seqs=8,
        enforce_eager=args.eager,
        disable_custom_all_reduce=args.nccl,
    )
    if not args.eager:
        # Few capture sizes keep start-up short; decode batches of <= 8 run
        # as CUDA-graph replays.
        cc: dict = {"cudagraph_capture_sizes": [1, 2, 4, 8]}
        if args.fuse == "off":
            cc["pass_config"] = {"fuse_allreduce_rms": False}
        kwargs["compilation_config"] = cc

    t0 = time.monotonic()
    llm = LLM(**kwargs)
    startup_s = time.monotonic() - t0
    hf_config = llm.llm_engine.model_config.hf_config

    before = llm.collective_rpc(yali_tp_stats)
    t0 = time.monotonic()
    outputs = llm.generate(
        LONG_PROMPTS if args.long_prompts else PROMPTS,
        # ignore_eos: every prompt yields exactly max_tokens tokens (random
        # weights may emit </s> early), so the step count is known.
        # logprobs=20 (vLLM's default most): the runners-up at each position, so a test can tell a
        # near tie from a real difference when two configurations diverge
        # (random weights give flat distributions: several tokens can share
        # the top bf16 logit).
        SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=20),
        use_tqdm=False,
    )
    generate_s = time.monotonic() - t0
    after = llm.collective_rpc(yali_tp_stats)

    result = {
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "logprobs": [
            [
                {str(t): float(lp.logprob) for t, lp in dict(pos or {}).items()}
                for pos in (o.outputs[0].logprobs or [])
            ]
            for o in outputs
        ],
        "stats_before": before,
        "stats_after": after,
        "num_layers": int(hf_config.num_hidden_layers),
        "max_tokens": args.max_tokens,
        "config": {
            "eager": args.eager,
            "nccl": args.nccl,
            "fuse": args.fuse,
            "long_prompts": args.long_prompts,
            "YALI_ENABLE": os.environ.get("YALI_ENABLE"),
        },
        "startup_s": round(startup_s, 1),
        "generate_s": round(generate_s, 2),
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f)
    print(MARKER + json.dumps(result), flush=True)
    del llm
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
