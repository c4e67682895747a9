"""CPU tests of the benchmark command lines' arguments: every bad value is refused by
the command's own parser (exit 2, the value and the accepted range named) before
anything starts, and the defaults still parse to what they were."""
from __future__ import annotations

import pytest

from benchmarks import allreduce_bench as ab
from benchmarks import fused_bench as fb
from benchmarks import load_test as lt
from benchmarks import serving_bench as sb
from benchmarks.common import cli_args
from benchmarks.serving import bench_run, schema


def refused(parse, argv, capsys, *named, value=None):
    """parse(argv) exits 2 and stderr names the option, the bad value (argv[1] unless
    `value` says which element of a list) and `named`."""
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    for text in (f"argument {argv[0]}", repr(argv[1] if value is None else value), *named):
        assert text in err, (text, err)
    return err


FLOAT_BAD = [("nan", "finite number > 0"), ("inf", "finite number > 0"), ("-1", "finite number > 0"),
             ("0", "finite number > 0"), ("abc", "finite number > 0")]
COUNT_BAD = [("0", "integer >= 1"), ("-3", "integer >= 1"), ("1.5", "integer >= 1"), ("x", "integer >= 1")]
PORT_BAD = [("0", "1..65535"), ("70000", "1..65535"), ("-1", "1..65535"), ("http", "1..65535")]


# ----------------------------------------------------------------------------- cli_args
def test_shared_types_accept_their_range_ends():
    assert cli_args.tcp_port("1") == 1 and cli_args.tcp_port("65535") == 65535
    assert cli_args.positive_int(" 7 ") == 7 and cli_args.non_negative_int("0") == 0
    assert cli_args.positive_float("1e-3") == 1e-3 and cli_args.fraction("1") == 1.0
    assert cli_args.int_range(0, 10)("10") == 10 and cli_args.float_range(1.0, 2.0)("1") == 1.0
    for bad in ("0", "1.01", "nan", "inf", "-0.5"):
        with pytest.raises(Exception, match=repr(bad).replace(".", r"\.")):
            cli_args.fraction(bad)


# ----------------------------------------------------------------------------- serving_bench
SB_FLOATS = ["--budget-s", "--startup-timeout-s", "--stop-grace-s", "--startup-estimate-s", "--bench-timeout-s",
             "--bench-estimate-s"]
SB_COUNTS = ["--repeats", "--prompts-per-concurrency", "--min-prompts", "--random-input-len", "--random-output-len",
             "--max-model-len", "--max-num-seqs", "--locust-duration-s", "--soak-users"]
SB_ZERO_OK = ["--warmup-requests", "--profile-tokens", "--locust-users", "--soak-s", "--seed"]


@pytest.mark.parametrize("opt", SB_FLOATS)
@pytest.mark.parametrize("value,accepted", FLOAT_BAD)
def test_serving_bench_refuses_bad_durations(opt, value, accepted, capsys):
    refused(sb.build_parser().parse_args, [opt, value], capsys, accepted)


@pytest.mark.parametrize("opt", SB_COUNTS)
@pytest.mark.parametrize("value,accepted", COUNT_BAD)
def test_serving_bench_refuses_bad_counts(opt, value, accepted, capsys):
    refused(sb.build_parser().parse_args, [opt, value], capsys, accepted)


@pytest.mark.parametrize("opt", SB_ZERO_OK)
def test_serving_bench_refuses_negative_off_switches(opt, capsys):
    refused(sb.build_parser().parse_args, [opt, "-1"], capsys, "integer >= 0")


@pytest.mark.parametrize("value,accepted", PORT_BAD)
def test_serving_bench_refuses_bad_ports(value, accepted, capsys):
    refused(sb.build_parser().parse_args, ["--port", value], capsys, accepted)


def test_serving_bench_refuses_bad_lists_and_fractions(capsys):
    refused(sb.build_parser().parse_args, ["--concurrency", "1,0,8"], capsys, "integer >= 1", value="0")
    refused(sb.build_parser().parse_args, ["--concurrency", ","], capsys, "positive integers")
    for value in ("0", "1.5", "nan"):
        refused(sb.build_parser().parse_args, ["--gpu-memory-utilization", value], capsys, "(0, 1]")


def test_serving_bench_defaults_parse_as_before():
    args = sb.build_parser().parse_args([])
    assert (args.budget_s, args.port, args.repeats, args.concurrency) == (540.0, 8100, 2, [1, 8, 32])
    assert (args.max_model_len, args.gpu_memory_utilization, args.max_num_seqs) == (2048, 0.90, None)
    assert (args.warmup_requests, args.profile_tokens, args.locust_users, args.soak_s, args.seed) == (4, 0, 0, 0, 0)
    assert bench_run.validate_args(args) == list(schema.DEFAULT_CONFIGS)
    args = sb.build_parser().parse_args(["--port", "65535", "--budget-s", "0.5", "--concurrency", "32,1"])
    assert (args.port, args.budget_s, args.concurrency) == (65535, 0.5, [32, 1])


