"""Shared helpers for yali-vllm benchmark result files (kept under ``lab/results/``).

Every result file is one JSON object with the common keys returned by
:func:`results_header` (``kind``, ``date``, ``command``, ``host``, ``versions``, ``gpus``;
for a run of several ranks also ``gpus_used``), ``world_size`` (``world_sizes`` for a
gpu-test-run) and ``shared_gpu`` (:func:`with_schema_keys`), plus ``records`` and whatever the
benchmark kind adds (see docs/BENCHMARKS.md and lab/results/README.md).

Everything here is cheap and safe on a machine without a GPU: every probe
(nvidia-smi, git, torch, vLLM) is optional and yields ``None`` when missing.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common.cli_args import rank_device
from benchmarks.common.gpu_env import child_env

REPO_ROOT = Path(__file__).resolve().parents[2]

VERSION_KEYS = ("torch", "cuda", "nccl", "vllm", "yali_vllm", "git")

_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def output_dir() -> Path:
    """Where a benchmark writes when no --out is given: per user under the system temp dir, outside
    the repository (the JSON and markdown worth keeping go to lab/results/, see its README)."""
    import tempfile

    return Path(tempfile.gettempdir()) / f"yali-results-{os.getuid()}"


def run_probe(cmd: list[str], timeout: float = 20.0, cwd: Path | None = None) -> str | None:
    """Run a short probe command; its stdout, or None if it is missing or fails."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        cp = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
            env=child_env(),
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if cp.returncode != 0:
        return None
    return cp.stdout


# --------------------------------------------------------------------------- host
def parse_gpu_query(csv_text: str) -> list[tuple[str, str]]:
    """Parse ``nvidia-smi --query-gpu=name,driver_version --format=csv`` output.

    Returns ``[(name, driver), ...]``; a header line (``name, driver_version``)
    is skipped if present.
    """
    gpus: list[tuple[str, str]] = []
    for line in csv_text.splitlines():
        line = line.strip()
        if not line or line.lower().startswith("name"):
            continue
        parts = [p.strip() for p in line.rsplit(",", 1)]
        if len(parts) != 2:
            continue
        gpus.append((parts[0], parts[1]))
    return gpus


def parse_topo_links(topo_text: str) -> list[str]:
    """Link types between distinct GPU pairs from ``nvidia-smi topo -m``.

    Returns the sorted unique link labels (``["NV18"]``, ``["NV18", "SYS"]``...).
    """
    lines = [_ANSI_RE.sub("", ln).rstrip() for ln in topo_text.splitlines()]
    header: list[str] | None = None
    links: set[str] = set()
    for ln in lines:
        toks = ln.split()
        if not toks:
            continue
        if header is None:
            # The header row lists the columns (GPU0 GPU1 ... NIC0 CPU Affinity ...);
            # a matrix row starts with a GPU name too but has an "X" on its diagonal.
            if re.fullmatch(r"GPU\d+", toks[0]) and "X" not in toks:
                header = toks
            continue
        if not re.fullmatch(r"GPU\d+", toks[0]):
            if toks[0].startswith("Legend"):
                break
            continue
        row_gpu = toks[0]
        cells = toks[1:]
        for col, cell in zip(header, cells, strict=False):
            if re.fullmatch(r"GPU\d+", col) and col != row_gpu and cell != "X":
                links.add(cell)
    return sorted(links)


def summarize_host(gpu_csv: str | None, topo: str | None) -> str:
    """``"2xNVIDIA H200 NV18, driver 580.65.06"``-style summary (or ``"unknown (...)"``)."""
    if not gpu_csv:
        return "unknown (nvidia-smi not available)"
    gpus = parse_gpu_query(gpu_csv)
    if not gpus:
        return "unknown (nvidia-smi printed no GPU)"
    names: dict[str, int] = {}
    for name, _ in gpus:
        names[name] = names.get(name, 0) + 1
    gpu_part = " + ".join(f"{n}x{name}" for name, n in names.items())
    links = parse_topo_links(topo) if topo else []
    link_part = f" {'/'.join(links)}" if links else ""
    drivers = sorted({d for _, d in gpus})
    return f"{gpu_part}{link_part}, driver {'/'.join(drivers)}"


