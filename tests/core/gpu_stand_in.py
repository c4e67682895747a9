"""Stand-ins for the GPU-only parts of a YaliCommunicator, so that a live one runs in a spawned gloo
rank on a machine without a GPU.

Stood in (GPU-only): the CUDA runtime queries (devices, their UUIDs, peer access, synchronize,
stream capture); the library's handle ops (create, CUDA IPC handles, peer mapping, buffers, the
abort record, the EP size checks, which mirror csrc/core/yali/ep/ep.cu); the kernels (all-reduce, EP
dispatch and combine), as gloo collectives over the communicator's group; and the GPU's memory: a
communicator's tensors live on the CPU (its device becomes the CPU before its self-test, which
then runs as written). Real: every decision and exchange of yali_vllm, the library's settings and
size table (config_string, plan, plan_table, fused_plan, build_info), torch.distributed over gloo.

install() patches the current process only: call it inside a spawned rank. A rank can be made to
fail one step (FAIL_STEPS) to check that every rank of the group still ends alike."""
from __future__ import annotations

import types

import torch
import torch.distributed as dist

# Steps a rank can be made to fail: the library's create, the mapping of the other ranks' buffers,
# the self-test's kernel (wrong values), and the buffer query that follows every exchange.
FAIL_STEPS = ("create", "open_peer", "self_test", "buffer_bytes")
IPC_BYTES = 64


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


class StandInLibrary:
    """torch.ops.yali as yali_vllm._ext.ops() returns it: the handle ops stood in, the rest real."""

    def __init__(self, real, groups: dict, fail: str | None):
        self._real = real
        self.groups = groups  # world size -> this rank's gloo group of that size
        self.fail = fail
        self.comms: dict[int, dict] = {}

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def _check(self, step: str) -> None:
        if self.fail == step:
            raise RuntimeError(f"yali: {step} failed on this rank (stand-in failure)")

    def create(self, device: int, rank: int, world: int = 2, ep_slot_bytes: int = 0) -> int:
        self._check("create")
        handle = len(self.comms) + 1
        self.comms[handle] = {"rank": rank, "world": world, "ep_slot": ep_slot_bytes, "mapped": set(),
                              "group": self.groups[world], "destroyed": False}
        return handle

    def ipc_handle(self, handle: int) -> list[int]:
        c = self.comms[handle]
        return [c["rank"], handle] + [0] * (IPC_BYTES - 2)

    def open_peer(self, handle: int, peer: list[int], peer_rank: int = -1) -> None:
        self._check("open_peer")
        if len(peer) != IPC_BYTES or peer[0] != peer_rank:
            raise ValueError(f"open_peer: the handle of rank {peer[0]} given as rank {peer_rank}'s")
        self.comms[handle]["mapped"].add(peer_rank)

    def close_peer(self, handle: int) -> None:
        self.comms[handle]["mapped"].clear()

    def destroy(self, handle: int) -> None:
        self.comms[handle]["destroyed"] = True

    def buffer_bytes(self, handle: int) -> int:
        self._check("buffer_bytes")
        return int(self._real.shared_bytes_for_env(self.comms[handle]["world"]))

    def abort_message(self, handle: int) -> str:
        return ""

    def ep_slot_bytes(self, handle: int) -> int:
        return self.comms[handle]["ep_slot"]

    def ep_serves_dispatch(self, handle: int, row_bytes: list[int], counts: list[int]) -> bool:
        c = self._counts(handle, counts)
        if c["ep_slot"] == 0 or not 1 <= len(row_bytes) <= 8 or any(b <= 0 or b % 4 for b in row_bytes):
            return False
        return all(sum(_round16(n * b) for b in row_bytes) <= c["ep_slot"] for n in counts)

    def ep_serves_combine(self, handle: int, hidden: int, dtype: torch.dtype, counts: list[int]) -> bool:
        c = self._counts(handle, counts)
        row = hidden * torch.empty((), dtype=dtype).element_size()
        if c["ep_slot"] == 0 or hidden <= 0 or row % 16:
            return False
        return all(n * row <= c["ep_slot"] for n in counts)

    def _counts(self, handle: int, counts: list[int]) -> dict:
        c = self.comms[handle]
        if len(counts) != c["world"]:
            raise ValueError(f"counts must give the tokens of each of the {c['world']} ranks, got {len(counts)}")
        return c

    # ---------------------------------------------------------------- kernels (gloo)
    def connected(self, handle: int) -> dict:
        """The communicator behind `handle`, once every other rank's buffer is mapped (a kernel
        launched before would wait for the peers' flags)."""
        c = self.comms[handle]
        missing = sorted(set(range(c["world"])) - {c["rank"]} - c["mapped"])
        if c["destroyed"] or missing:
            raise RuntimeError(f"stand-in kernel: rank {c['rank']} has not mapped the buffers of ranks {missing}")
        return c

    def all_reduce(self, handle: int, x: torch.Tensor, out: torch.Tensor | None = None, mode: int = -1):
        c = self.connected(handle)
        nbytes = x.numel() * x.element_size()
        if nbytes and int(self._real.plan(nbytes, mode, c["world"])[0]) == 0:
            raise ValueError(f"yali: a {nbytes}-byte all-reduce is not served in this mode; check should_use() first")
        total = x.detach().clone()
        dist.all_reduce(total, group=c["group"])
        if self.fail == "self_test":
            total += 1
        out = torch.empty_like(x) if out is None else out
        return out.copy_(total)

    def ep_dispatch(self, handle: int, inputs: list, outputs: list, counts: list[int]) -> None:
        c = self.connected(handle)
        if not self.ep_serves_dispatch(handle, [_row(t) for t in inputs], counts):
            raise ValueError("yali: ep_dispatch is not served; check ep_serves_dispatch first")
        top = max(counts)
        for t, out in zip(inputs, outputs):
            padded = torch.zeros((top, *t.shape[1:]), dtype=t.dtype)
            padded[: t.shape[0]] = t
            got = [torch.empty_like(padded) for _ in range(c["world"])]
            dist.all_gather(got, padded, group=c["group"])
            out.copy_(torch.cat([g[:n] for g, n in zip(got, counts)]))

    def ep_combine(self, handle: int, x: torch.Tensor, out: torch.Tensor, counts: list[int]) -> None:
        c = self.connected(handle)
        if not self.ep_serves_combine(handle, int(x.shape[1]), x.dtype, counts):
            raise ValueError("yali: ep_combine is not served; check ep_serves_combine first")
        first, mine = sum(counts[: c["rank"]]), counts[c["rank"]]
        lo, hi = x.data_ptr(), x.data_ptr() + x.nbytes
        if out.nbytes and out.data_ptr() < hi and lo < out.data_ptr() + out.nbytes:
            raise ValueError("yali: ep_combine's out overlaps its input")  # as the C++ op refuses it
        total = x.detach().float().clone()
        dist.all_reduce(total, group=c["group"])
        out.copy_(total[first:first + mine].to(x.dtype))