# ----------------------------------------------------------------------------- load_test
@pytest.mark.parametrize("argv,accepted", [
    (["--users", "0"], "integer >= 1"),
    (["--users", "-5"], "integer >= 1"),
    (["--duration-s", "0"], "integer >= 1"),
    (["--spawn-rate", "inf"], "finite number > 0"),
    (["--spawn-rate", "0"], "finite number > 0"),
    (["--budget-s", "nan"], "finite number > 0"),
    (["--port", "70000"], "1..65535"),
    (["--max-tokens", "0"], "1..4096"),
    (["--max-tokens", "5000"], "1..4096"),
    (["--prompt-words", "9000"], "1..8192"),
    (["--chat-weight", "-1"], "0..1000"),
    (["--completions-weight", "1001"], "0..1000"),
    (["--request-timeout-s", "0.5"], "[1, 3600]"),
    (["--request-timeout-s", "nan"], "[1, 3600]"),
])
def test_load_test_refuses_bad_values(argv, accepted, capsys):
    refused(lt.build_parser().parse_args, argv, capsys, accepted)


def test_load_test_defaults_resolve_as_before():
    args = lt.build_parser().parse_args([])
    assert lt.resolve_args(args) == list(lt.DEFAULT_CONFIGS)
    assert (args.users, args.duration_s, args.spawn_rate, args.budget_s) == (32, 60, 8.0, 540.0)
    soak = lt.build_parser().parse_args(["--soak"])
    assert lt.resolve_args(soak) == ["yali"] and (soak.users, soak.duration_s) == (64, 120)
    off = lt.build_parser().parse_args(["--chat-weight", "0", "--completions-weight", "0"])
    with pytest.raises(SystemExit, match="both 0"):
        lt.resolve_args(off)


# ----------------------------------------------------------------------------- allreduce_bench
@pytest.mark.parametrize("argv,accepted,value", [
    (["--sizes", "0"], "positive multiple of 4", None),
    (["--sizes", "2K,3"], "positive multiple of 4", "3"),
    (["--sizes", "1K,-1M"], "positive multiple of 4", "-1M"),
    (["--sizes", "1X"], "positive multiple of 4", None),
    (["--sizes", "nan"], "positive multiple of 4", None),
    (["--sizes", "inf"], "positive multiple of 4", None),
    (["--sizes", ","], "empty list of sizes", None),
    (["--dtypes", "int8"], "choose from bf16, fp16, fp32", None),
    (["--backends", "nccl,nccl2"], "choose from yali", "nccl2"),
    (["--graph-ops", "0"], "integer >= 1", None),
    (["--replays", "-1"], "integer >= 1", None),
    (["--samples", "1.5"], "integer >= 1", None),
    (["--timeout", "nan"], "finite number > 0", None),
    (["--timeout", "0"], "finite number > 0", None),
])
def test_allreduce_bench_refuses_bad_values_before_spawning(argv, accepted, value, capsys, monkeypatch):
    monkeypatch.setattr(ab, "run_ranks", lambda *a, **k: pytest.fail("ranks spawned"))
    refused(ab.main, argv, capsys, accepted, value=value)


def test_allreduce_bench_defaults_and_quick_reach_the_ranks_as_lists(monkeypatch):
    import torch

    args = ab.build_parser().parse_args([])
    assert args.sizes[0] == 2048 and args.sizes[-1] == 1 << 30 and len(args.sizes) == 10
    assert args.dtypes == ["bf16", "fp16", "fp32"] and args.backends == ab.ALL_BACKENDS
    assert (args.graph_ops, args.replays, args.samples, args.timeout, args.world_size) == (50, 20, 1000, 1500, 2)
    seen = {}
    monkeypatch.setattr(ab, "run_ranks", lambda worker, a, timeout, what, world_size:
                        seen.update(args=a, timeout=timeout, world_size=world_size))
    monkeypatch.setattr(ab, "write_outputs", lambda a, res: None)
    monkeypatch.setenv("YALI_ALLOW_SHARED_GPU", "1")  # a machine with fewer GPUs than ranks runs them on GPU 0
    ab.main(["--quick", "--backends", "nccl,yali", "--timeout", "60", "--world-size", "4"])
    a = seen["args"]
    assert a.sizes == [2048, 64 << 10, 1 << 20, 4 << 20, 64 << 20] and a.dtypes == ["bf16"]
    assert a.backends == ["yali", "nccl"] and seen["timeout"] == 60.0
    assert seen["world_size"] == a.world_size == 4 and a.shared_gpu == (torch.cuda.device_count() < 4)


