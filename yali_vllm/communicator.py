"""YaliCommunicator: an all-reduce over NVLink for 2, 4, 6 or 8 ranks of one node, built over a
torch.distributed CPU group. It allocates its buffers once, exchanges CUDA IPC handles with the
other ranks once, and from then on every call is a single kernel launch on the current stream
(CUDA-graph safe: fixed addresses, all sequence state advanced on the device).
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

from . import _ext, config, ops

logger = logging.getLogger("yali_vllm")

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The dtypes ep_dispatch carries: those in which the one 32-bit word it cannot send as it is
# (0x80008000, csrc/core/yali/ep/ep.cuh) is a pair of zeros, four fp8 zeros, an fp32 denormal or no
# valid token or expert index. Bytes of other meanings (uint8-packed fp4 with e8m0 scales, int8,
# int16) go to vLLM's manager.
EP_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2, torch.int32,
             torch.int64)


def servable(x, device: torch.device, limit_bytes: int) -> bool:
    """The input checks behind should_use(): a dense, contiguous fp32/fp16/bf16 tensor on `device`
    that needs no gradient, with 0 < bytes <= limit_bytes.

    Only facts every rank shares for the same call (dtype, shape, layout, settings): never the
    address, so both ranks of a group always route a call alike (YALI on one rank and vLLM's chain
    on the other would wait for each other). An input that is not 16-byte aligned is served
    through an aligned copy (aligned())."""
    if not isinstance(x, torch.Tensor) or x.is_nested or x.layout != torch.strided:
        return False
    nbytes = x.numel() * x.element_size()
    return (
        x.dtype in SUPPORTED_DTYPES
        and x.device == device
        and not x.requires_grad
        and 0 < nbytes <= limit_bytes
        and x.is_contiguous()
    )


def _unaligned(*tensors) -> bool:
    """Whether any given tensor starts off a 16-byte boundary. False while torch.compile traces
    (addresses exist only at run time; the op then checks them itself)."""
    if torch.compiler.is_compiling():
        return False
    return any(t is not None and t.data_ptr() % 16 for t in tensors)


def aligned(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t`, or a contiguous copy of it when its address is not a multiple of 16 bytes (the kernels
    move 16-byte vectors). Fresh allocations of torch's allocators are aligned."""
    if t is None or t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


# Both ranks on one GPU (two processes, one device, the same CUDA IPC exchange): lets the kernels'
# two-rank protocol be tested on a machine with a single GPU. Off by default: in serving two ranks
# on one GPU are a misconfiguration, and the memory in between is local, not NVLink.
SHARED_GPU_VAR = "YALI_ALLOW_SHARED_GPU"


def ranges_overlap(x: int, nx: int, y: int, ny: int) -> bool:
    """Whether the byte ranges [x, x + nx) and [y, y + ny) share a byte (an empty range shares none)."""
    return nx > 0 and ny > 0 and x < y + ny and y < x + nx


def partly_overlap(x: int, nx: int, y: int, ny: int) -> bool:
    """Whether two byte ranges share a byte without being the same range. An all-reduce's `out` may
    be its input (in place) or apart from it, never in between: the kernels read the input again
    after other CTAs wrote their part of `out` (csrc/core/yali/common/overlap.h, the same rule)."""
    return ranges_overlap(x, nx, y, ny) and not (x == y and nx == ny)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes of contiguous tensors a and b overlap."""
    return ranges_overlap(a.data_ptr(), a.nbytes, b.data_ptr(), b.nbytes)


def out_overlap_refusal(x: torch.Tensor, out: torch.Tensor | None) -> str | None:
    """Why `out` cannot receive the all-reduce of `x` (a view that overlaps x without being x), or
    None. Unknown while torch.compile traces (addresses exist only at run time; the op checks)."""
    if out is None or torch.compiler.is_compiling():
        return None
    if partly_overlap(x.data_ptr(), x.nbytes, out.data_ptr(), out.nbytes):
        return ("yali: out must be x itself or not overlap it (the kernels read x again after other CTAs "
                "wrote out: a shifted view would give a wrong sum)")
    return None


def _row_bytes(t: torch.Tensor) -> int:
    """Bytes of one row (index of dim 0) of t."""
    n = t.element_size()
    for d in t.shape[1:]:
        n *= int(d)
    return n


def shared_gpu_allowed() -> bool:
    """True when YALI_ALLOW_SHARED_GPU=1; a value other than 0 or 1 is refused (settings.def)."""
    return config.setting(SHARED_GPU_VAR) == 1


class YaliUnavailable(RuntimeError):
    """YALI cannot serve this group; the message says why. Callers fall back."""


class YaliError(RuntimeError):
    """A YALI kernel gave up: its watchdog (YALI_TIMEOUT_S) expired, or the two ranks issued
    different calls. The message names the kernel, what it waited for and both ranks' calls. The
    kernel trapped, so this process's CUDA context is lost: the process must restart."""


