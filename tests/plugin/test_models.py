"""CPU tests of yali_vllm/models.py: the embedded model directories (Llama, Qwen3-MoE, Mixtral shapes)."""

from __future__ import annotations

import json

import pytest

from yali_vllm import models

SHAPES = {
    "8b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
    ),
    "70b": dict(
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=28672,
    ),
    "qwen3-30b-a3b": dict(
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
    ),
    "mixtral-8x7b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
}
ARCHITECTURES = {"8b": "LlamaForCausalLM", "70b": "LlamaForCausalLM", "qwen3-30b-a3b": "Qwen3MoeForCausalLM",
                 "mixtral-8x7b": "MixtralForCausalLM"}
MODEL_TYPES = {"8b": "llama", "70b": "llama", "qwen3-30b-a3b": "qwen3_moe", "mixtral-8x7b": "mixtral"}
CONFIG_CLASSES = {"8b": "LlamaConfig", "70b": "LlamaConfig", "qwen3-30b-a3b": "Qwen3MoeConfig",
                  "mixtral-8x7b": "MixtralConfig"}


@pytest.fixture(scope="module", params=list(SHAPES))
def model_dir(request, tmp_path_factory):
    pytest.importorskip("mistral_common")
    size = request.param
    return size, models.write_model_dir(tmp_path_factory.mktemp(size) / "model", size)


def test_written_dir_has_config_and_tokenizer(model_dir):
    size, path = model_dir
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "tekken.json"]
    cfg = json.loads((path / "config.json").read_text())
    for key, value in SHAPES[size].items():
        assert cfg[key] == value, key
    assert cfg["architectures"] == [ARCHITECTURES[size]]
    assert cfg["model_type"] == MODEL_TYPES[size]
    assert cfg["vocab_size"] == 131072
    assert cfg["torch_dtype"] == "bfloat16"
    assert cfg.get("rope_scaling") is None
    assert cfg["head_dim"] == 128
    if size not in models.MOE_SIZES:  # Qwen3-MoE's attention is wider than its hidden size
        assert cfg["hidden_size"] // cfg["num_attention_heads"] == 128


def test_tokenizer_is_mistral_commons_tekken_with_matching_vocab(model_dir):
    _, path = model_dir
    src = models.tokenizer_source()
    assert (path / "tekken.json").read_bytes() == src.read_bytes()
    tok = json.loads((path / "tekken.json").read_text())
    assert tok["config"]["default_vocab_size"] == models.VOCAB_SIZE


def test_unknown_size_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown model size '13b'"):
        models.write_model_dir(tmp_path, "13b")


def test_configs_are_copies():
    models.model_config("8b")["hidden_size"] = 1
    assert models.model_config("8b")["hidden_size"] == 4096


def test_cli_writes_dir_and_prints_serve_command(tmp_path, capsys):
    pytest.importorskip("mistral_common")
    assert models.main([str(tmp_path / "m"), "--size", "8b"]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "m" / "config.json").is_file()
    assert "vllm serve" in out and "--tokenizer-mode mistral" in out
    assert "--load-format dummy" in out and "--tensor-parallel-size 2" in out


def test_vllm_config_loader_accepts_dir(model_dir):
    pytest.importorskip("vllm")
    from vllm.transformers_utils.config import get_config

    size, path = model_dir
    cfg = get_config(str(path), trust_remote_code=False)
    assert type(cfg).__name__ == CONFIG_CLASSES[size]
    assert cfg.vocab_size == 131072
    for key, value in SHAPES[size].items():
        assert getattr(cfg, key) == value, key


def test_vllm_model_config_from_engine_args(model_dir):
    pytest.importorskip("vllm")
    import torch
    from vllm.engine.arg_utils import EngineArgs

    size, path = model_dir
    mc = EngineArgs(
        model=str(path), tokenizer_mode="mistral", load_format="dummy", max_model_len=2048
    ).create_model_config()
    assert mc.architectures == [ARCHITECTURES[size]]
    assert mc.dtype == torch.bfloat16
    assert mc.get_vocab_size() == 131072
    assert mc.get_hidden_size() == SHAPES[size]["hidden_size"]
    assert mc.max_model_len == 2048


