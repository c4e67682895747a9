"""Checks of the expert-parallel dispatch and combine (csrc/core/yali/ep/ep.cuh) that run inside every
rank of an N-rank group (pair.run_ranks).

Every rank regenerates every rank's inputs from seeds made of the call and the rank, so each one
computes the references itself; outputs are poisoned before each call (the op API writes into
given tensors). The dispatch must return every rank's tensors bit for bit, in rank order, with
only the 32-bit words 0x80008000 replaced by 0x80000000 (some are planted in every input). The
combine must equal, bit for bit, the rank-order fp32 sum of the ranks' rows rounded once to the
dtype. Nothing else is compared: no tolerance anywhere."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from yali_vllm import ops
from yali_vllm.communicator import YaliCommunicator

from . import reliability
from .scenarios import _device, capture_after_warmup, digest, run_steps

SENTINEL = -2147450880  # 0x80008000 as an int32: an empty word of the push area
SENT_AS = -2147483648   # 0x80000000: how the dispatch delivers such a word
POISON_WORD = 0x7FC00BAD  # a NaN in fp32, and no value the checks expect
SEED_STRIDE = 16
SLOT_BYTES = 2 << 20  # the EP slot of the tests' communicators (YALI_EP_SLOT_BYTES's default)

# The tensors of a dispatch, as vLLM's MoE layers pass them: hidden states (bf16, or fp8 bytes with
# fp32 block scales), top-k weights (fp32) and ids (int32 or int64), an odd-sized extra.
PART_SETS = {
    "bf16-topk8": [(torch.bfloat16, (2048,)), (torch.float32, (8,)), (torch.int32, (8,))],
    "fp8-scales-topk6": [(torch.float8_e4m3fn, (2048,)), (torch.float32, (16,)), (torch.float32, (6,)),
                         (torch.int64, (6,))],
    "fp16-topk2-extra": [(torch.float16, (4096,)), (torch.float32, (2,)), (torch.int32, (2,)), (torch.int32, (3,))],
    "odd-rows": [(torch.float32, (5, 3)), (torch.bfloat16, (6,)), (torch.int32, (1,))],
}


def count_cases(world_size: int) -> dict[str, list[int]]:
    """Token counts per rank: equal (decode under CUDA graphs pads every rank alike), uneven, some
    ranks without tokens, and one rank only."""
    return {
        "1-each": [1] * world_size,
        "8-each": [8] * world_size,
        "128-each": [128] * world_size,
        "uneven": [7 + 6 * r for r in range(world_size)],
        "some-empty": [0 if r % 2 == 0 else 5 + r for r in range(world_size)],
        "one-rank": [0] * (world_size - 1) + [3],
    }


def _words(seed: int, n_words: int, device) -> torch.Tensor:
    """n_words random int32 words (every bit pattern), with every 97th the sentinel."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randint(-2 ** 31, 2 ** 31, (n_words,), generator=g, device=device, dtype=torch.int64).to(torch.int32)
    w[::97] = SENTINEL
    return w