# How often the abort watcher looks at the host-mapped abort records (no CUDA call, no GIL held
# while it sleeps).
ABORT_POLL_S = 0.2
# A process whose YALI kernel gave up ends this long after the abort record appeared, unless the
# host raised YaliError for it first: a trap that does not reach the host (seen with the ranks
# sharing one GPU) would leave torch.cuda.synchronize() waiting forever. YALI_ABORT_EXIT=0 keeps
# the process (tests that inspect the state afterwards).
ABORT_EXIT_GRACE_S = 10.0
ABORT_EXIT_CODE = 70  # EX_SOFTWARE: an internal error ended the process
# close(): how long a rank waits for its peer to reach close() before it gives up coordinating.
CLOSE_TIMEOUT_S = 10.0


def abort_exit_due(seen_at: float | None, now: float, raised: bool, grace_s: float = ABORT_EXIT_GRACE_S) -> bool:
    """Whether the abort watcher ends the process at `now`: an abort record first seen at `seen_at`
    (seconds on the same clock; None: none seen), no YaliError raised for it, and `grace_s` passed."""
    return seen_at is not None and not raised and now - seen_at >= grace_s


@dataclasses.dataclass
class _Watched:
    """One communicator the abort watcher looks at."""
    rank: int
    end_process: bool  # YALI_ABORT_EXIT
    seen_at: float | None = None  # when its abort record was first seen (time.monotonic())
    message: str = ""
    raised: bool = False  # the host raised YaliError for it


class _AbortWatcher:
    """One daemon thread per process that looks at the abort record of every open communicator
    every ABORT_POLL_S (host-mapped: no CUDA call, it works on a lost context). When a record
    appears, the thread logs the reason at once ("YALI error: ..."), before anything in the process
    trips over the lost CUDA context (which only says "unspecified launch failure"). grace_s later,
    unless the host raised YaliError for it (raise_if_aborted), it ends the process with
    ABORT_EXIT_CODE and one log line naming the reason, as PyTorch's NCCL watchdog does
    (TORCH_NCCL_ASYNC_ERROR_HANDLING). The thread starts with the first communicator and stops when
    the last one closes. `read(handle)` is the record's message ("" while there is none)."""

    def __init__(self, grace_s: float = ABORT_EXIT_GRACE_S, read=None):
        self._grace_s = grace_s
        self._read = read or (lambda handle: _ext.ops().abort_message(handle))
        self._lock = threading.Lock()
        self._watched: dict[int, _Watched] = {}
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def add(self, handle: int, rank: int, end_process: bool) -> None:
        with self._lock:
            self._watched[handle] = _Watched(rank, end_process)
            if self._thread is None:
                self._stop = threading.Event()
                self._thread = threading.Thread(target=self._run, args=(self._stop,), name="yali-abort-watch",
                                                daemon=True)
                self._thread.start()

    def remove(self, handle: int) -> None:
        with self._lock:
            self._watched.pop(handle, None)
            if self._watched or self._thread is None:
                return
            thread, stop = self._thread, self._stop
            self._thread = self._stop = None
        stop.set()
        if thread is not threading.current_thread():
            thread.join(timeout=5 * ABORT_POLL_S + 1)

    def note_raised(self, handle: int) -> None:
        """The host raised YaliError for `handle`'s abort: the caller knows, the process may stay."""
        with self._lock:
            w = self._watched.get(handle)
            if w is not None:
                w.raised = True

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(ABORT_POLL_S):
            self.poll(time.monotonic())

    def poll(self, now: float) -> None:
        """One look at every communicator's record, at time `now`."""
        with self._lock:
            watched = list(self._watched.items())
        for handle, w in watched:
            if w.seen_at is None:
                try:
                    w.message = self._read(handle)
                except RuntimeError:  # closed meanwhile
                    continue
                if not w.message:
                    continue
                w.seen_at = now
                logger.error("YALI error: %s", w.message)
            if w.end_process and abort_exit_due(w.seen_at, now, w.raised, self._grace_s):
                _end_process(w, now)

    def watching(self) -> bool:
        return self._thread is not None


def _end_process(w: _Watched, now: float) -> None:
    """Ends this process (ABORT_EXIT_CODE) with one log line naming the abort (see _AbortWatcher)."""
    logger.critical("yali: rank %d ends this process (exit code %d): a YALI kernel gave up %.0f s ago and no "
                    "YaliError reached the caller (%s=0 keeps the process): %s", w.rank, ABORT_EXIT_CODE,
                    now - w.seen_at, config.ABORT_EXIT_VAR, w.message)
    for h in [*logger.handlers, *logging.getLogger().handlers]:
        try:
            h.flush()
        except Exception:  # noqa: BLE001 - the process ends either way
            pass
    sys.stderr.flush()
    os._exit(ABORT_EXIT_CODE)


# The process's abort watcher (one thread for every communicator).
_WATCHER = _AbortWatcher()


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def _size(n: int) -> str:
    """Bytes in the largest binary unit that divides them (B, KiB, MiB)."""
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _serve_limit(table: dict, max_bytes: int) -> int:
    """The largest message the communicator serves: the size table's (config.plan_table: the end of
    its last all-reduce band, e.g. the N-rank kernels' limit, or the flash buffer in flash-only
    mode) or max_bytes, whichever is lower."""
    return min(max_bytes, int(table["limits"]["serve_max"]))