def test_vllm_mistral_tokenizer_loads_from_dir(model_dir):
    pytest.importorskip("vllm")
    from vllm.tokenizers import get_tokenizer

    _, path = model_dir
    tok = get_tokenizer(str(path), tokenizer_mode="mistral")
    assert type(tok).__name__ == "MistralTokenizer"
    assert len(tok) == 131072  # == vocab_size: every id has an embedding row
    ids = tok.encode("Hello world")
    assert ids[0] == 1 and max(ids) < 131072  # <s>, then BPE ids
    assert tok.decode(ids[1:]) == "Hello world"


# ----------------------------------------------------------------------------- bad input
def _refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        models.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("name", ["", "  "])
def test_cli_refuses_an_empty_directory_argument(name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    err = _refused([name], capsys)
    assert "argument dir" in err and f"{name!r} is empty" in err
    assert list(tmp_path.iterdir()) == []  # nothing written into the current directory
    with pytest.raises(ValueError, match="empty name"):
        models.write_model_dir(name)


def test_non_empty_directory_is_refused_unless_force(tmp_path, capsys):
    pytest.importorskip("mistral_common")
    d = tmp_path / "real-model"
    d.mkdir()
    (d / "config.json").write_text("theirs")
    (d / "weights.bin").write_bytes(b"w")
    err = _refused([str(d)], capsys)
    assert str(d) in err and "--force" in err
    assert (d / "config.json").read_text() == "theirs" and not (d / "tekken.json").exists()
    with pytest.raises(FileExistsError, match="not empty"):
        models.write_model_dir(d)
    assert models.main([str(d), "--force"]) == 0
    assert json.loads((d / "config.json").read_text())["hidden_size"] == 4096
    assert (d / "weights.bin").read_bytes() == b"w"  # other files are kept


def test_existing_empty_and_missing_directories_are_written(tmp_path):
    pytest.importorskip("mistral_common")
    assert models.write_model_dir(tmp_path, "8b") == tmp_path  # exists, empty
    assert models.write_model_dir(tmp_path / "a" / "b", "8b").joinpath("tekken.json").is_file()  # created


def test_a_rerun_into_the_same_model_is_accepted_and_another_size_is_refused(tmp_path, capsys):
    pytest.importorskip("mistral_common")
    d = models.write_model_dir(tmp_path / "m", "70b")
    before = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}
    assert models.main([str(d), "--size", "70b"]) == 0  # same files, same content: left as they are
    assert {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == before
    assert "--force" in _refused([str(d), "--size", "8b"], capsys)  # would change config.json
    assert json.loads((d / "config.json").read_text())["hidden_size"] == 8192


def test_a_file_in_place_of_the_directory_is_refused(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("keep")
    assert "not a directory" in _refused([str(f), "--force"], capsys)
    assert f.read_text() == "keep"


@pytest.mark.parametrize("name", ["config.json", "tekken.json"])
def test_symlinks_are_never_written_through(name, tmp_path, capsys):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    d = tmp_path / "model"
    d.mkdir()
    (d / name).symlink_to(victim)
    for argv in ([str(d)], [str(d), "--force"]):
        err = _refused(argv, capsys)
        assert str(d) in err
    assert "symbolic link" in err and str(d / name) in err
    with pytest.raises(FileExistsError, match="symbolic link"):
        models.write_model_dir(d, force=True)
    assert victim.read_text() == "keep" and (d / name).is_symlink()
    assert not (d / ({"config.json", "tekken.json"} - {name}).pop()).exists()  # nothing half-written


def test_write_file_does_not_follow_a_link_created_after_the_check(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "config.json").symlink_to(victim)
    with pytest.raises(OSError):
        models._write_file(tmp_path / "config.json", b"{}")
    assert victim.read_text() == "keep"


def test_parser_defaults():
    args = models.build_parser().parse_args(["m"])
    assert (args.dir, args.size, args.force) == ("m", "8b", False)


def test_moe_serve_command_uses_data_and_expert_parallelism(tmp_path, capsys):
    assert models.main([str(tmp_path / "m"), "--size", "qwen3-30b-a3b"]) == 0
    out = capsys.readouterr().out
    assert "--data-parallel-size 2 --enable-expert-parallel" in out and "--tensor-parallel-size" not in out
    assert set(models.MOE_SIZES) <= set(models.CONFIGS)
