"""The main job (examples/serve_demo.py) on a machine without two GPUs: its command line, its model
directory, and that it runs from the installed package alone, as a user who installed the wheel
runs it (nothing else of this repository importable)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from examples import serve_demo as sd

REPO = Path(__file__).resolve().parents[2]


def refused(argv, capsys, *named):
    with pytest.raises(SystemExit) as e:
        sd.build_parser().parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    for text in (f"argument {argv[0]}", repr(argv[1]), *named):
        assert text in err, (text, err)


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-5", "soon"])
def test_refuses_bad_startup_timeout(value, capsys):
    refused(["--startup-timeout", value], capsys, "finite number > 0")


def test_defaults_to_a_directory_of_this_user():
    args = sd.build_parser().parse_args([])
    assert args.dir == os.path.join(tempfile.gettempdir(), f"yali-model-{os.getuid()}")
    assert (args.force, args.startup_timeout) == (False, 900)


def test_rewrites_its_own_dir_and_refuses_another_non_empty_one(tmp_path, monkeypatch, capsys):
    pytest.importorskip("mistral_common")
    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)  # stops after writing the model: no server
    monkeypatch.setattr(sd, "DEFAULT_DIR", str(tmp_path / "own"))
    assert sd.main([]) == 0 and sd.main([]) == 0  # a re-run rewrites its own directory
    assert (tmp_path / "own" / "config.json").is_file()
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("theirs")
    with pytest.raises(SystemExit) as e:
        sd.main(["--dir", str(other)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert str(other) in err and "--force" in err and (other / "config.json").read_text() == "theirs"
    assert sd.main(["--dir", str(other), "--force"]) == 0
    assert (other / "tekken.json").is_file()


def test_runs_from_the_installed_package_alone(tmp_path):
    """The script copied out of the repository, with only the package yali_vllm beside it on the
    path (as a wheel installs it) and no GPU visible: it writes the model and stops after the set-up."""
    pytest.importorskip("mistral_common")
    script = tmp_path / "serve_demo.py"
    shutil.copy(REPO / "examples" / "serve_demo.py", script)
    site = tmp_path / "site"
    site.mkdir()
    (site / "yali_vllm").symlink_to(REPO / "yali_vllm", target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(site), CUDA_VISIBLE_DEVICES="")
    model = tmp_path / "model"
    r = subprocess.run([sys.executable, str(script), "--dir", str(model)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert f"wrote the embedded 8b model to {model}" in r.stdout, r.stdout
    assert "stopping after the set-up" in r.stdout, r.stdout
    assert (model / "config.json").is_file()
