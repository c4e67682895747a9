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


# ----------------------------------------------------------------------------- FP8 models
FP8 = [q for q in models.QUANT_CHOICES if q != models.QUANT_NONE]


@pytest.fixture(scope="module", params=FP8)
def fp8_dir(request, tmp_path_factory):
    pytest.importorskip("mistral_common")
    quant = request.param
    return quant, models.write_model_dir(tmp_path_factory.mktemp(quant) / "model", "8b", quant=quant)


def test_quant_choices_are_none_and_the_three_fp8_schemes():
    assert models.QUANT_CHOICES == ("none", "fp8-static", "fp8-dynamic", "fp8-block")
    assert set(models.VLLM_QUANTIZATION) == set(FP8)


def test_fp8_dir_carries_its_quantization_config_and_the_bf16_shape(fp8_dir):
    quant, path = fp8_dir
    cfg = json.loads((path / "config.json").read_text())
    assert cfg.pop("quantization_config") == models.QUANT_CONFIGS[quant]
    assert cfg == models.model_config("8b")  # otherwise the bf16 model's config
    assert "quantization_config" not in models.model_config("8b", "none")


def test_compressed_tensors_fields_per_scheme():
    def group(quant):
        (g,) = models.QUANT_CONFIGS[quant]["config_groups"].values()
        return g["weights"], g["input_activations"]

    w, a = group("fp8-static")
    assert (w["strategy"], w["dynamic"], a["strategy"], a["dynamic"]) == ("tensor", False, "tensor", False)
    w, a = group("fp8-dynamic")
    assert (w["strategy"], w["dynamic"], a["strategy"], a["dynamic"]) == ("channel", False, "token", True)
    for arg in (*group("fp8-static"), *group("fp8-dynamic")):
        assert (arg["num_bits"], arg["type"], arg["symmetric"]) == (8, "float", True)
    block = models.QUANT_CONFIGS["fp8-block"]
    assert (block["quant_method"], block["activation_scheme"], block["weight_block_size"]) == ("fp8", "dynamic", [128, 128])


def test_quantisation_is_refused_for_unknown_names_and_moe_sizes(tmp_path, capsys):
    with pytest.raises(ValueError, match="unknown quantisation 'int8'"):
        models.model_config("8b", "int8")
    with pytest.raises(ValueError, match="dense sizes .*'mixtral-8x7b'"):
        models.model_config("mixtral-8x7b", "fp8-block")
    err = _refused([str(tmp_path / "m"), "--size", "qwen3-30b-a3b", "--quant", "fp8-static"], capsys)
    assert "'fp8-static' is for the dense sizes" in err and not (tmp_path / "m").exists()
    assert "invalid choice: 'fp4'" in _refused([str(tmp_path / "m"), "--quant", "fp4"], capsys)


def test_cli_writes_an_fp8_dir(tmp_path, capsys):
    pytest.importorskip("mistral_common")
    assert models.main([str(tmp_path / "m"), "--size", "70b", "--quant", "fp8-block"]) == 0
    out = capsys.readouterr().out
    assert "vLLM reads it as its 'fp8' method" in out and "--load-format dummy" in out
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["hidden_size"] == 8192 and cfg["quantization_config"]["weight_block_size"] == [128, 128]
    assert "--quant" in models.build_parser().format_help()


def test_a_rerun_with_another_quantisation_needs_force(tmp_path, capsys):
    pytest.importorskip("mistral_common")
    d = models.write_model_dir(tmp_path / "m", "8b", quant="fp8-static")
    assert "--force" in _refused([str(d), "--quant", "fp8-dynamic"], capsys)
    assert models.main([str(d), "--quant", "fp8-dynamic", "--force"]) == 0
    assert json.loads((d / "config.json").read_text())["quantization_config"] == models.QUANT_CONFIGS["fp8-dynamic"]


def _vllm_quant_config(path):
    """vLLM's ModelConfig of the model directory `path` and the quantisation config vLLM's model
    loader builds from it (what the linear layers then ask for their quant method)."""
    from vllm.config import LoadConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.weight_utils import get_quant_config

    mc = EngineArgs(model=str(path), tokenizer_mode="mistral", load_format="dummy",
                    max_model_len=2048).create_model_config()
    return mc, get_quant_config(mc, LoadConfig(load_format="dummy"))


def test_vllm_detects_the_quantisation_method(fp8_dir):
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    from yali_vllm.plugin.fusion_patch import model_quantisation

    quant, path = fp8_dir
    mc, qc = _vllm_quant_config(path)
    assert mc.quantization == models.VLLM_QUANTIZATION[quant] and mc.quantization in QUANTIZATION_METHODS
    assert qc.get_name() == mc.quantization
    assert type(qc).__name__ == {"compressed-tensors": "CompressedTensorsConfig", "fp8": "Fp8Config"}[mc.quantization]
    # The plugin's fusion routing sees a quantised model under the same name.
    assert model_quantisation(type("Cfg", (), {"model_config": mc})()) == mc.quantization


def _linear_scheme_keys(quant, mc, qc):
    """(activation quant key, weight quant key, scheme name) of a decoder Linear layer as vLLM's
    quant config builds it. The FP8 W8A8 schemes need compute capability 8.9; a CPU platform
    reports none, which vLLM's capability check accepts, so the scheme a Hopper GPU gets is built."""
    import torch
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu"))):
        if quant == "fp8-block":
            from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

            method = Fp8LinearMethod(qc)
            assert method.block_quant and method.weight_block_size == [128, 128]
            return method.activation_quant_key, method.weight_quant_key, type(method).__name__
        scheme = qc.get_scheme(torch.nn.Linear(128, 128), "model.layers.0.mlp.down_proj")
        assert scheme.is_static_input_scheme == (quant == "fp8-static")
        return scheme.activation_quant_key, scheme.weight_quant_key, type(scheme).__name__


def test_vllm_builds_the_expected_fp8_scheme(fp8_dir):
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.utils import quant_utils as qu

    quant, path = fp8_dir
    mc, qc = _vllm_quant_config(path)
    group128 = qu.GroupShape(1, 128)
    expected = {
        "fp8-static": (qu.kFp8StaticTensorSym, qu.kFp8StaticTensorSym, "CompressedTensorsW8A8Fp8"),
        "fp8-dynamic": (qu.kFp8DynamicTokenSym, qu.kFp8StaticChannelSym, "CompressedTensorsW8A8Fp8"),
        "fp8-block": (qu.create_fp8_quant_key(static=False, group_shape=group128),
                      qu.create_fp8_quant_key(static=True, group_shape=qu.GroupShape(128, 128)), "Fp8LinearMethod"),
    }[quant]
    assert _linear_scheme_keys(quant, mc, qc) == expected
    if quant != "fp8-block":  # lm_head stays bf16
        assert qc.ignore == ["lm_head"]
    else:
        assert qc.is_checkpoint_fp8_serialized and qc.activation_scheme == "dynamic"
