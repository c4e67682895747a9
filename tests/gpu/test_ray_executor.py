"""vLLM's Ray executor on a local single-node Ray cluster gives the same tokens as the
multiprocessing executor, and YALI serves the TP=2 all-reduce under both.

Flow (every step bounded by a timeout):
1. write the embedded 8B model directory (config.json + tokenizer, dummy weights);
2. run greedy generation with distributed_executor_backend="mp" in a fresh subprocess;
3. `ray start --head --node-ip-address 127.0.0.1 --port <free> --num-gpus 2 --temp-dir
   <fresh dir>` (subprocess, its own process group), run the same generation with
   distributed_executor_backend="ray" in a fresh subprocess with RAY_ADDRESS pointing at
   that cluster, then stop that cluster and only it (in a finally, see below);
4. compare token ids, YALI's per-rank state (LLM.collective_rpc(yali_tp_stats)) and the
   plugin's log lines.

Why RAY_ADDRESS: vLLM calls ray.init(address=None). Ray then uses RAY_ADDRESS, else the
newest cluster recorded in /tmp/ray/ray_current_cluster, else silently starts a private
local instance; the explicit address makes sure the cluster started here is the one used.

Log-line assumption: the plugin (yali_vllm/plugin/group_setup.py) logs, on each rank of each group,
"YALI all-reduce ON for group '<name>' (rank R of N, ...)" or
"YALI all-reduce OFF for group '<name>': <reason> (world size N)". The match is case-insensitive on
"yali" + "all-reduce"/"allreduce"/"all_reduce" + "on"/"off"; update ON_RE/OFF_RE if the
plugin's wording changes. Under Ray the workers' lines reach the driver's output through
Ray's log forwarding and are also read from the cluster's worker log files.

Stopping: `ray stop` acts on every Ray process of the machine and has no switch for one
cluster, so it is not used. The processes of the cluster started here are: the process
group of `ray start` (its daemons inherit it), every process whose command line names the
cluster's own --temp-dir, and every descendant of those (Ray workers may get their own
process group and rename themselves "ray::..."). They get SIGTERM, and what is left
after a bounded wait gets SIGKILL; the list is taken before each signal and keeps the
survivors of the previous one (a worker whose raylet is gone has a new parent). A pid is
only signalled while its start time still matches, so a reused pid is never hit. Other
Ray clusters on the host are left alone.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from benchmarks.common.gpu_env import MULTICAST_OFF_ENV
from benchmarks.common.processes import free_port, signal_group

pytestmark = [pytest.mark.gpu, pytest.mark.two_gpus]

ENV = {
    # NVLink multicast stays off in every process, Ray's raylet and workers included.
    **MULTICAST_OFF_ENV,
    "YALI_ENABLE": "1",
    "RAY_DEDUP_LOGS": "0",  # keep both ranks' identical-looking lines
    # Ray replaces 127.0.0.1 (--node-ip-address, RAY_ADDRESS) with the host's routable IP
    # unless multi-node support is switched off; off, the whole cluster stays on loopback.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "VLLM_NO_USAGE_STATS": "1",
    # collective_rpc with a function (yali_tp_stats) pickles it across processes.
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
}
RAY_CMD_TIMEOUT = 180  # ray start
RAY_STOP_GRACE_S = 10  # per signal (SIGTERM, then SIGKILL) when stopping the cluster
RUN_TIMEOUT = int(os.environ.get("RAY_TEST_TIMEOUT", "900"))  # one LLM run
PROMPTS = [
    "The capital of France is",
    "Tensor parallelism splits each layer",
    "Once upon a time",
]
ON_RE = re.compile(r"yali\b.*\ball[-_ ]?reduce\s+on\b.*?\brank\s+(\d+)", re.I)
OFF_RE = re.compile(r"yali\b.*\ball[-_ ]?reduce\s+off\b.*?group\s+'([^']*)'", re.I)

CHILD = r"""
import json, sys
from vllm import LLM, SamplingParams
from yali_vllm.plugin import yali_tp_stats


