"""Settings: defaults < TOML config file < COMMD_* environment < command line, and the CLI."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest

from commd.daemon import settings
from commd.daemon.settings import OPTIONS, Settings, SettingsError, load, split_host_port


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="commd run")
    settings.add_arguments(parser)
    return parser.parse_args(list(argv))


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def write_config(path: Path, values: dict[str, Any]) -> str:
    lines = [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


# One row per option: a value for each layer (file, env, command line), all different, and
# what each turns into.
LAYERS: dict[str, tuple[Any, str, str, tuple[Any, Any, Any]]] = {
    "socket": ("/f/commd.sock", "/e/commd.sock", "/c/commd.sock",
               ("/f/commd.sock", "/e/commd.sock", "/c/commd.sock")),
    "listen": ("10.0.0.1:1001", "10.0.0.2:1002", "[::1]:1003",
               ("10.0.0.1:1001", "10.0.0.2:1002", "[::1]:1003")),
    "cluster_key": ("/f/cluster.key", "/e/cluster.key", "/c/cluster.key",
                    ("/f/cluster.key", "/e/cluster.key", "/c/cluster.key")),
    "insecure": (True, "no", "yes", (True, False, True)),
    "backend": ("nccl", "gloo", "nccl", ("nccl", "gloo", "nccl")),
    "advertise": ("10.1.0.1", "10.1.0.2", "10.1.0.3", ("10.1.0.1", "10.1.0.2", "10.1.0.3")),
    "timeout_s": (5, "6.5", "7.25", (5.0, 6.5, 7.25)),
    "peer_timeout_s": (5, "6", "7", (5.0, 6.0, 7.0)),
    "watchdog_factor": (3, "4", "5", (3.0, 4.0, 5.0)),
    "watchdog_floor_s": (1, "2", "3", (1.0, 2.0, 3.0)),
    "stall_warn_s": (30, "40", "50", (30.0, 40.0, 50.0)),
    "stall_timeout_s": (100, "200", "0", (100.0, 200.0, 0.0)),
    "max_layers": (100, "200", "300", (100, 200, 300)),
    "max_job_bytes": (1 << 20, "2097152", "3145728", (1 << 20, 2 << 20, 3 << 20)),
    "planner": ("mgwfbp", "wfbp", "horovod", ("mgwfbp", "wfbp", "horovod")),
    "log_level": ("debug", "warning", "error", ("debug", "warning", "error")),
    "metrics_listen": ("127.0.0.1:9101", "0.0.0.0:9102", "[::1]:0",
                       ("127.0.0.1:9101", "0.0.0.0:9102", "[::1]:0")),
}


def test_every_option_has_a_precedence_case_and_a_settings_field() -> None:
    names = [o.name for o in OPTIONS]
    assert sorted(LAYERS) == sorted(names)
    assert names == [f.name for f in dataclasses.fields(Settings)]
    for option in OPTIONS:
        assert getattr(Settings(), option.name) == option.default


def test_defaults() -> None:
    assert load(parse(), {}) == Settings()
    assert load(None, {}) == Settings()


@pytest.mark.parametrize("name", list(LAYERS))
def test_precedence(name: str, tmp_path: Path) -> None:
    in_file, in_env, on_cli, (from_file, from_env, from_cli) = LAYERS[name]
    default = getattr(Settings(), name)
    env_name = f"COMMD_{name.upper()}"
    config = write_config(tmp_path / "commd.toml", {name: in_file})

    def only(value: Any, got: Settings) -> None:
        assert getattr(got, name) == value
        others = {k: v for k, v in dataclasses.asdict(got).items() if k != name}
        assert others == {k: v for k, v in dataclasses.asdict(Settings()).items() if k != name}

    only(default, load(parse(), {}))
    only(from_file, load(parse("--config", config), {}))
    only(from_env, load(parse("--config", config), {env_name: in_env}))
    only(from_cli, load(parse("--config", config, flag(name), on_cli), {env_name: in_env}))
    only(from_env, load(parse(), {env_name: in_env}))
    only(from_cli, load(parse(flag(name), on_cli), {env_name: in_env}))
    only(from_cli, load(parse(flag(name), on_cli), {}))
    only(from_file, load(parse(), {"COMMD_CONFIG": config}))


def test_all_layers_at_once(tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.toml", {"socket": "/f.sock", "timeout-s": 9,
                                                "log-level": "debug", "backend": "nccl"})
    env = {"COMMD_TIMEOUT_S": "11", "COMMD_BACKEND": "gloo", "COMMD_LISTEN": "1.2.3.4:5"}
    got = load(parse("--config", config, "--backend", "auto", "--advertise", "9.9.9.9"), env)
    assert got == Settings(socket="/f.sock", listen="1.2.3.4:5", backend="auto",
                           advertise="9.9.9.9", timeout_s=11.0, planner="optimal",
                           log_level="debug")
    assert (got.listen_host, got.listen_port) == ("1.2.3.4", 5)


def test_command_line_config_wins_over_commd_config(tmp_path: Path) -> None:
    first = write_config(tmp_path / "a.toml", {"planner": "wfbp"})
    second = write_config(tmp_path / "b.toml", {"planner": "ddp"})
    assert load(parse("--config", second), {"COMMD_CONFIG": first}).planner == "ddp"
    assert load(parse(), {"COMMD_CONFIG": first}).planner == "wfbp"


def test_listen_host_and_port() -> None:
    # Protected mode: without a cluster key peers are served on loopback only by default.
    assert (Settings().listen_host, Settings().listen_port) == ("127.0.0.1", 29600)
    keyed = Settings(cluster_key="/etc/commd/cluster.key")
    assert (keyed.listen_host, keyed.listen_port) == ("0.0.0.0", 29600)
    ipv6 = Settings(listen="[::1]:29601")
    assert (ipv6.listen_host, ipv6.listen_port) == ("::1", 29601)
    assert split_host_port("node-7.example:0", "x") == ("node-7.example", 0)


@pytest.mark.parametrize("value", ["nonsense", "host:", ":29600", "host:65536", "host:-1",
                                   "host:8o", "host:29600:"])
def test_bad_listen(value: str) -> None:
    with pytest.raises(SettingsError, match=r"^commd: listen must be HOST:PORT") as info:
        load(parse("--listen", value), {})
    assert repr(value) in str(info.value)
    with pytest.raises(SettingsError, match=r"^commd: listen must be HOST:PORT"):
        load(parse(), {"COMMD_LISTEN": value})


def test_bad_listen_in_file(tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.toml", {"listen": "nowhere"})
    with pytest.raises(SettingsError, match=r"^commd: listen must be HOST:PORT, got 'nowhere'"):
        load(parse("--config", config), {})


@pytest.mark.parametrize("value", ["-1", "0", "-0.5"])
def test_timeout_must_be_positive(value: str, tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"^commd: timeout_s must be positive"):
        load(parse("--timeout-s", value), {})
    with pytest.raises(SettingsError, match=r"^commd: timeout_s must be positive"):
        load(parse(), {"COMMD_TIMEOUT_S": value})
    config = write_config(tmp_path / "c.toml", {"timeout_s": float(value)})
    with pytest.raises(SettingsError, match=r"^commd: timeout_s must be positive"):
        load(parse("--config", config), {})


def test_nan_timeout_is_refused() -> None:
    with pytest.raises(SettingsError, match="timeout_s"):
        load(parse(), {"COMMD_TIMEOUT_S": "nan"})


def test_non_numeric_timeout() -> None:
    with pytest.raises(SettingsError, match=r"^commd: COMMD_TIMEOUT_S must be a float, got 'soon'"):
        load(parse(), {"COMMD_TIMEOUT_S": "soon"})


def test_non_numeric_timeout_in_file(tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.toml", {"timeout_s": "soon"})
    with pytest.raises(SettingsError, match=r"^commd: timeout_s in .*c\.toml must be a float"):
        load(parse("--config", config), {})


def test_unknown_backend() -> None:
    expected = r"^commd: COMMD_BACKEND must be one of auto, gloo, nccl"
    with pytest.raises(SettingsError, match=expected):
        load(parse(), {"COMMD_BACKEND": "mpi"})


def test_unknown_backend_in_file(tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.toml", {"backend": "mpi"})
    with pytest.raises(SettingsError, match=r"^commd: backend in .* must be one of auto, gloo"):
        load(parse("--config", config), {})


def test_unknown_backend_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse("--backend", "mpi")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "'mpi'" in err and "auto" in err and "gloo" in err and "nccl" in err


def test_unknown_log_level() -> None:
    with pytest.raises(SettingsError, match=r"^commd: COMMD_LOG_LEVEL must be one of debug"):
        load(parse(), {"COMMD_LOG_LEVEL": "loud"})


def test_unknown_planner_is_refused() -> None:
    with pytest.raises(SettingsError, match="planner"):
        load(parse(), {"COMMD_PLANNER": "fastest"})


def test_unknown_toml_key(tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.toml", {"socket": "/s", "sokcet": "/t"})
    with pytest.raises(SettingsError) as info:
        load(parse("--config", config), {})
    message = str(info.value)
    assert message.startswith("commd: unknown key 'sokcet'")
    assert config in message
    for option in OPTIONS:
        assert option.name in message


@pytest.mark.parametrize("line", ["socket = 5", "timeout_s = true", "advertise = [1, 2]"])
def test_wrong_toml_type_is_refused(line: str, tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(line + "\n")
    with pytest.raises(SettingsError, match=r"^commd: "):
        load(parse("--config", str(path)), {})


def test_invalid_toml(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('socket = "/unterminated\n')
    with pytest.raises(SettingsError) as info:
        load(parse("--config", str(path)), {})
    assert str(info.value).startswith(f"commd: config file {path} is not valid TOML")


def test_missing_config_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    for args, env in [(parse("--config", str(path)), {}), (parse(), {"COMMD_CONFIG": str(path)})]:
        with pytest.raises(SettingsError) as info:
            load(args, env)
        message = str(info.value)
        assert message.startswith(f"commd: cannot read config file {path}")
        assert "No such file" in message


def test_settings_error_is_a_value_error() -> None:
    assert issubclass(SettingsError, ValueError)


# --- the command line --------------------------------------------------------------------------


def test_run_with_a_bad_env_value_exits_2_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from commd.cli.main import main

    for name in list(os.environ):
        if name.startswith("COMMD_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("COMMD_TIMEOUT_S", "-3")
    # an unusable socket too, so that a daemon that wrongly starts fails instead of serving
    assert main(["run", "--socket", "/nonexistent/dir/commd.sock"]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == ["commd: timeout_s must be positive, got -3.0"]


def test_no_subcommand_prints_help_and_returns_2(capsys: pytest.CaptureFixture[str]) -> None:
    from commd.cli.main import main

    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


@pytest.mark.parametrize(("where", "value"), [("env", "maybe"), ("env", ""), ("file", "yes"),
                                              ("file", 1)])
def test_insecure_takes_only_a_yes_or_no(where: str, value: Any, tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"^commd: (COMMD_INSECURE|insecure in .*) must be"):
        if where == "env":
            load(parse(), {"COMMD_INSECURE": value})
        else:
            load(parse("--config", write_config(tmp_path / "c.toml", {"insecure": value})), {})


def test_insecure_alone_on_the_command_line_means_yes() -> None:
    assert load(parse("--insecure"), {}).insecure is True
    assert load(parse("--insecure", "off"), {"COMMD_INSECURE": "1"}).insecure is False


@pytest.mark.parametrize(("where", "value"), [("env", "many"), ("env", "1.5"), ("file", 1.5),
                                              ("file", True), ("cli", "0"), ("env", "-3")])
def test_limits_take_only_positive_integers(where: str, value: Any, tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"(?i)^commd: .*max_layers"):
        if where == "env":
            load(parse(), {"COMMD_MAX_LAYERS": value})
        elif where == "file":
            load(parse("--config", write_config(tmp_path / "c.toml", {"max_layers": value})), {})
        else:
            load(parse("--max-layers", value), {})


# --- --metrics-listen ----------------------------------------------------------------------------

BAD_METRICS_LISTEN = ["nonsense", "host:", ":9100", "host:65536", "host:-1", "host:9o",
                      "host:9100:", "9100"]


@pytest.mark.parametrize("value", BAD_METRICS_LISTEN)
def test_bad_metrics_listen(value: str, tmp_path: Path) -> None:
    expected = r"^commd: metrics_listen must be HOST:PORT, got "
    with pytest.raises(SettingsError, match=expected) as info:
        load(parse("--metrics-listen", value), {})
    assert str(info.value) == f"commd: metrics_listen must be HOST:PORT, got {value!r}"
    with pytest.raises(SettingsError, match=expected):
        load(parse(), {"COMMD_METRICS_LISTEN": value})
    config = write_config(tmp_path / "c.toml", {"metrics_listen": value})
    with pytest.raises(SettingsError, match=expected):
        load(parse("--config", config), {})


def test_metrics_listen_in_file_must_be_a_string(tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.toml", {"metrics_listen": 9100})
    with pytest.raises(SettingsError, match=r"^commd: metrics_listen in .* must be a str"):
        load(parse("--config", config), {})


def test_metrics_are_off_by_default_and_empty_means_off() -> None:
    assert Settings().metrics_listen == ""
    assert load(parse("--metrics-listen", ""), {"COMMD_METRICS_LISTEN": "127.0.0.1:1"}) \
        .metrics_listen == ""