# ----------------------------------------------------------------------------- fused_bench
@pytest.mark.parametrize("argv,accepted", [
    (["--budget-s", "nan"], "finite number > 0"),
    (["--budget-s", "-1"], "finite number > 0"),
    (["--timeout", "inf"], "finite number > 0"),
    (["--eps", "0"], "finite number > 0"),
    (["--target-ratio", "nan"], "finite number > 0"),
    (["--fi-max-tokens", "0"], "integer >= 1"),
    (["--target-tokens", "x"], "integer >= 1"),
    (["--graph-ops", "0"], "integer >= 1"),
    (["--replays", "-2"], "integer >= 1"),
])
def test_fused_bench_refuses_bad_values(argv, accepted, capsys):
    refused(fb.parse_args, argv, capsys, accepted)


def test_fused_bench_defaults_parse_as_before():
    a = fb.parse_args([])
    assert (a.budget_s, a.timeout, a.eps, a.fi_max_tokens, a.graph_ops, a.replays) == (420.0, 570.0, 1e-5, 2048, 50, 200)
    assert a.world_size == 2 and fb.parse_args(["--world-size", "8"]).world_size == 8


# ----------------------------------------------------------------------------- --world-size
WORLD_SIZE_PARSERS = {
    "allreduce_bench": lambda argv: ab.build_parser().parse_args(argv),
    "fused_bench": fb.parse_args,
    "serving_bench": lambda argv: sb.build_parser().parse_args(argv),
    "load_test": lambda argv: lt.build_parser().parse_args(argv),
}


@pytest.mark.parametrize("command", WORLD_SIZE_PARSERS)
@pytest.mark.parametrize("value,accepted", [
    ("3", "YALI serves 2, 4, 6 or 8 ranks"), ("1", "YALI serves 2, 4, 6 or 8 ranks"),
    ("16", "YALI serves 2, 4, 6 or 8 ranks"), ("0", "integer >= 1"), ("four", "integer >= 1"),
])
def test_every_benchmark_refuses_a_world_size_yali_does_not_serve(command, value, accepted, capsys):
    refused(WORLD_SIZE_PARSERS[command], ["--world-size", value], capsys, accepted)


@pytest.mark.parametrize("command", WORLD_SIZE_PARSERS)
def test_every_benchmark_takes_the_world_sizes_yali_serves(command):
    parse = WORLD_SIZE_PARSERS[command]
    assert parse([]).world_size == 2
    assert [parse(["--world-size", n]).world_size for n in ("2", "4", "6", "8")] == [2, 4, 6, 8]


def test_too_few_gpus_names_the_option_and_the_count():
    assert cli_args.too_few_gpus(4, 4) is None and cli_args.too_few_gpus(2, 8) is None
    assert cli_args.too_few_gpus(8, 2) == "--world-size 8 needs 8 GPUs, and 2 are visible (torch.cuda.device_count())"
    assert [cli_args.rank_device(r, False) for r in range(4)] == [0, 1, 2, 3]
    assert [cli_args.rank_device(r, True) for r in range(4)] == [0, 0, 0, 0]


def _more_ranks_than_gpus() -> int:
    """A world size above this machine's GPU count (the test skips on a machine with 8 GPUs)."""
    import torch

    n = next((n for n in (2, 4, 6, 8) if n > torch.cuda.device_count()), None)
    if n is None:
        pytest.skip("this machine has a GPU for each of 8 ranks")
    return n


def test_place_ranks_refuses_more_ranks_than_gpus_unless_they_may_share_gpu_0(monkeypatch, capsys):
    n = _more_ranks_than_gpus()
    monkeypatch.delenv("YALI_ALLOW_SHARED_GPU", raising=False)
    with pytest.raises(SystemExit, match=f"--world-size {n} needs {n} GPUs.*YALI_ALLOW_SHARED_GPU=1"):
        cli_args.place_ranks(n)
    monkeypatch.setenv("YALI_ALLOW_SHARED_GPU", "1")
    assert cli_args.place_ranks(n) is True
    err = capsys.readouterr().err
    assert f"the {n} ranks shared GPU 0" in err and "timings are not valid" in err


@pytest.mark.parametrize("main", [ab.main, fb.main], ids=["allreduce_bench", "fused_bench"])
def test_benchmarks_refuse_more_ranks_than_gpus_before_spawning(main, monkeypatch, tmp_path):
    n = _more_ranks_than_gpus()
    monkeypatch.delenv("YALI_ALLOW_SHARED_GPU", raising=False)
    module = ab if main is ab.main else fb
    monkeypatch.setattr(module, "run_ranks", lambda *a, **k: pytest.fail("ranks spawned"))
    with pytest.raises(SystemExit, match=f"--world-size {n} needs {n} GPUs"):
        main(["--world-size", str(n), "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())
