"""CPU tests of the core: configuration parsing and errors, the size -> kernel
table, should_use decisions, and the extension loading without a GPU. They need
the compiled extension (built by `pip install`), not a GPU."""
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

import yali_vllm
from yali_vllm import _ext, config
from yali_vllm.communicator import servable

pytestmark = pytest.mark.skipif(_ext.library_error() is not None, reason=f"extension not built: {_ext.library_error()}")
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("YALI_"):
            monkeypatch.delenv(k)


def test_import_without_gpu_reports_reason():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert not yali_vllm.available()
    assert "no CUDA GPU" in yali_vllm.unavailable_reason()
    with pytest.raises(RuntimeError, match="no CUDA device"):
        torch.ops.yali.create(0, 0)


def test_default_table_is_monotone_and_covers_all_sizes():
    order = {"flash-push": 0, "stream": 1}
    last = -1
    for nbytes in [2, 16, 2 * KiB, 64 * KiB, 128 * KiB, 128 * KiB + 16, 1 * MiB, 8 * MiB, 8 * MiB + 16, 1 * GiB,
                   2 * GiB]:
        kernel, blocks, chunk = config.plan(nbytes)
        assert kernel is not None, nbytes
        assert order[kernel] >= last, (nbytes, kernel)
        last = order[kernel]
        assert 1 <= blocks <= 128
        if kernel == "stream":
            assert chunk % 16 == 0 and 16 <= chunk <= 64 * KiB
    assert config.plan(2 * GiB + 2)[0] is None  # above YALI_MAX_BYTES
    assert config.plan(0)[0] is None


def test_default_table_pushes_up_to_flash_size():
    assert config.plan(2)[0] == "flash-push"
    assert config.plan(8 * MiB) == ("flash-push", 128, 0)
    assert config.plan(2 * KiB)[1] == 2  # YALI_DEV_PUSH_CTA_BYTES=1K: one CTA per KiB, at most 128
    assert config.plan(8 * MiB + 16)[0] == "stream"


def test_push_boundary_follows_env(monkeypatch):
    monkeypatch.setenv("YALI_DEV_FLASH_BYTES", "64K")
    monkeypatch.setenv("YALI_DEV_PUSH_CTA_BYTES", "4K")
    assert config.plan(64 * KiB) == ("flash-push", 16, 0)
    assert config.plan(64 * KiB + 16)[0] == "stream"
    monkeypatch.setenv("YALI_DEV_FLASH_BYTES", "16M")
    monkeypatch.setenv("YALI_KERNEL_MODE", "flash")
    assert config.plan(16 * MiB)[0] == "flash-push"


def test_stream_boundary_follows_env(monkeypatch):
    monkeypatch.setenv("YALI_DEV_STREAM_MIN", "1M")
    assert config.plan(1 * MiB)[0] == "flash-push"
    assert config.plan(1 * MiB + 16)[0] == "stream"


# Removed knobs: those of the retired flash-ll, one-shot and two-shot kernels, and the decided
# ones (docs/TUNING.md: fixed by measurement).
REMOVED_KNOBS = ["YALI_DEV_PUSH_MAX", "YALI_DEV_LL_MAX", "YALI_DEV_LL_CTA_BYTES", "YALI_DEV_ONESHOT_MAX",
                 "YALI_DEV_FLASH_CTA_BYTES", "YALI_DEV_LANES", "YALI_DEV_SLOTS", "YALI_DEV_FLASH_CTAS",
                 "YALI_DEV_FUSED_CTA_BYTES", "YALI_DEV_FUSED_ROW_LOADS_EARLY"]


@pytest.mark.parametrize("var", REMOVED_KNOBS)
def test_removed_knobs_are_refused(monkeypatch, var):
    # refused as unknown, not ignored: by the package, listing the knobs, and by the C++ core itself
    monkeypatch.setenv(var, "4K")
    with pytest.raises(ValueError, match=f"unknown YALI_\\* variable\\(s\\) {var}='4K': .*YALI_DEV_FLASH_BYTES"):
        config.kernel_config()
    with pytest.raises(ValueError, match=f"{var}=4K is invalid: no such YALI_DEV_\\* knob \\(known: YALI_DEV_FLASH_BYTES"):
        _ext.ops().config_string()