def part_input(seed: int, rank: int, part: int, rows: int, dtype, shape, device) -> torch.Tensor:
    """Rank `rank`'s tensor `part` of the call `seed`: [rows, *shape] of random bits."""
    nbytes = rows * torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    w = _words((seed * SEED_STRIDE + rank) * 8 + part, nbytes // 4, device)
    return w.view(dtype).reshape(rows, *shape)


def gathered_reference(seed: int, counts: list[int], parts, device) -> list[torch.Tensor]:
    """What every rank's dispatch must return: each part of every rank in rank order, the sentinel
    words replaced."""
    out = []
    for i, (dtype, shape) in enumerate(parts):
        w = torch.cat([part_input(seed, r, i, n, dtype, shape, device).contiguous().view(torch.int32).reshape(-1)
                       for r, n in enumerate(counts)])
        w[w == SENTINEL] = SENT_AS
        out.append(w)
    return out


def _poisoned(rows: int, dtype, shape, device) -> torch.Tensor:
    t = torch.empty((rows, *shape), dtype=dtype, device=device)
    t.view(torch.int32).fill_(POISON_WORD)
    return t


def dispatch_sweep(rank, group, comm, seed):
    """Every part set x count case through ops.ep_dispatch into poisoned outputs, bitwise; the API
    (YaliCommunicator.ep_dispatch) once per part set; every rank's output bits equal."""
    dev = comm.device
    failures, digests, served = [], {}, 0
    for name, parts in PART_SETS.items():
        for case, counts in count_cases(comm.world_size).items():
            seed += 1
            ins = [part_input(seed, rank, i, counts[rank], d, s, dev) for i, (d, s) in enumerate(parts)]
            if not comm.ep_serves_dispatch(ins, counts):
                failures.append(f"{name} {case}: not served")
                continue
            total = sum(counts)
            outs = [_poisoned(total, d, s, dev) for d, s in parts]
            ops.ep_dispatch(comm._handle, ins, outs, counts)
            api = comm.ep_dispatch(ins, counts) if case == "uneven" else None
            comm.synchronize()
            served += 1
            ref = gathered_reference(seed, counts, parts, dev)
            for i, (o, r) in enumerate(zip(outs, ref)):
                bad = int((o.contiguous().view(torch.int32).reshape(-1) != r).sum())
                if bad:
                    failures.append(f"{name} {case} part {i}: {bad} words differ")
                if api is not None and not torch.equal(api[i].contiguous().view(torch.int32).reshape(-1), r):
                    failures.append(f"{name} {case} part {i}: the API's output differs")
            digests[f"{name} {case}"] = digest(*outs)
    return {"failures": failures, "served": served, "differing": differing(group, digests)}


def combine_input(seed: int, rank: int, rows: int, hidden: int, dtype, device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed * SEED_STRIDE + rank)
    return torch.randn(rows, hidden, generator=g, device=device, dtype=torch.float32).mul_(4).to(dtype)


def combine_reference(seed: int, counts: list[int], rank: int, hidden: int, dtype, device) -> torch.Tensor:
    """Rank `rank`'s rows of every rank's input, added in rank order in fp32, rounded once."""
    first = sum(counts[:rank])
    acc = None
    for r in range(len(counts)):
        x = combine_input(seed, r, sum(counts), hidden, dtype, device)[first:first + counts[rank]].float()
        acc = x if acc is None else acc + x
    return acc.to(dtype)


COMBINE_HIDDEN = (2048, 2880, 4096)
COMBINE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def combine_sweep(rank, group, comm, seed):
    """Every dtype x hidden x count case into poisoned outputs, bitwise against the rank-order sum."""
    dev = comm.device
    failures, served = [], 0
    for dtype in COMBINE_DTYPES:
        for hidden in COMBINE_HIDDEN:
            for case, counts in count_cases(comm.world_size).items():
                seed += 1
                x = combine_input(seed, rank, sum(counts), hidden, dtype, dev)
                if not comm.ep_serves_combine(x, counts):
                    failures.append(f"{dtype} {hidden} {case}: not served")
                    continue
                out = _poisoned(counts[rank], dtype, (hidden,), dev)
                ops.ep_combine(comm._handle, x, out, counts)
                comm.synchronize()
                served += 1
                ref = combine_reference(seed, counts, rank, hidden, dtype, dev)
                bad = int((out.view(torch.int32) != ref.view(torch.int32)).sum())
                if bad:
                    failures.append(f"{dtype} {hidden} {case}: {bad} words differ from the rank-order sum")
    return {"failures": failures, "served": served}


def limits(rank, group, comm):
    """The slot limit: the largest served message and the next one refused, on every rank alike;
    a refused call raises ValueError naming YALI_EP_SLOT_BYTES."""
    world = comm.world_size
    parts = PART_SETS["bf16-topk8"]
    row = 2048 * 2 + 8 * 4 + 8 * 4  # one token of the set: 4160 bytes, a multiple of 16
    cap = comm.ep_slot_bytes // row
    dev = comm.device

    def serves(tokens):
        counts = [tokens] * world
        ins = [part_input(1, rank, i, tokens, d, s, dev) for i, (d, s) in enumerate(parts)]
        return comm.ep_serves_dispatch(ins, counts), ins, counts

    at_cap, ins, counts = serves(cap)
    above, big, big_counts = serves(cap + 1)
    message = ""
    try:
        ops.ep_dispatch(comm._handle, big, [torch.empty((sum(big_counts), *t.shape[1:]), dtype=t.dtype, device=dev)
                                            for t in big], big_counts)
    except ValueError as e:
        message = str(e)
    x = torch.zeros(sum(counts), 2048, dtype=torch.bfloat16, device=dev)
    rows_cap = comm.ep_slot_bytes // (2048 * 2)
    byte_dtypes = {str(d): comm.ep_serves_dispatch([torch.zeros(2, 64, dtype=d, device=dev)], [2] * world)
                   for d in (torch.uint8, torch.int8, torch.int16)}
    wrong_rows = ""
    try:
        comm.ep_serves_dispatch([torch.zeros(3, 64, dtype=torch.bfloat16, device=dev)], [2] * world)
    except ValueError as e:
        wrong_rows = str(e)
    return {"cap": cap, "at_cap": at_cap, "above": above, "refusal": message, "byte_dtypes": byte_dtypes,
            "wrong_rows": wrong_rows,
            "combine_at_cap": comm.ep_serves_combine(torch.zeros(rows_cap * world, 2048, dtype=torch.bfloat16,
                                                                 device=dev), [rows_cap] * world),
            "combine_above": comm.ep_serves_combine(torch.zeros((rows_cap + 1) * world, 2048, dtype=torch.bfloat16,
                                                                device=dev), [rows_cap + 1] * world),
            "combine_odd_row": comm.ep_serves_combine(x[:, :2044], counts)}


GRAPH_LAYERS = 3


def graph_replays(rank, group, comm, replays, seed):
    """One CUDA graph of GRAPH_LAYERS x (dispatch, combine) at 4 tokens per rank, replayed with new
    inputs copied into its static buffers, every replay checked bitwise; an eager call of another
    size between replays."""
    dev = comm.device
    parts = PART_SETS["bf16-topk8"]
    counts = [4] * comm.world_size
    hidden = 2048
    static_in = [part_input(seed, rank, i, counts[rank], d, s, dev).clone() for i, (d, s) in enumerate(parts)]
    static_x = combine_input(seed, rank, sum(counts), hidden, torch.bfloat16, dev).clone()
    results: list = []

    def body():
        results.clear()
        for _ in range(GRAPH_LAYERS):
            results.append((comm.ep_dispatch(static_in, counts), comm.ep_combine(static_x, counts)))

    graph = capture_after_warmup(body, dev)
    failures = []
    for rep in range(replays):
        s = seed + 1 + rep
        for i, (d, sh) in enumerate(parts):
            static_in[i].copy_(part_input(s, rank, i, counts[rank], d, sh, dev))
        static_x.copy_(combine_input(s, rank, sum(counts), hidden, torch.bfloat16, dev))
        graph.replay()
        if rep % 7 == 3:  # an eager call of another size between two replays
            other = [5] * comm.world_size
            comm.ep_combine(combine_input(s, rank, sum(other), hidden, torch.bfloat16, dev), other)
        comm.synchronize()
        ref = gathered_reference(s, counts, parts, dev)
        want = combine_reference(s, counts, rank, hidden, torch.bfloat16, dev)
        for layer, (gathered, combined) in enumerate(results):
            for i, (o, r) in enumerate(zip(gathered, ref)):
                if not torch.equal(o.contiguous().view(torch.int32).reshape(-1), r):
                    failures.append(f"replay {rep} layer {layer} dispatch part {i} differs")
            if not torch.equal(combined.view(torch.int16), want.view(torch.int16)):
                failures.append(f"replay {rep} layer {layer} combine differs")
    return {"failures": failures, "replays": replays}


def ep_suite(rank, group, replays, seed):
    """The dispatch sweep, the combine sweep, the limits and the CUDA graph on one communicator."""
    comm = YaliCommunicator(group, _device(), ep_slot_bytes=SLOT_BYTES)
    return run_steps(comm, group, [
        ("dispatch", lambda: dispatch_sweep(rank, group, comm, seed)),
        ("combine", lambda: combine_sweep(rank, group, comm, seed + 10_000)),
        ("limits", lambda: limits(rank, group, comm)),
        ("moe", lambda: moe_layer(rank, group, comm, seed + 30_000)),
        ("graph", lambda: graph_replays(rank, group, comm, replays, seed + 20_000)),
    ])


def differing(group, digests: dict[str, str]) -> list[str]:
    """The checks whose output bits differ between this rank and some other rank."""
    got: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(got, digests, group=group)
    return sorted(k for k in digests if any(g.get(k) != digests[k] for g in got))


def mismatched_counts(rank, group, wait_s):
    """After one good combine, rank 0 combines with counts that differ from every other rank's (the
    same tensor sizes on rank 0's side): every rank must record a YALI abort and raise YaliError
    within `wait_s` seconds, not hang, nor return a wrong sum."""
    dev = _device()
    comm = YaliCommunicator(group, dev, ep_slot_bytes=SLOT_BYTES)
    world = comm.world_size
    counts = [4] * world
    x = combine_input(3, rank, sum(counts), 2048, torch.bfloat16, dev)
    good = comm.ep_combine(x, counts)
    comm.synchronize()
    ok = torch.equal(good.view(torch.int16), combine_reference(3, counts, rank, 2048, torch.bfloat16, dev).view(torch.int16))
    dist.barrier(group)
    t0 = time.time()
    theirs = [4] * world if rank == 0 else [5] + [4] * (world - 2) + [3]
    comm.ep_combine(x, theirs)
    return {"good_call_ok": ok, **reliability._record_then_error(comm, t0, wait_s)}


# ------------------------------------------------------------------ a whole MoE layer
MOE_EXPERTS, MOE_TOPK, MOE_HIDDEN, MOE_INTER = 16, 4, 256, 128


def _expert_weights(device):
    """Every expert's (up [I, H], down [H, I]) in bf16, from one seed: the same on every rank."""
    g = torch.Generator(device=device).manual_seed(4242)
    up = (torch.randn(MOE_EXPERTS, MOE_INTER, MOE_HIDDEN, generator=g, device=device) / MOE_HIDDEN ** 0.5)
    down = (torch.randn(MOE_EXPERTS, MOE_HIDDEN, MOE_INTER, generator=g, device=device) / MOE_INTER ** 0.5)
    router = torch.randn(MOE_EXPERTS, MOE_HIDDEN, generator=g, device=device) / MOE_HIDDEN ** 0.5
    return up.to(torch.bfloat16), down.to(torch.bfloat16), router.to(torch.bfloat16)


def _route(h, router):
    """Top-k expert ids (int32) and renormalised weights (fp32) of tokens h, as vLLM's fused_topk."""
    probs = torch.softmax((h.float() @ router.float().t()), dim=-1)
    w, ids = probs.topk(MOE_TOPK, dim=-1)
    return (w / w.sum(-1, keepdim=True)).float(), ids.to(torch.int32)


def _experts(h, w, ids, experts: range, up, down):
    """sum over the top-k slots whose expert is in `experts` of weight x down(silu(up(h))), in fp32,
    rounded to bf16: what a rank's local experts contribute to each token (vLLM's partial sums)."""
    out = torch.zeros(h.shape[0], MOE_HIDDEN, dtype=torch.float32, device=h.device)
    for e in experts:
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel():
            y = torch.nn.functional.silu(h[tok].float() @ up[e].float().t()) @ down[e].float().t()
            out.index_add_(0, tok, y * w[tok, slot].unsqueeze(1))
    return out.to(torch.bfloat16)


def moe_layer(rank, group, comm, seed):
    """Router -> YALI dispatch -> this rank's experts (E / N of them) on every gathered token ->
    YALI combine, for uneven token counts; against (a) the same pipeline with the gather and the sum
    done by torch from every rank's regenerated inputs (bitwise: YALI's semantics are vLLM's
    manager's), and (b) one process running every expert on its own tokens (within the bf16
    rounding of the ranks' partial sums, of their sum and of the reference)."""
    dev = comm.device
    world = comm.world_size
    up, down, router = _expert_weights(dev)
    mine = range(rank * MOE_EXPERTS // world, (rank + 1) * MOE_EXPERTS // world)
    failures = []
    for case, counts in {"uneven": [3 + 5 * r for r in range(world)], "decode": [1] * world,
                         "some-empty": [0 if r % 2 else 6 for r in range(world)]}.items():
        seed += 1
        hs = [combine_input(seed, r, counts[r], MOE_HIDDEN, torch.bfloat16, dev) for r in range(world)]
        routed = [_route(h, router) for h in hs]
        w, ids = routed[rank]
        gh, gw, gids = comm.ep_dispatch([hs[rank], w, ids], counts)
        partial = _experts(gh, gw, gids, mine, up, down)
        got = comm.ep_combine(partial, counts)
        comm.synchronize()
        # (a) the AgRs pipeline in torch: gather by concatenation, sum in rank order in fp32
        all_h, all_w, all_ids = (torch.cat(x) for x in zip(*[(h, *rw) for h, rw in zip(hs, routed)]))
        if not (torch.equal(gh, all_h) and torch.equal(gw, all_w) and torch.equal(gids, all_ids)):
            failures.append(f"{case}: the dispatch differs from the concatenated inputs")
        first = sum(counts[:rank])
        acc, mag = None, 0.0
        for r in range(world):
            rr = range(r * MOE_EXPERTS // world, (r + 1) * MOE_EXPERTS // world)
            p = _experts(all_h, all_w, all_ids, rr, up, down)[first:first + counts[rank]].float()
            acc, mag = (p if acc is None else acc + p), mag + p.abs()
        if not torch.equal(got, acc.to(torch.bfloat16)):
            failures.append(f"{case}: the combine differs from the rank-order sum of the ranks' partial sums")
        # (b) every expert in one process on this rank's tokens
        whole = _experts(hs[rank], w, ids, range(MOE_EXPERTS), up, down).float()
        # each rank's partial sum is rounded to bf16 (2^-8 of it), the sum once more, the reference once
        tol = 2 ** -8 * (mag + 2 * whole.abs()) + 1e-6
        if counts[rank] and bool(((got.float() - whole).abs() > tol).any()):
            failures.append(f"{case}: the layer's output is off the single-process MoE by more than bf16 rounding")
    return {"failures": failures}


def skipped_call(rank, group, wait_s):
    """After one good combine, every rank but 0 skips the next one: rank 0 must end in a YaliError
    naming the wait within YALI_TIMEOUT_S plus a margin (`wait_s`), not hang; the others return."""
    dev = _device()
    comm = YaliCommunicator(group, dev, ep_slot_bytes=SLOT_BYTES)
    counts = [4] * comm.world_size
    x = combine_input(9, rank, sum(counts), 2048, torch.bfloat16, dev)
    comm.ep_combine(x, counts)
    comm.synchronize()
    dist.barrier(group)
    if rank != 0:
        dist.barrier(group)  # the others stay (and keep their buffers mapped) until rank 0 has its error
        return {"skipped": True}
    t0 = time.time()
    comm.ep_combine(x, counts)
    res = {"skipped": False, **reliability._record_then_error(comm, t0, wait_s)}
    dist.barrier(group)
    return res