def main():  # guarded: vLLM's engine processes re-import this file under spawn

    backend, model, prompts, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    llm = LLM(model=model, tokenizer_mode="mistral", load_format="dummy",
              tensor_parallel_size=2, distributed_executor_backend=backend, seed=0,
              max_model_len=1024, gpu_memory_utilization=0.5,
              max_num_seqs=8)  # few CUDA-graph sizes: a shorter start-up
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    stats = llm.collective_rpc(yali_tp_stats)
    with open(out, "w") as f:
        json.dump({"token_ids": [list(o.outputs[0].token_ids) for o in outputs],
                   "stats": stats}, f)
    print("CHILD DONE", flush=True)


if __name__ == "__main__":
    main()
"""


def _skip_reason() -> str | None:
    # 2 GPUs, P2P and the YALI extension are checked by tests/gpu/conftest.py.
    for mod in ("vllm", "ray"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not importable"
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    if not any(e.name == "yali" for e in eps):
        return "yali-vllm is not installed (no 'yali' vllm.general_plugins entry point)"
    return None


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(ENV)
    env.update(extra)
    return env


def _run(cmd: list[str], log: Path, timeout: float, env: dict[str, str],
         kill_group: bool = True) -> tuple[int, int]:
    """Run cmd in a new process group with output to `log`; returns (exit code, pgid).
    On timeout the whole group is killed (vLLM's engine-core and worker processes too);
    after a normal exit as well unless kill_group is False (`ray start` leaves its
    daemons running in its group)."""
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"{cmd[:4]} did not finish in {timeout}s; log: {log}\n"
                        + log.read_text(errors="replace")[-4000:])
        if kill_group:
            signal_group(proc.pid, signal.SIGKILL)  # leftovers of this run only
        return rc, proc.pid


def _proc_stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, pgid, start time in clock ticks) of a live process, else None."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = data[data.rindex(")") + 2:].split()  # from field 3 (state) on; comm may hold spaces
    if fields[0] in ("Z", "X"):  # exited, not yet reaped
        return None
    return fields[0], int(fields[1]), int(fields[2]), int(fields[19])


def _mentions(pid: int, path_re: re.Pattern[bytes]) -> bool:
    try:
        return bool(path_re.search(Path(f"/proc/{pid}/cmdline").read_bytes()))
    except OSError:
        return False


def _ray_cluster_procs(pgid: int | None, ray_tmp: Path) -> dict[int, int]:
    """pid -> start time of every live process of the cluster started here (module doc)."""
    procs = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _proc_stat(int(entry.name))) is not None:
            procs[int(entry.name)] = st
    path_re = re.compile(re.escape(str(ray_tmp).encode()) + rb"(/|\x00|$)")
    found = {pid for pid, (_, _, group, _) in procs.items()
             if (pgid is not None and group == pgid) or _mentions(pid, path_re)}
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    found.discard(os.getpid())
    return {pid: procs[pid][3] for pid in found}


def _still_running(procs: dict[int, int]) -> dict[int, int]:
    return {pid: start for pid, start in procs.items()
            if (st := _proc_stat(pid)) is not None and st[3] == start}


def _stop_ray_cluster(pgid: int | None, ray_tmp: Path, log: Path) -> None:
    """Stop the cluster started here and nothing else: SIGTERM, then SIGKILL, each
    followed by a wait of at most RAY_STOP_GRACE_S seconds."""
    procs: dict[int, int] = {}
    lines = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        # survivors of SIGTERM, plus any process that came up since the last listing
        procs = _still_running(procs) | _ray_cluster_procs(pgid, ray_tmp)
        if not procs:
            break
        lines.append(f"{sig.name} -> {sorted(procs)}")
        for pid in procs:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + RAY_STOP_GRACE_S
        while (procs := _still_running(procs)) and time.monotonic() < deadline:
            time.sleep(0.2)
    left = _still_running(procs) | _ray_cluster_procs(pgid, ray_tmp)
    lines.append(f"left running: {sorted(left)}")
    log.write_text("\n".join(lines) + "\n")
    assert not left, f"Ray processes {sorted(left)} outlived SIGKILL; see {log}"


def _generate(backend: str, model: Path, work: Path, env: dict[str, str]) -> tuple[dict, str]:
    script, out, log = work / "child.py", work / f"{backend}.json", work / f"{backend}.log"
    script.write_text(CHILD)
    cmd = [sys.executable, str(script), backend, str(model), json.dumps(PROMPTS), str(out)]
    rc, _ = _run(cmd, log, RUN_TIMEOUT, env)
    text = log.read_text(errors="replace")
    assert rc == 0 and out.exists(), f"{backend} run failed ({rc}):\n{text[-6000:]}"
    return json.loads(out.read_text()), text


def _check_yali(backend: str, result: dict, logs: str) -> None:
    stats = result["stats"]
    assert len(stats) == 2, stats
    for s in stats:
        assert s["yali"], f"{backend}: TP rank {s['rank']} has no YALI communicator: {s}"
        assert s["device_calls"] and s["device_calls"] > 0, f"{backend}: YALI never ran: {s}"
    on_ranks = {int(m.group(1)) for m in ON_RE.finditer(logs)}
    assert on_ranks >= {0, 1}, f"{backend}: YALI ON log lines for ranks {on_ranks}, want 0 and 1"
    tp_off = [g for g in (m.group(1) for m in OFF_RE.finditer(logs)) if "tp" in g]
    assert not tp_off, f"{backend}: YALI OFF for TP group(s) {tp_off}"


# Outer bound (pytest-timeout) on top of the per-step timeouts.
@pytest.mark.timeout(2 * RUN_TIMEOUT + RAY_CMD_TIMEOUT + 4 * RAY_STOP_GRACE_S + 120)
def test_ray_executor_matches_mp_and_selects_yali(tmp_path):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from yali_vllm.models import write_model_dir

    model = write_model_dir(tmp_path / "llama-8b", "8b")

    mp_result, mp_logs = _generate("mp", model, tmp_path, _env())

    port = free_port()
    # Short temp dir: Ray's Unix socket paths under it must stay below ~107 bytes.
    ray_tmp = Path(tempfile.mkdtemp(prefix="yray", dir="/tmp"))
    ray_env = _env(RAY_ADDRESS=f"127.0.0.1:{port}")
    ray_pgid = None
    try:
        start_log = tmp_path / "ray-start.log"
        rc, ray_pgid = _run(
            [sys.executable, "-m", "ray.scripts.scripts", "start", "--head",
             "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-gpus", "2",
             "--disable-usage-stats", "--include-dashboard", "false", "--temp-dir", str(ray_tmp)],
            start_log, RAY_CMD_TIMEOUT, _env(), kill_group=False)  # its daemons stay up
        assert rc == 0, f"ray start failed ({rc}):\n" + start_log.read_text(errors="replace")[-4000:]
        ray_result, ray_logs = _generate("ray", model, tmp_path, ray_env)
        # Workers' own log files, in case forwarding to the driver lagged behind its exit.
        for f in sorted(ray_tmp.glob("session_latest/logs/**/worker-*")):
            if f.suffix in (".out", ".err", ".log"):
                ray_logs += "\n" + f.read_text(errors="replace")
    finally:
        try:  # this cluster only; also after a failed or timed-out `ray start`
            _stop_ray_cluster(ray_pgid, ray_tmp, tmp_path / "ray-stop.log")
        finally:
            shutil.rmtree(ray_tmp, ignore_errors=True)

    assert len(mp_result["token_ids"]) == len(PROMPTS)
    assert all(mp_result["token_ids"]), "empty generation"
    assert ray_result["token_ids"] == mp_result["token_ids"], (
        f"ray {ray_result['token_ids']} != mp {mp_result['token_ids']}")
    _check_yali("mp", mp_result, mp_logs)
    _check_yali("ray", ray_result, ray_logs)