def test_buffer_holds_only_what_the_config_selects(monkeypatch):
    # stream ready + credit flags (2 x 128 lanes x 16 slots x 8 B), the call descriptor slots (2 x 16 B,
    # one 256-byte-aligned area), the push area (2 parities x 8 MiB), the stream ring (128 lanes x 8 slots
    # x 64 KiB).
    assert torch.ops.yali.shared_bytes_for_env() == 32 * KiB + 256 + 16 * MiB + 64 * MiB
    monkeypatch.setenv("YALI_DEV_FLASH_BYTES", "1M")
    assert torch.ops.yali.shared_bytes_for_env() == 32 * KiB + 256 + 2 * MiB + 64 * MiB


def test_kernel_mode_forces_family(monkeypatch):
    assert config.plan(64 * MiB, "flash")[0] is None  # flash cannot take more than its buffer
    assert config.plan(4 * KiB, "stream")[0] == "stream"
    monkeypatch.setenv("YALI_KERNEL_MODE", "stream")
    assert config.plan(2 * KiB)[0] == "stream"
    monkeypatch.setenv("YALI_KERNEL_MODE", "flash")
    assert config.plan(4 * MiB)[0] == "flash-push"
    assert config.plan(64 * MiB)[0] is None


def test_stream_chunks_fit_slots(monkeypatch):
    monkeypatch.setenv("YALI_DEV_SLOT_BYTES", "128K")
    k, lanes, chunk = config.plan(1 * GiB)
    assert (k, lanes, chunk) == ("stream", 128, 128 * KiB)
    k, lanes, chunk = config.plan(1 * MiB + 6, "stream")  # 8 KiB + a bit per lane: one chunk per lane
    assert (k, lanes) == ("stream", 128) and chunk * lanes >= 1 * MiB + 6 and chunk % 16 == 0
    monkeypatch.setenv("YALI_DEV_SLOT_BYTES", "4K")  # the 128 x 8 ring of 4 KiB slots
    assert config.plan(1 * MiB, "stream") == ("stream", 128, 4 * KiB) and config.plan(64 * KiB, "stream") == ("stream", 128, 512)


@pytest.mark.parametrize("var,value,fragment", [
    ("YALI_KERNEL_MODE", "fast", "one of auto, flash, stream"),
    ("YALI_MAX_BYTES", "-5", "byte count"),
    ("YALI_MAX_BYTES", "12Q", "byte count"),
    ("YALI_DEV_FUSED_CLUSTER", "9", "[-1, 8]"),
    ("YALI_DEV_FUSED_CLUSTER", "-2", "[-1, 8]"),
    ("YALI_DEV_SLOT_BYTES", "5000", "multiple of 4096"),
    ("YALI_DEV_PDL", "x", "integer"),
    ("YALI_DEV_PUSH_CTA_BYTES", "100", "byte count"),
    ("YALI_DEV_PDL", "2", "integer in [0, 1]"),
    ("YALI_DEV_FUSED_BATCH_POLL_MIN", "-1", "byte count"),
    ("YALI_DEV_BATCH_POLL", "1", "unknown YALI_* variable"),  # a removed knob: refused, not ignored
    ("YALI_DEV_FUSED_SPLIT", "1", "unknown YALI_* variable"),  # the removed fused row split
    ("YALI_DEV_PUSH_CTA_BYTE", "1K", "YALI_DEV_PUSH_CTA_BYTES"),  # a typo names the known knobs
    ("YALI_TIMEOUT_S", "-1", "seconds"),
])
def test_bad_values_name_the_variable(monkeypatch, var, value, fragment):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError) as e:
        config.kernel_config()
    assert var in str(e.value) and fragment in str(e.value)


def test_good_values_parse(monkeypatch):
    monkeypatch.setenv("YALI_MAX_BYTES", "256M")
    monkeypatch.setenv("YALI_DEV_SLOT_BYTES", "32k")
    monkeypatch.setenv("YALI_TIMEOUT_S", "0")
    c = config.kernel_config()
    assert c["max_bytes"] == 256 * MiB and c["slot_bytes"] == 32 * KiB and c["timeout_s"] == 0


