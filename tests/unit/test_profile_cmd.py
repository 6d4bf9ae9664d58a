"""`commd profile`: the profile JSON it writes, its errors, and the shipped profiles."""

from __future__ import annotations

import argparse
import json
import os
import stat
from pathlib import Path

import pytest
import torch

import commd.plan
from commd import models
from commd.cli import profile as profile_cmd
from commd.models.layer_timing import _ready_deltas

PROFILES = Path(commd.plan.__file__).parent / "profiles"


def parser() -> argparse.ArgumentParser:
    # A stand-in for commd.cli: the subcommand must work through register_command alone.
    p = argparse.ArgumentParser(prog="commd")
    profile_cmd.register_command(p.add_subparsers(dest="command", required=True))
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    return int(args.func(args))


def expected_layers(name: str) -> list[tuple[str, int]]:
    with torch.device("meta"):
        model = models.MODELS[name]()
    return [(n, p.numel() * p.element_size()) for n, p in model.named_parameters()]


def check_profile(profile: dict[str, object], model: str) -> None:
    assert set(profile) == {"name", "source", "forward_s", "layers"}
    assert isinstance(profile["source"], str) and profile["source"]
    assert isinstance(profile["forward_s"], float) and profile["forward_s"] > 0
    layers = profile["layers"]
    assert isinstance(layers, list)
    assert [(x["name"], x["bytes"]) for x in layers] == expected_layers(model)
    assert all(x["backward_s"] >= 0 for x in layers)
    assert sum(x["backward_s"] for x in layers) > 0


def test_profile_small_cnn(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "small.json"
    argv = ["profile", "--model", "small_cnn", "--iterations", "2", "--warmup", "1"]
    assert main([*argv, "--batch-size", "8", "--output", str(out)]) == 0
    profile = json.loads(out.read_text())
    check_profile(profile, "small_cnn")
    assert profile["name"] == "small_cnn"
    assert "--model small_cnn --batch-size 8 --iterations 2 --warmup 1" in profile["source"]
    assert "torch " + torch.__version__ in profile["source"]
    assert "12 layers" in capsys.readouterr().err
    assert not list(tmp_path.glob(".profile-*"))  # the temporary file was renamed


def test_profile_to_stdout_with_a_name(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["profile", "--model", "small_cnn", "--iterations", "1", "--warmup", "0"]
    assert main([*argv, "--batch-size", "4", "--name", "mine"]) == 0
    profile = json.loads(capsys.readouterr().out)
    check_profile(profile, "small_cnn")
    assert profile["name"] == "mine"


def test_unknown_model_is_a_one_line_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--model", "alexnet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("commd: ")
    assert "alexnet" in err[0] and all(name in err[0] for name in models.MODEL_NAMES)


def test_bad_numbers_are_rejected_by_the_parser() -> None:
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(["profile", "--model", "small_cnn", "--iterations", "0"])
    assert exc.value.code == 2


def test_help_lists_models(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(["profile", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "--model" in text and "--output" in text
    assert all(name in text for name in models.MODEL_NAMES)


def test_ready_deltas_charge_the_gap_since_the_previous_gradient() -> None:
    # Ready at 0.5, 0.2, 0.2, 0.9 s after backward start (forward order; backward reverses).
    assert _ready_deltas([0.5, 0.2, 0.2, 0.9]) == pytest.approx([0.3, 0.2, 0.0, 0.4])


def test_format_profile_is_json_with_one_layer_per_line() -> None:
    profile = {"name": "x", "source": "s", "forward_s": 1.0,
               "layers": [{"name": "a", "bytes": 4, "backward_s": 0.5}] * 3}  # fmt: skip
    text = profile_cmd.format_profile(profile)
    assert json.loads(text) == profile
    assert sum('"bytes"' in line for line in text.splitlines()) == 3


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_output_file_mode_follows_the_umask(tmp_path: Path, umask: int, mode: int) -> None:
    # Like a plain open(): 0666 & ~umask, not mkstemp's 0600.
    out = tmp_path / "profile.json"
    old = os.umask(umask)
    try:
        profile_cmd._write("{}\n", str(out))
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == mode
    assert out.read_text() == "{}\n"
    assert not list(tmp_path.glob(".profile-*"))


def test_defaults_are_quick() -> None:
    # A newcomer's first `commd profile --model resnet50` takes ~15 s on 2 cores, not ~100 s.
    args = parser().parse_args(["profile", "--model", "resnet50"])
    assert (args.batch_size, args.iterations, args.warmup) == (8, 5, 1)


@pytest.mark.parametrize("name", models.MODEL_NAMES)
def test_shipped_profiles_match_the_models(name: str) -> None:
    profile = json.loads((PROFILES / f"{name}.json").read_text())
    check_profile(profile, name)
    assert profile["name"] == name
    assert f"commd profile --model {name}" in str(profile["source"])