GPU_ID_FIELDS = ("index", "uuid", "serial", "pci.bus_id", "vbios_version")


def parse_gpu_ids(csv_text: str) -> list[dict[str, str]]:
    """``nvidia-smi --query-gpu=index,uuid,serial,pci.bus_id,vbios_version --format=csv,noheader``
    -> one dict per GPU (keys as GPU_ID_FIELDS, dots as underscores)."""
    out = []
    for line in csv_text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) == len(GPU_ID_FIELDS) and cells[0].isdigit():
            out.append({k.replace(".", "_"): v for k, v in zip(GPU_ID_FIELDS, cells)})
    return out


def gpu_ids() -> list[dict[str, str]]:
    """Which physical GPUs ran this (UUID, serial, PCI bus, VBIOS); [] without nvidia-smi. Hosts
    of the same type differ in some effects (the GEMM after the fused op,
    lab/results/current/decode-gemm/20261122-gate-up), so a result names its GPUs."""
    text = run_probe(["nvidia-smi", "--query-gpu=" + ",".join(GPU_ID_FIELDS), "--format=csv,noheader"])
    return parse_gpu_ids(text) if text else []


def cuda_order(ids: Sequence[dict[str, str]], cuda_visible: str | None) -> list[dict[str, str]]:
    """The GPUs of ``ids`` (parse_gpu_ids) in the order CUDA numbers them under
    ``CUDA_VISIBLE_DEVICES=cuda_visible`` (None: every GPU, in nvidia-smi's order). An entry is an
    nvidia-smi index or a UUID (prefix); as in CUDA, the list ends at the first entry that names
    no GPU."""
    if cuda_visible is None:
        return list(ids)
    out = []
    for item in (t.strip() for t in cuda_visible.split(",")):
        match = next((g for g in ids if item and (g["index"] == item or g["uuid"].startswith(item))), None)
        if match is None:
            break
        out.append(match)
    return out


def gpus_used(world_size: int, shared: bool = False, ids: Sequence[dict[str, str]] | None = None,
              cuda_visible: str | None = None) -> list[dict[str, Any]]:
    """Per rank of a run of ``world_size`` ranks (rank r on CUDA device r, or every rank on device 0
    when ``shared``): ``rank``, ``cuda_device`` and that GPU's nvidia-smi identity (index, UUID,
    serial, PCI bus, VBIOS) when ``ids`` (default: nvidia-smi's) has it."""
    visible = cuda_order(gpu_ids() if ids is None else ids, cuda_visible)
    out: list[dict[str, Any]] = []
    for r in range(world_size):
        dev = rank_device(r, shared)
        out.append({"rank": r, "cuda_device": dev, **(visible[dev] if dev < len(visible) else {})})
    return out