def _check_same_everywhere(peers: list) -> None:
    """Every rank on one node, with the same YALI_* settings (raises YaliUnavailable naming the
    first rank that differs from rank 0)."""
    first = peers[0]
    for r, d in enumerate(peers[1:], start=1):
        if (d["host"], d["boot_id"]) != (first["host"], first["boot_id"]):
            raise YaliUnavailable(f"ranks are on different nodes (rank 0 on {first['host']}, rank {r} on {d['host']})")
        if d["config"] != first["config"]:
            raise YaliUnavailable(f"the ranks' YALI_* settings differ: rank 0 [{first['config']}] vs rank {r} "
                                  f"[{d['config']}]")
        if d.get("ep_slot_bytes") != first.get("ep_slot_bytes"):
            raise YaliUnavailable(f"the ranks' EP slot sizes differ: rank 0 {first.get('ep_slot_bytes')} vs rank {r} "
                                  f"{d.get('ep_slot_bytes')} (YALI_EP_SLOT_BYTES)")


def nvlink_between(a: int, b: int) -> bool | None:
    """Whether NVML reports an NVLink path between visible GPUs `a` and `b`; None when NVML cannot
    tell (no pynvml, no driver access): the caller then relies on peer access alone."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            ha, hb = (pynvml.nvmlDeviceGetHandleByUUID(_nvml_uuid(i)) for i in (a, b))
            return pynvml.nvmlDeviceGetP2PStatus(ha, hb, pynvml.NVML_P2P_CAPS_INDEX_NVLINK) == pynvml.NVML_P2P_STATUS_OK
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - any NVML failure means "cannot tell"
        return None


def _nvml_uuid(index: int) -> str:
    """NVML's name of visible GPU `index` ("GPU-<uuid>"): CUDA's index is not NVML's under
    CUDA_VISIBLE_DEVICES."""
    return "GPU-" + str(torch.cuda.get_device_properties(index).uuid)


class YaliCommunicator:
    """All-reduce among the ranks of `group` (a gloo/CPU process group).

    Raises YaliUnavailable when the group is not 2, 4, 6 or 8 ranks (config.WORLD_SIZES) on one
    node with P2P access between every pair (and NVLink between every pair above two ranks), or
    the extension/GPU is missing, or the ranks' YALI_* settings differ. `max_bytes` caps the
    message size served (default: the configured YALI_MAX_BYTES; above two ranks also
    YALI_DEV_RANKS_MAX, beyond which vLLM's chain is faster). `ep_slot_bytes` > 0 adds the
    expert-parallel dispatch and combine (ep_dispatch, ep_combine; csrc/core/yali/ep/ep.cuh), each
    rank's message up to that many bytes (yali_vllm.ep reads it from YALI_EP_SLOT_BYTES).
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device | int | str, max_bytes: int | None = None,
                 ep_slot_bytes: int = 0):
        self._handle: int | None = None
        self._watcher: _AbortWatcher | None = None  # the process's, once this communicator is watched
        # Set once a CUDA graph captured one of this communicator's kernels: the graph holds its
        # buffers' addresses, so the buffers must outlive it (see the plugin's checkpoint hook).
        self.captured = False
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        refusal = config.world_size_refusal(self.world_size)
        if refusal:
            raise YaliUnavailable(refusal)
        # Every step that can fail on one rank only is followed by an exchange of
        # the outcome, so both ranks raise together and neither is left waiting
        # in a collective the other will never enter: up to the first exchange,
        # any rank-local error (a bad device argument included) is only recorded.
        self.ep_slot_bytes = int(ep_slot_bytes)
        me = {"host": socket.gethostname(), "boot_id": _boot_id(), "error": _ext.unavailable_reason(),
              "ep_slot_bytes": self.ep_slot_bytes}
        try:
            device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
            if device.type != "cuda":
                me["error"] = me["error"] or f"device {device} is not a CUDA device"
            if me["error"] is None:
                index = device.index if device.index is not None else torch.cuda.current_device()
                if not 0 <= index < torch.cuda.device_count():
                    raise ValueError(f"device cuda:{index} does not exist ({torch.cuda.device_count()} visible)")
                self.device = torch.device("cuda", index)
                me["uuid"] = str(torch.cuda.get_device_properties(self.device).uuid)
                config.check_environment()
                self._end_on_abort = config.env_flag(config.ABORT_EXIT_VAR)
                me["config"] = _ext.ops().config_string()  # raises ValueError naming a bad YALI_* variable
        except Exception as e:
            me["error"] = f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)
        peers = self._exchange(me)
        _check_same_everywhere(peers)
        self.config = config.parse_config_string(me["config"])
        self.max_bytes = int(self.config["max_bytes"] if max_bytes is None else min(max_bytes, self.config["max_bytes"]))
        if self.world_size > 2 and self.config["mode"] == "stream":
            raise YaliUnavailable(f"YALI_KERNEL_MODE=stream: there is no stream kernel for {self.world_size} ranks "
                                  f"(auto or flash pick push one-shot / two-shot)")
        # The library's size table under these settings (the same on every rank: the settings are).
        self.table = config.plan_table(self.world_size)
        self._serve_limit = _serve_limit(self.table, self.max_bytes)

        y = _ext.ops()
        ops.register_fakes()
        step: dict = {"error": None}
        try:
            self._check_p2p([d["uuid"] for d in peers])
            self._handle = y.create(self.device.index, self.rank, self.world_size, self.ep_slot_bytes)
            step["ipc"] = bytes(y.ipc_handle(self._handle))
        except Exception as e:
            step["error"] = f"{type(e).__name__}: {e}"
        try:
            steps = self._exchange(step)
            opened: dict = {"error": None}
            try:
                for r, peer in enumerate(steps):
                    if r != self.rank:
                        y.open_peer(self._handle, list(peer["ipc"]), r)
            except Exception as e:
                opened["error"] = f"cannot map another rank's buffer: {e}"
            self._exchange(opened)  # every rank zeroed its flags and mapped every other rank's buffer
            self._self_test()
        except Exception:
            if self._handle is None:  # this rank's create failed: it joins the others' close()
                join_close(self.group, self.world_size)
            else:
                self.close()
            raise
        self.buffer_bytes = int(y.buffer_bytes(self._handle))
        self._watcher = _WATCHER
        self._watcher.add(self._handle, self.rank, self._end_on_abort)
        logger.info("yali: rank %d %s", self.rank, self.describe())

    def _exchange(self, mine: dict) -> list:
        """all_gather of a small dict; raises YaliUnavailable on every rank if any rank reported an error."""
        got: list = [None] * self.world_size
        dist.all_gather_object(got, mine, group=self.group)
        errors = [f"rank {r}: {d['error']}" for r, d in enumerate(got) if d.get("error")]
        if errors:
            raise YaliUnavailable("; ".join(errors))
        return got

    def _check_p2p(self, uuids: list[str]) -> None:
        """Peer access from this rank's GPU to every other rank's, and above two ranks an NVLink
        between them (every rank checks its own row: together every pair). A GPU not visible in
        this process is checked by the IPC mapping and the self-test instead."""
        visible = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
        shared_warned = False
        for r, uuid in enumerate(uuids):
            i = visible.get(uuid)
            if r == self.rank or i is None:
                continue
            if i == self.device.index:
                if not shared_gpu_allowed():
                    raise YaliUnavailable(f"ranks {self.rank} and {r} use the same GPU ({self.device}); "
                                          f"{SHARED_GPU_VAR}=1 allows it for testing")
                if not shared_warned:
                    logger.warning("yali: rank %d shares %s with another rank (%s=1): a test of the kernels' "
                                   "protocol, not an NVLink all-reduce; its timings mean nothing",
                                   self.rank, self.device, SHARED_GPU_VAR)
                    shared_warned = True
                continue
            if not torch.cuda.can_device_access_peer(self.device.index, i):
                raise YaliUnavailable(f"no P2P access from cuda:{self.device.index} to cuda:{i} (rank {r})")
            if self.world_size > 2 and nvlink_between(self.device.index, i) is False:
                raise YaliUnavailable(f"cuda:{self.device.index} and cuda:{i} (rank {r}) are not connected by "
                                      f"NVLink: above two ranks YALI needs NVLink between every pair of GPUs")

    def _self_test(self) -> None:
        """One small all-reduce with known values: proves every mapping works."""
        x = torch.full((1024,), float(self.rank + 1), dtype=torch.float32, device=self.device)
        out = self.all_reduce(x)
        torch.cuda.synchronize(self.device)
        expected = self.world_size * (self.world_size + 1) / 2
        ok = torch.tensor([int(bool((out == expected).all()))], dtype=torch.int32)
        dist.all_reduce(ok, group=self.group, op=dist.ReduceOp.MIN)
        if not ok.item():
            raise YaliUnavailable("self-test all-reduce over the peer mapping gave wrong values (P2P broken?)")

    # ------------------------------------------------------------------ calls
    @property
    def serve_limit(self) -> int:
        """The largest message in bytes that all_reduce and the fused op serve (vLLM's chain takes larger ones)."""
        return self._serve_limit

    def should_use(self, x: torch.Tensor) -> bool:
        """True when all_reduce(x) is served by YALI (else the caller falls back)."""
        return self._handle is not None and servable(x, self.device, self._serve_limit)

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor | None = None, mode: str = "config") -> torch.Tensor:
        """Sum of x over both ranks (a new tensor, or `out`, which may be x for in-place).

        Raises ValueError/TypeError/RuntimeError naming the problem for inputs
        should_use() refuses. `mode` ("auto", "flash", "stream") forces a kernel
        family for this call; both ranks must pass the same.
        """
        if self._handle is None:
            raise RuntimeError("yali: all_reduce on a closed YaliCommunicator")
        refusal = out_overlap_refusal(x, out)
        if refusal:
            raise ValueError(refusal)
        self._note_capture()
        if _unaligned(x, out):
            staged = ops.all_reduce(self._handle, aligned(x), None, config.MODES[mode])
            return staged if out is None else out.copy_(staged)
        return ops.all_reduce(self._handle, x, out, config.MODES[mode])

    def _note_capture(self) -> None:
        if not self.captured and torch.cuda.is_current_stream_capturing():
            self.captured = True

    def can_fuse(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
        """True when fused_allreduce_rmsnorm(x, residual, weight, eps) is served by YALI.

        x: [..., hidden] contiguous fp32/fp16/bf16 with hidden a multiple of 16 bytes and at
        most the table's fused_max_row_bytes per row (64 KiB: hidden 32768 in bf16; any address: unaligned tensors go through copies); weight: [hidden], same dtype; residual: like x or None.
        Messages above the one-launch limit are still served (all-reduce, then add + norm).
        """
        return self.should_use(x) and x.dim() >= 1 and self._fusable_rows(x, residual, weight)

    def fused_allreduce_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                                eps: float, norm_out: torch.Tensor | None = None,
                                residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm_out, residual_out) of all-reduce(x) [+ residual] -> RMSNorm(weight, eps), one launch
        up to the flash buffer size. See ops.fused_allreduce_rmsnorm for the exact arithmetic.
        Raises ValueError/TypeError/RuntimeError naming the problem for inputs can_fuse() refuses."""
        if self._handle is None:
            raise RuntimeError("yali: fused_allreduce_rmsnorm on a closed YaliCommunicator")
        self._note_capture()
        outs = (norm_out, residual_out)
        if _unaligned(x, residual, weight, *outs):
            # Through aligned copies; outputs given at an unaligned address receive the result.
            n, r = ops.fused_allreduce_rmsnorm(self._handle, aligned(x), aligned(residual), aligned(weight), eps)
            return tuple(r_ if o is None else o.copy_(r_) for o, r_ in zip(outs, (n, r)))
        return ops.fused_allreduce_rmsnorm(self._handle, x, residual, weight, eps, norm_out, residual_out)

    def can_fuse_quant(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, scheme: int,
                       group_size: int = 128) -> bool:
        """True when fused_allreduce_rmsnorm_quant(x, residual, weight, eps, scheme, ...) is served by YALI:
        can_fuse's limits, x a [rows, hidden] matrix in bf16 or fp16 (the scales are per row), a known
        scheme, and for the group scheme a group size of 64 or 128 that divides the hidden size."""
        if scheme not in (ops.SCHEME_STATIC, ops.SCHEME_PER_TOKEN, ops.SCHEME_GROUP) or x.dtype not in ops.QUANT_DTYPES:
            return False
        if x.dim() != 2:
            return False
        if scheme == ops.SCHEME_GROUP and (group_size not in ops.QUANT_GROUP_SIZES or x.shape[-1] % group_size):
            return False
        return self.can_fuse(x, residual, weight)

    def fused_allreduce_rmsnorm_quant(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                                      eps: float, scheme: int, scale: torch.Tensor | None, group_size: int = 128,
                                      scale_ue8m0: bool = False, scale_out: torch.Tensor | None = None,
                                      quant_out: torch.Tensor | None = None,
                                      residual_out: torch.Tensor | None = None,
                                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(quant_out, residual_out, scale) of all-reduce(x) [+ residual] -> RMSNorm(weight, eps) ->
        FP8 e4m3 by `scheme` (ops.fused_allreduce_rmsnorm_quant has the arithmetic). `scale`: the
        one-element input scale of the static scheme (ignored otherwise); the dynamic schemes write
        `scale_out` (for the group scheme in any layout the caller needs, e.g. column-major), or a new
        [rows, 1] / row-major [rows, hidden / group_size] tensor. Outputs not given are allocated
        (residual_out like x). Raises ValueError/TypeError/RuntimeError naming the problem for inputs
        can_fuse_quant() refuses."""
        if self._handle is None:
            raise RuntimeError("yali: fused_allreduce_rmsnorm_quant on a closed YaliCommunicator")
        self._note_capture()
        if scheme == ops.SCHEME_STATIC:
            if scale is None:
                raise ValueError("yali: scale (the static scheme's input scale) is required")
            scale_arg = scale
        else:
            scale_arg = scale_out if scale_out is not None else ops.quant_scale_out(x, scheme, group_size)
        if residual_out is None:
            residual_out = torch.empty_like(x)
        if _unaligned(x, residual, weight, quant_out, residual_out):
            # Through aligned copies; outputs given at an unaligned address receive the result.
            q, r, _ = ops.fused_allreduce_rmsnorm_quant(self._handle, aligned(x), aligned(residual), aligned(weight),
                                                        eps, None, torch.empty_like(x), scale_arg, scheme,
                                                        group_size, scale_ue8m0)
            return (q if quant_out is None else quant_out.copy_(q), residual_out.copy_(r), scale_arg)
        return ops.fused_allreduce_rmsnorm_quant(self._handle, x, residual, weight, eps, quant_out, residual_out,
                                                 scale_arg, scheme, group_size, scale_ue8m0)

    def fused_quant_launch(self, rows: int, hidden: int, dtype: torch.dtype, scheme: int, group_size: int = 128) -> dict:
        """How a quantising fused call runs (as fused_launch)."""
        return config.launch_dict(_ext.ops().fused_quant_launch(self._handle, rows, hidden, dtype, scheme, group_size))

    def _fusable_rows(self, out: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
        """The row size, the norm weight and the residual fit a fused epilogue writing `out`."""
        hidden = out.shape[-1]
        row_bytes = hidden * out.element_size()
        if row_bytes % 16 != 0 or row_bytes > self.table["limits"]["fused_max_row_bytes"]:
            return False
        if not isinstance(weight, torch.Tensor) or weight.shape != (hidden,) or weight.dtype != out.dtype:
            return False
        if weight.device != self.device or not weight.is_contiguous():
            return False
        if residual is not None and not (
            residual.shape == out.shape and residual.dtype == out.dtype and residual.device == self.device
            and residual.is_contiguous()
        ):
            return False
        return True

    # ------------------------------------------------------------------ expert parallelism
    def ep_serves_dispatch(self, tensors: list[torch.Tensor], counts: list[int]) -> bool:
        """Whether ep_dispatch(tensors, counts) is served: decided from the tensors' row shapes and
        dtypes and the token counts, which are the same on every rank, so every rank answers alike.
        At most 8 tensors of EP_DTYPES with rows of a positive multiple of 4 bytes, and every rank's
        rows of all of them (each padded to 16 bytes) within the EP slot. A tensor that is not
        [counts[rank], ...] on this GPU is a caller's error on this rank alone: ValueError naming it
        (refusing would send this rank to another collective than its peers)."""
        if self._handle is None or self.ep_slot_bytes == 0 or len(counts) != self.world_size:
            return False
        if not 1 <= len(tensors) <= self.table["limits"]["ep_max_parts"]:
            return False
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.dtype not in EP_DTYPES:
                return False
            if t.shape[0] != counts[self.rank] or t.device != self.device:
                raise ValueError(f"yali: ep_dispatch tensor {i} is {tuple(t.shape)} on {t.device}; rank {self.rank} "
                                 f"needs [{counts[self.rank]}, ...] (its token count in {list(counts)}) on {self.device}")
        rows = [_row_bytes(t) for t in tensors]
        return bool(_ext.ops().ep_serves_dispatch(self._handle, rows, [int(c) for c in counts]))

    def ep_dispatch(self, tensors: list[torch.Tensor], counts: list[int]) -> list[torch.Tensor]:
        """Every rank's `tensors`, gathered in rank order: tensor i becomes [sum(counts), ...], rank
        r's rows first at row sum(counts[:r]). Bit for bit the inputs, except that a 32-bit word
        0x80008000 arrives as 0x80000000 (two zeros with another sign, or no valid index: ep.cuh).
        Every rank calls it alike (the same counts, row shapes and dtypes); check
        ep_serves_dispatch first. Any address and layout: non-contiguous or unaligned tensors go
        through copies."""
        if self._handle is None:
            raise RuntimeError("yali: ep_dispatch on a closed YaliCommunicator")
        self._note_capture()
        total = sum(int(c) for c in counts)
        ins = [t if t.is_contiguous() and t.data_ptr() % 4 == 0 else aligned(t.contiguous()) for t in tensors]
        outs = [torch.empty((total, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in ins]
        ops.ep_dispatch(self._handle, ins, outs, [int(c) for c in counts])
        return outs

    def ep_serves_combine(self, x: torch.Tensor, counts: list[int]) -> bool:
        """Whether ep_combine(x, counts) is served: x a [sum(counts), hidden] fp32 / fp16 / bf16
        tensor on this GPU, rows a multiple of 16 bytes, every rank's rows within the EP slot
        (values every rank shares, so every rank answers alike)."""
        if self._handle is None or self.ep_slot_bytes == 0 or len(counts) != self.world_size:
            return False
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.device != self.device:
            return False
        return x.shape[0] == sum(counts) and self.ep_serves_rows(int(x.shape[1]), x.dtype, counts)

    def ep_serves_rows(self, hidden: int, dtype: torch.dtype, counts: list[int]) -> bool:
        """ep_serves_combine for a [sum(counts), hidden] tensor of `dtype` yet to be made."""
        if self._handle is None or self.ep_slot_bytes == 0 or len(counts) != self.world_size:
            return False
        if dtype not in SUPPORTED_DTYPES:
            return False
        return bool(_ext.ops().ep_serves_combine(self._handle, int(hidden), dtype, [int(c) for c in counts]))

    def ep_combine(self, x: torch.Tensor, counts: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's rows of x (rows sum(counts[:rank]) on) summed over the ranks, in rank order in
        fp32, rounded once: bitwise the same whatever the order of arrival. Into `out` ([counts[rank],
        hidden], any layout) or a new tensor. Every rank calls it alike; check ep_serves_combine first."""
        if self._handle is None:
            raise RuntimeError("yali: ep_combine on a closed YaliCommunicator")
        self._note_capture()
        src = x if x.is_contiguous() and x.data_ptr() % 16 == 0 else aligned(x.contiguous())
        mine = int(counts[self.rank])
        direct = (out is not None and out.is_contiguous() and out.data_ptr() % 16 == 0
                  and not _overlap(out, src))  # the kernel refuses an out over its input: a rank-local condition
        dst = out if direct else torch.empty((mine, x.shape[1]), dtype=x.dtype, device=x.device)
        ops.ep_combine(self._handle, src, dst, [int(c) for c in counts])
        return dst if out is None or direct else out.copy_(dst)

    def synchronize(self) -> None:
        """Waits until every kernel on this rank's GPU has finished (YALI's included). Raises
        YaliError with the reason when a YALI kernel gave up."""
        try:
            torch.cuda.synchronize(self.device)
        except RuntimeError as e:
            self.raise_if_aborted(e)
            raise

    def raise_if_aborted(self, cause: BaseException | None = None) -> None:
        """Raises YaliError naming the kernel, its wait and both ranks' calls if a YALI kernel of
        this rank gave up (reads a host-mapped record: no CUDA call, works on a lost context)."""
        msg = self.abort_message()
        if msg:
            h = self._handle if self._handle is not None else self._kept
            if self._watcher is not None and h is not None:
                self._watcher.note_raised(h)  # the caller knows: the watcher leaves the process be
            raise YaliError(msg) from cause

    def device_calls(self) -> int:
        """YALI kernel launches that ran on this GPU (graph replays included). Synchronises."""
        return int(_ext.ops().device_calls(self._handle))

    def device_fused_calls(self) -> int:
        """Fused all-reduce + RMSNorm launches that ran on this GPU (graph replays included). Synchronises."""
        return int(_ext.ops().device_fused_calls(self._handle))

    def fused_launch(self, rows: int, hidden: int, dtype: torch.dtype) -> dict:
        """How a fused call of `rows` x `hidden` `dtype` runs: one launch or not, CTAs, batched receive
        poll, row loads before the epoch fetch, message bytes sent per CTA, CTAs per thread block cluster,
        CTAs per row (N ranks: a cluster of that many CTAs owns each row; 1: a CTA owns whole rows)."""
        return config.launch_dict(_ext.ops().fused_launch(self._handle, rows, hidden, dtype))

    def abort_message(self) -> str:
        """Why a kernel gave up waiting for the peer ("" if none did)."""
        h = self._handle if self._handle is not None else self._kept
        return _ext.ops().abort_message(h) if h is not None else ""

    def describe(self) -> str:
        c = self.config
        buffers = f"buffers {_mib(int(_ext.ops().buffer_bytes(self._handle)))} per GPU"
        served, below = [], 0  # the size table's all-reduce bands, up to the serve limit
        for band in self.table["allreduce"]:
            top = min(int(band["up_to"]), self._serve_limit)
            if top > below:
                served.append(f"{band['kernel']} {'above that ' if served else ''}up to {_size(top)}")
                below = top
        return (f"YALI all-reduce on {self.device} (world {self.world_size}): {', '.join(served)}, vLLM's chain above, "
                f"mode={c['mode']}, {buffers}")

    _kept: int | None = None  # a closed communicator's handle whose buffers stay (see close())

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Releases the buffers, coordinated with the peer: both ranks call it, like a collective.

        1. Every YALI kernel of this rank finishes; no new call is accepted.
        2. The ranks agree over the CPU group (bounded by `timeout_s`) and learn whether a CUDA graph
           on either captured YALI's kernels. If one did, the graph holds the buffers' addresses
           and may replay: the buffers and the peer mapping stay for the life of the process (a
           replay after close() then still computes the all-reduce with a peer that kept its own).
        3. Otherwise each rank unmaps the peer's buffer, the ranks agree again, and only then does
           each free its own: no peer kernel or mapping can touch freed memory.
        If the peer does not reach close() in time (or the group is gone), this rank unmaps the
        peer's buffer and keeps its own allocated (freed with the process), since the peer may
        still map it. A second call does nothing."""
        if self._handle is None:
            return
        h, self._handle = self._handle, None
        y = _ext.ops()
        try:
            torch.cuda.synchronize(self.device)
        except Exception:  # noqa: BLE001 - a kernel trapped: the context is lost; the abort record says why
            pass
        # Watched until here: a synchronize that a trapped kernel leaves waiting still ends the process.
        if self._watcher is not None:
            self._watcher.remove(h)
        captured = self._agree(bool(self.captured), timeout_s)
        if captured is None:
            self._close_peers(h)
            self._keep(h, "the peer did not reach close() within %.0f s; this rank's buffer stays "
                          "allocated until the process exits, since the peer may still map it" % timeout_s)
            return
        if any(captured):
            self._keep(h, "a CUDA graph captured YALI's kernels: the buffers and the peer mapping stay for "
                          "the life of the process, so that its replays never touch freed memory")
            return
        self._close_peers(h)
        if self._agree(False, timeout_s) is None:
            self._keep(h, "the peer did not confirm it unmapped this rank's buffer; it stays allocated "
                          "until the process exits")
            return
        y.destroy(h)

    def _close_peers(self, handle: int) -> None:
        """Unmaps the other ranks' buffers."""
        _ext.ops().close_peer(handle)

    def _keep(self, handle: int, why: str) -> None:
        self._kept = handle
        logger.info("yali: rank %d closed; %s", self.rank, why)

    def _agree(self, mine: bool, timeout_s: float) -> list | None:
        """Every rank's `mine`, once all ranks got here within `timeout_s`; None if the group cannot
        tell (a rank missing, the group destroyed, a backend without monitored_barrier)."""
        try:
            dist.monitored_barrier(group=self.group, timeout=datetime.timedelta(seconds=timeout_s),
                                   wait_all_ranks=True)
            got: list = [None] * self.world_size
            dist.all_gather_object(got, mine, group=self.group)
            return got
        except Exception as e:
            logger.warning("yali: rank %d could not coordinate close() with its peer: %s", self.rank, e)
            return None

    def __del__(self):
        """Dropped without close(): local clean-up only (no collective in a finaliser). The peer's
        buffer is unmapped; this rank's own stays allocated until the process exits, since the
        peer may still map it or write into it."""
        try:
            if self._watcher is not None and self._handle is not None:
                self._watcher.remove(self._handle)
            if self._handle is not None:
                h, self._handle = self._handle, None
                if not self.captured:
                    self._close_peers(h)
        except Exception:
            pass


def join_close(group: dist.ProcessGroup, world_size: int, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
    """What close() does over the group on a rank that holds no communicator while other ranks of
    `group` close theirs (its build failed on this rank only): takes part in close()'s two
    agreements, so that no rank waits in them and the next collective on the group is every
    rank's."""
    for _ in range(2):
        try:
            dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
            got: list = [None] * world_size
            dist.all_gather_object(got, False, group=group)
        except Exception as e:
            logger.warning("yali: could not take part in the other ranks' close(): %s", e)
            return
        if any(got):  # a CUDA graph captured the kernels on some rank: close() ends after one agreement
            return


class YaliPair:
    """Single-process mode: one process drives both GPUs (P2P, no IPC)."""

    def __init__(self, device0: int = 0, device1: int = 1):
        reason = _ext.unavailable_reason()
        if reason:
            raise YaliUnavailable(reason)
        if torch.cuda.device_count() < 2:
            raise YaliUnavailable("single-process mode needs 2 visible GPUs")
        if not torch.cuda.can_device_access_peer(device0, device1):
            raise YaliUnavailable(f"no P2P access between cuda:{device0} and cuda:{device1}")
        y = _ext.ops()
        ops.register_fakes()
        self.devices = (torch.device("cuda", device0), torch.device("cuda", device1))
        self._handles: list[int] = []
        try:
            self._handles = [y.create(device0, 0), y.create(device1, 1)]
            y.attach_peer(self._handles[0], self._handles[1])
            y.attach_peer(self._handles[1], self._handles[0])
        except Exception:
            self.close()
            raise

    def all_reduce(self, xs, outs=None, mode: str = "config"):
        """xs: [tensor on GPU 0, tensor on GPU 1]; each is launched on its device's current stream."""
        outs = outs or [None, None]
        # Both ranks' arguments are checked before either kernel is launched: a launch on one GPU
        # whose peer call is refused would wait for the watchdog.
        for r in range(2):
            x, out = xs[r], outs[r]
            if not servable(x, self.devices[r], 1 << 62):
                raise ValueError(f"yali: YaliPair input {r} is not served: it must be a contiguous fp32/fp16/"
                                 f"bf16 tensor on {self.devices[r]}, got {x.dtype} on {x.device}")
            if out is not None and (out.dtype != x.dtype or out.numel() != x.numel() or out.device != x.device):
                raise ValueError(f"yali: YaliPair output {r} must match input {r}'s dtype, size and device")
            refusal = out_overlap_refusal(x, out)
            if refusal:
                raise ValueError(f"{refusal} (YaliPair rank {r})")
        if xs[0].dtype != xs[1].dtype or xs[0].numel() != xs[1].numel():
            raise ValueError(f"yali: YaliPair inputs differ: {xs[0].dtype}[{xs[0].numel()}] on GPU 0, "
                             f"{xs[1].dtype}[{xs[1].numel()}] on GPU 1")
        xs = [aligned(x) for x in xs]
        if _unaligned(*outs):
            return [o.copy_(r) if o is not None else r for o, r in zip(outs, self.all_reduce(xs, None, mode))]
        res = []
        for r in range(2):
            with torch.cuda.device(self.devices[r]):
                res.append(ops.all_reduce(self._handles[r], xs[r], outs[r], config.MODES[mode]))
        return res

    def device_calls(self) -> list[int]:
        return [int(_ext.ops().device_calls(h)) for h in self._handles]

    def close(self) -> None:
        """Both GPUs finish (a kernel on one may still write into the other's buffer), then both
        buffers are freed."""
        for h in self._handles:
            _ext.ops().close_peer(h)
        for h in self._handles:
            _ext.ops().destroy(h)
        self._handles = []