def test_fused_batch_poll_threshold(monkeypatch):
    # the measured default: the fused op polls a row's vectors batched from 32 tokens of hidden 8192 bf16 on
    assert config.kernel_config()["fused_batch_poll_min"] == 512 * KiB
    monkeypatch.setenv("YALI_DEV_FUSED_BATCH_POLL_MIN", "0")  # always batched
    assert config.kernel_config()["fused_batch_poll_min"] == 0
    monkeypatch.setenv("YALI_DEV_FUSED_BATCH_POLL_MIN", "1G")
    assert config.kernel_config()["fused_batch_poll_min"] == 1 << 30


@pytest.mark.parametrize("value,expected", [("1", True), ("on", True), ("No", False), ("", True)])
def test_env_flag(monkeypatch, value, expected):
    monkeypatch.setenv("YALI_ENABLE", value)
    assert config.env_flag("YALI_ENABLE", True) is expected


def test_env_flag_bad_value(monkeypatch):
    monkeypatch.setenv("YALI_ENABLE", "maybe")
    with pytest.raises(ValueError, match="YALI_ENABLE"):
        config.env_flag("YALI_ENABLE", True)


def test_servable_decisions():
    dev = torch.device("cpu")
    x = torch.zeros(1024, dtype=torch.bfloat16)
    assert servable(x, dev, 1 << 20)
    assert not servable(x, torch.device("cuda", 0), 1 << 20)   # other device
    assert not servable(x.to(torch.int32), dev, 1 << 20)       # dtype
    # The address never decides (both ranks must route alike): unaligned inputs go through a copy.
    assert servable(x[1:], dev, 1 << 20)
    assert servable(x[8:], dev, 1 << 20)
    assert not servable(x.clone().requires_grad_(), dev, 1 << 20)                        # autograd
    assert not servable(torch.nested.nested_tensor([x[:4], x[:8]]), dev, 1 << 20)      # nested
    assert not servable(x.view(32, 32).t(), dev, 1 << 20)      # non-contiguous
    assert not servable(x, dev, 2047)                          # larger than the limit
    assert not servable(x[:0], dev, 1 << 20)                   # empty
    assert not servable("not a tensor", dev, 1 << 20)


def test_aligned_copies_only_unaligned_tensors():
    from yali_vllm.communicator import aligned

    x = torch.arange(1024, dtype=torch.bfloat16)
    assert aligned(x) is x and aligned(None) is None
    y = aligned(x[3:])
    assert y.data_ptr() % 16 == 0 and torch.equal(y, x[3:]) and y.data_ptr() != x[3:].data_ptr()


def test_unknown_yali_variables_are_refused_by_name(monkeypatch):
    monkeypatch.setenv("YALI_MAX_BYTE", "1M")  # a typo of YALI_MAX_BYTES
    monkeypatch.setenv("YALI_TIMEOUT", "5")  # of YALI_TIMEOUT_S
    with pytest.raises(ValueError) as e:
        config.kernel_config()
    msg = str(e.value)
    assert "YALI_MAX_BYTE='1M'" in msg and "YALI_TIMEOUT='5'" in msg
    assert "YALI_MAX_BYTES" in msg and "YALI_TIMEOUT_S" in msg and "YALI_DEV_*" in msg
    monkeypatch.delenv("YALI_MAX_BYTE")
    monkeypatch.delenv("YALI_TIMEOUT")
    # The YALI_* names belong to the settings: the scripts' variables are named otherwise (LOAD_*,
    # BENCH_DEBUG), and a former setting or a script's old name is refused like a typo.
    for name in ("YALI_OVERLAP", "YALI_LOAD_MODEL", "YALI_ALLOW_UNCHECKED", "YALI_BUILD_LEGACY"):
        with pytest.raises(ValueError, match=f"{name}='1'"):
            config.check_environment({name: "1"})
    monkeypatch.setenv("LOAD_MODEL", "m")
    assert config.kernel_config()["max_bytes"] == 2 * GiB