def host_info() -> str:
    gpu_csv = run_probe(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv"])
    topo = run_probe(["nvidia-smi", "topo", "-m"]) if gpu_csv else None
    return summarize_host(gpu_csv, topo)


# ----------------------------------------------------------------------- versions
def _dist_version(name: str) -> str | None:
    try:
        from importlib import metadata

        return metadata.version(name)
    except Exception:  # PackageNotFoundError or a broken install
        return None


def _yali_source_version() -> str | None:
    """yali_vllm's version from its source tree (not pip-installed, e.g. on PYTHONPATH)."""
    try:
        from yali_vllm._version import __version__  # cheap: no extension import

        return f"{__version__} (source)"
    except Exception:
        pass
    try:
        ns: dict[str, Any] = {}
        exec((REPO_ROOT / "yali_vllm" / "_version.py").read_text(), ns)
        return f"{ns['__version__']} (source)"
    except Exception:
        return None


def git_commit() -> str | None:
    """The source commit: BENCH_GIT_COMMIT when the caller names it (a copied work tree whose .git
    is absent or not the source's), else git's HEAD (+dirty)."""
    if os.environ.get("BENCH_GIT_COMMIT"):
        return os.environ["BENCH_GIT_COMMIT"]
    out = run_probe(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT)
    if out and out.strip():
        sha = out.strip()
        dirty = run_probe(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT)
        return sha + ("+dirty" if dirty and dirty.strip() else "")
    return None


def versions() -> dict[str, str | None]:
    v: dict[str, str | None] = dict.fromkeys(VERSION_KEYS)
    try:
        import torch

        v["torch"] = torch.__version__
        v["cuda"] = torch.version.cuda
        try:
            nccl = torch.cuda.nccl.version()
            v["nccl"] = ".".join(str(x) for x in nccl) if isinstance(nccl, tuple) else str(nccl)
        except Exception:
            v["nccl"] = None
    except Exception:
        pass
    v["vllm"] = _dist_version("vllm")
    if v["vllm"] is None:
        try:
            import vllm  # noqa: PLC0415  (heavy; only when metadata is missing)

            v["vllm"] = getattr(vllm, "__version__", None)
        except Exception:
            v["vllm"] = None
    v["yali_vllm"] = _dist_version("yali-vllm") or _yali_source_version()
    v["git"] = git_commit()
    return v


# ------------------------------------------------------------------------ writing
def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds")


def ranks_keys(world_size: int, shared: bool = False, ids: Sequence[dict[str, str]] | None = None) -> dict[str, Any]:
    """The header keys of a run of ``world_size`` ranks: ``world_size``, ``gpus_used`` (gpus_used())
    and, when the ranks shared GPU 0, ``shared_gpu: true`` (its timings are not valid)."""
    return {"world_size": world_size, "shared_gpu": bool(shared),
            "gpus_used": gpus_used(world_size, shared, ids, os.environ.get("CUDA_VISIBLE_DEVICES"))}


_WORLD_ARG = re.compile(r"--(?:world-size|tensor-parallel-size)[ =](\d+)")
_RANKS_TEST = re.compile(r"\[(\d+)-ranks(?=[\]-])")  # [4-ranks], [4-ranks-random-pdl1]


def with_schema_keys(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` with the two keys the results schema asks of every file, where missing: how many
    ranks ran (``world_size``: the command's --world-size / --tensor-parallel-size, else 2; a
    ``gpu-test-run`` names every world size its tests exercised, ``world_sizes``) and whether
    they shared one GPU (``shared_gpu``: YALI_ALLOW_SHARED_GPU=1 in the run's environment)."""
    if "kind" not in obj or "records" not in obj:
        return obj
    out = dict(obj)
    if out["kind"] == "gpu-test-run":
        if "world_sizes" not in out:
            ran = [r["test"] for r in out["records"] if r.get("outcome") != "skipped"]
            sizes = {int(m) for t in ran for m in _RANKS_TEST.findall(t)}
            # every other GPU test is a two-rank one (tests/gpu: a pair of processes, or of GPUs)
            if any("tests/gpu/" in t and not _RANKS_TEST.search(t) for t in ran):
                sizes.add(2)
            out["world_sizes"] = sorted(sizes)
    elif "world_size" not in out:
        m = _WORLD_ARG.search(str(out.get("command", "")))
        out["world_size"] = int(m.group(1)) if m else 2
    if "shared_gpu" not in out:
        out["shared_gpu"] = (out.get("yali_env") or {}).get("YALI_ALLOW_SHARED_GPU") == "1"
    return out


def results_header(kind: str, extra: dict[str, Any] | None = None, *, world_size: int | None = None,
                   shared_gpu: bool = False) -> dict[str, Any]:
    """The common keys of a result file, plus ``extra`` (which may override none of them). A run of
    several ranks passes ``world_size`` (and ``shared_gpu`` when its ranks shared GPU 0): the header
    then names the ranks' GPUs (ranks_keys)."""
    ids = gpu_ids()
    obj: dict[str, Any] = {
        "kind": kind,
        "date": now_iso(),
        "command": " ".join(sys.argv),
        "host": host_info(),
        "versions": versions(),
        # The YALI_* knobs in force (e.g. YALI_DEV_FUSED_BATCH_POLL_MIN=0): a figure measured with a
        # non-default kernel setting must say so in its own file.
        "yali_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("YALI_")},
        "gpus": ids,
    }
    if world_size is not None:
        obj.update(ranks_keys(world_size, shared_gpu, ids))
    for k, val in (extra or {}).items():
        if k in obj:
            raise ValueError(f"extra key {k!r} would override a common header key")
        obj[k] = val
    return obj


def write_results(path: str | os.PathLike[str], obj: dict[str, Any]) -> Path:
    """Write ``obj`` as indented JSON atomically (tmp file + rename), with the schema's world size
    and shared-GPU keys (with_schema_keys)."""
    obj = with_schema_keys(obj)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=False, default=str)
        f.write("\n")
    os.replace(tmp, path)
    return path


def write_json_and_markdown(out_dir: str | os.PathLike[str], stem: str, obj: dict[str, Any], md: str) -> Path:
    """OUT_DIR/STEM.json (the result, as write_results) and OUT_DIR/STEM.md beside it; returns the JSON path."""
    os.makedirs(out_dir, exist_ok=True)
    path = write_results(os.path.join(out_dir, stem + ".json"), obj)
    with open(os.path.join(out_dir, stem + ".md"), "w") as f:
        f.write(md)
    return path


def world_size_of(doc: dict[str, Any]) -> int:
    """The ranks of a result (a serving result: its servers' tensor-parallel size); 2 when the file
    predates the key."""
    return int(doc.get("world_size", 2))


def load_results(path: str | os.PathLike[str]) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_results_of_kind(paths: Sequence[str | os.PathLike[str]], kind: str) -> list[dict[str, Any]]:
    """The result files at ``paths``; SystemExit naming the first that is not of ``kind``."""
    docs = []
    for path in paths:
        doc = load_results(path)
        if doc.get("kind") != kind:
            raise SystemExit(f"{path}: kind is {doc.get('kind')!r}, expected {kind!r}")
        docs.append(doc)
    return docs


def merge_sources(paths: Sequence[Path], out: Path) -> tuple[list[str], list[str]]:
    """For result files merged into ``out``: (each file, each file's directory), relative to ``out``,
    so that the merged result names its sources and the files they name stay findable."""
    dirs = [Path(os.path.relpath(p.parent, out)).as_posix() for p in paths]
    return [f"{d}/{p.name}" for d, p in zip(dirs, paths)], dirs


def under(prefix: str, path: Any) -> Any:
    """A file a merge source names (``path``, relative to that source), made relative to the
    merged result by its source directory ``prefix`` (from merge_sources); other values as they are."""
    return f"{prefix}/{path}" if prefix and isinstance(path, str) and path else path


def default_out(prefix: str) -> Path:
    """<output_dir()>/<prefix>-<date>-<time>: where a run writes unless told otherwise."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return output_dir() / f"{prefix}-{stamp}"


def write_bench_report(out_dir: str, stem: str, doc: dict[str, Any], records: list, markdown_table, plot) -> None:
    """A microbenchmark's outputs: `doc` (a results_header) with its records as OUT/STEM.json, its
    table (markdown_table(doc)) as OUT/STEM.md, its plot (plot(doc, OUT, STEM)); prints the table."""
    doc["records"] = records
    md = markdown_table(doc)
    path = write_json_and_markdown(out_dir, stem, doc, md)
    plot(doc, out_dir, stem)
    print(md)
    print(f"wrote {path}")


def rebuild_report(json_path: str, markdown_table, plot) -> None:
    """A microbenchmark's --report-only: its table (markdown_table(doc)) and plot (plot(doc, dir,
    stem)) made again beside the result file at json_path."""
    with open(json_path, encoding="utf-8") as f:
        doc = json.load(f)
    out = os.path.dirname(os.path.abspath(json_path))
    stem = os.path.splitext(os.path.basename(json_path))[0]
    with open(os.path.join(out, stem + ".md"), "w") as f:
        f.write(markdown_table(doc))
    plot(doc, out, stem)