def _row(t: torch.Tensor) -> int:
    n = t.element_size()
    for d in t.shape[1:]:
        n *= int(d)
    return n


def _index(device) -> int:
    return device if isinstance(device, int) else (torch.device(device).index or 0)


def install(groups: dict, gpus: int, fail: str | None = None) -> StandInLibrary:
    """Patches this process: `gpus` stand-in GPUs with peer access between all, the library's
    handle ops and kernels over `groups` (world size -> gloo group), and `fail` (one of FAIL_STEPS,
    or None) failing on this rank. Returns the stand-in library."""
    from yali_vllm import _ext, communicator, ops

    if fail is not None and fail not in FAIL_STEPS:
        raise ValueError(f"fail must be one of {FAIL_STEPS}, got {fail!r}")
    lib = StandInLibrary(_ext.ops(), groups, fail)
    _ext.ops = lambda: lib
    _ext.unavailable_reason = lambda: None
    for name in ("all_reduce", "ep_dispatch", "ep_combine"):
        setattr(ops, name, getattr(lib, name))
    torch.cuda.device_count = lambda: gpus
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_properties = lambda d: types.SimpleNamespace(uuid=f"stand-in-gpu-{_index(d)}")
    torch.cuda.can_device_access_peer = lambda a, b: True
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.is_current_stream_capturing = lambda: False
    self_test = communicator.YaliCommunicator._self_test

    def self_test_on_the_cpu(comm) -> None:
        comm.gpu_device = comm.device  # the device the communicator chose; its tensors live on the CPU
        comm.device = torch.device("cpu")
        self_test(comm)

    communicator.YaliCommunicator._self_test = self_test_on_the_cpu
    return lib