def test_the_smallest_flash_buffer(monkeypatch):
    monkeypatch.setenv("YALI_DEV_FLASH_BYTES", "4K")
    assert config.kernel_config()["flash_bytes"] == 4 * KiB
    assert config.plan(4 * KiB) == ("flash-push", 4, 0)
    assert config.plan(4 * KiB + 16)[0] == "stream"


@pytest.mark.parametrize("value,ok", [("0", True), ("0.001", True), ("86400", True), ("1e-12", False),
                                      ("0.0005", False), ("86401", False), ("nan", False), ("-1", False)])
def test_timeout_range(monkeypatch, value, ok):
    monkeypatch.setenv("YALI_TIMEOUT_S", value)
    if ok:
        assert config.kernel_config()["timeout_s"] == float(value)
    else:
        with pytest.raises(ValueError, match=r"YALI_TIMEOUT_S=.* 0 \(none\) or seconds in \[0.001, 86400\]"):
            config.kernel_config()


def test_fake_impl_traces_without_gpu():
    """The op's fake implementation lets FakeTensor tracing (torch.compile) see it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from yali_vllm import ops

    ops.register_fakes()
    with FakeTensorMode():
        x = torch.empty(4096, dtype=torch.bfloat16)
        out = torch.empty_like(x)
        torch.ops.yali.all_reduce(0, x, out)
        with pytest.raises(Exception):
            torch.ops.yali.all_reduce(0, x, torch.empty(7, dtype=torch.bfloat16))


def test_library_is_python_version_independent():
    libs = [f for f in os.listdir(os.path.dirname(yali_vllm.__file__)) if f.startswith("_C")]
    assert libs and all(f.endswith(".abi3.so") for f in libs), libs
    out = subprocess.run(["nm", "-D", "--undefined-only", os.path.join(os.path.dirname(yali_vllm.__file__), libs[0])],
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("nm not available")
    assert "PyInit" not in out.stdout and "_Py" not in out.stdout  # no CPython ABI dependency


def test_sm90a_code_is_in_the_library():
    import shutil

    cands = [shutil.which("cuobjdump"), "/usr/local/cuda/bin/cuobjdump"]
    try:  # triton (a dependency of torch on Linux) ships one
        import triton

        cands.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    except ImportError:
        pass
    cuobjdump = next((c for c in cands if c and os.access(c, os.X_OK)), None)
    if cuobjdump is None:
        pytest.skip("cuobjdump not available")
    lib = [f for f in os.listdir(os.path.dirname(yali_vllm.__file__)) if f.startswith("_C")][0]
    # The header of each code object says its architecture ("arch = sm_90a"); older cuobjdumps name
    # an sm_90a ELF "sm_90" in --list-elf, so the header is what is checked.
    out = subprocess.run([cuobjdump, "--dump-sass", os.path.join(os.path.dirname(yali_vllm.__file__), lib)],
                         capture_output=True, text=True)
    archs = set(re.findall(r"arch = (sm_\w+)", out.stdout))
    assert archs == {"sm_90a"}, (archs, out.stderr[-2000:])


def test_fused_cluster_knob(monkeypatch):
    # default: clusters by message size (plan_table.h: kFusedBands); the knob sets the most CTAs of one
    assert config.kernel_config()["fused_cluster"] == -1
    assert config.fused_plan(1, 8192, torch.bfloat16)["cluster"] == 4
    monkeypatch.setenv("YALI_DEV_FUSED_CLUSTER", "0")
    assert config.kernel_config()["fused_cluster"] == 0 and config.fused_plan(1, 8192, torch.bfloat16)["cluster"] == 1
    monkeypatch.setenv("YALI_DEV_FUSED_CLUSTER", "8")
    assert config.fused_plan(64, 8192, torch.bfloat16)["cluster"] == 8  # above 128 KiB too


# ---- every setting declared once (csrc/core/yali/common/settings.def), read by C++ and Python

CORE = [s for s in config.SETTINGS.values() if s.field is not None]


def test_the_core_starts_from_the_listed_defaults():
    c = config.kernel_config()
    assert set(c) == {s.field for s in CORE} | {"ep_slot_bytes"}
    for s in CORE:
        assert c[s.field] == s.value({}), (s.name, c[s.field], s.default)


def past_the_bounds(s: config.Setting) -> list[str]:
    """Values just outside `s`'s range (and off its multiple), as a user would write them."""
    if s.type == "int":
        return [str(int(s.low) - 1), str(int(s.high) + 1)]
    low, high, step = config.parse_bytes(s.low), config.parse_bytes(s.high), config.parse_bytes(s.step or "1")
    return ([str(low - step)] if low >= step else []) + [str(high + step)] + ([str(low + step // 2)] if step > 1 else [])


@pytest.mark.parametrize("s", [s for s in CORE if s.type in ("bytes", "int")], ids=lambda s: s.name)
def test_the_core_refuses_values_past_the_listed_bounds(monkeypatch, s):
    # The C++ core's message says exactly what the list accepts (Setting.accepted: the same words).
    for value in past_the_bounds(s):
        monkeypatch.setenv(s.name, value)
        with pytest.raises(ValueError) as e:
            config.kernel_config()
        assert str(e.value).endswith(f"{s.name}={value} is invalid: expected {s.accepted()}"), str(e.value)
        with pytest.raises(ValueError, match=re.escape(s.accepted())):
            s.parse(value)


def test_the_python_settings_parse_as_listed(monkeypatch):
    assert config.ep_slot_bytes({"YALI_EP_SLOT_BYTES": "64K"}) == 64 * KiB == config.setting("YALI_EP_SLOT_BYTES", {
        "YALI_EP_SLOT_BYTES": "65536"})
    assert (config.EP_SLOT_DEFAULT, config.EP_SLOT_RANGE) == (2 * MiB, (4 * KiB, 256 * MiB))
    assert config.env_flag("YALI_EP", environ={}) is False and config.env_flag("YALI_ENABLE", environ={}) is True
    assert config.env_flag("YALI_ENABLE", False, {}) is False  # a caller's own default wins when unset
    with pytest.raises(ValueError, match=r"invalid YALI_ALLOW_SHARED_GPU='2': expected an integer in \[0, 1\]"):
        config.setting("YALI_ALLOW_SHARED_GPU", {"YALI_ALLOW_SHARED_GPU": "2"})


def test_at_most_twelve_tuning_knobs():
    knobs = [n for n in config.SETTINGS if n.startswith(config.DEV_PREFIX)]
    assert 1 <= len(knobs) <= 12, knobs
    assert not set(knobs) & set(REMOVED_KNOBS)


def test_the_plugin_serves_the_measured_world_sizes_by_default():
    assert config.DEFAULT_WORLD_SIZES == tuple(sorted(config.ON_BY_DEFAULT)) == config.plugin_world_sizes({})


def test_the_package_reads_the_cores_list():
    core = Path(__file__).resolve().parents[2] / "csrc" / "core" / "yali" / "common" / "settings.def"
    if not core.is_file():
        pytest.skip("no source tree (an installed wheel)")
    assert config.SETTINGS_FILE.read_text() == core.read_text()


def test_a_line_that_is_not_a_setting_is_refused(tmp_path):
    f = tmp_path / "settings.def"
    f.write_text('// a comment\nYALI_PLUGIN_SETTING(YALI_X, flag, "1", "", "", "", "x")\nYALI_SETTING(YALI_Y, y)\n')
    with pytest.raises(ValueError, match=r"settings.def:3: not a settings line"):
        config.read_settings(f)
    f.write_text('YALI_PLUGIN_SETTING(YALI_X, colour, "1", "", "", "", "x")\n')
    with pytest.raises(ValueError, match=r"YALI_X has the unknown type 'colour'"):
        config.read_settings(f)


def test_the_docs_name_every_setting_with_its_default():
    root = Path(__file__).resolve().parents[2]
    tuning, readme = (root / "docs" / "TUNING.md").read_text(), (root / "README.md").read_text()
    for s in config.SETTINGS.values():
        doc = tuning if s.name.startswith(config.DEV_PREFIX) else readme
        assert re.search(rf"^\| `{s.name}` \| `{re.escape(s.default)}`", doc, re.M), s.name
    listed = set(re.findall(r"^\| `(YALI_DEV_\w+)` \|", tuning, re.M))
    assert listed == {n for n in config.SETTINGS if n.startswith(config.DEV_PREFIX)}
