"""``kvcert serve`` (kvcert.vllm.serve): the command line it builds from the user's, without vLLM.

The server it starts is tested in the vLLM venv (tests/vllm/test_vllm_server.py starts its server with
``kvcert serve``); here: the user's flags reach vLLM unchanged and in order, the plugin's scheduler, worker and
settings are added, its settings are checked before anything starts, and every refusal names the flag.
"""

from __future__ import annotations

import json
import shlex

import pytest

from kvcert.cli import main as cli_main
from kvcert.vllm.serve import SCHEDULER_CLS, SERVER_MODULE, WORKER_CLS, ServeError, server_command


def _tail(cmd: list[str]) -> tuple[list[str], dict]:
    """The arguments after ``--model M`` minus the plugin's three flags, and the additional config."""
    i = cmd.index("--additional-config")
    config = json.loads(cmd[i + 1])
    rest = cmd[cmd.index("--model") + 2:]
    for flag in ("--scheduler-cls", "--worker-cls", "--additional-config"):
        j = rest.index(flag)
        del rest[j:j + 2]
    return rest, config


def test_user_flags_pass_through_unchanged_and_the_plugin_is_added():
    user = ["--port", "8001", "--seed", "7", "--enable-prefix-caching", "--max-model-len=4096", "--dtype",
            "bfloat16", "--served-model-name", "m"]
    cmd, show = server_command(["/models/x", *user, "--kvcert-compression-ratio", "0.25", "--kvcert-scorer",
                                "keydiff", "--kvcert-sketch", "null"], python="/py")
    assert not show
    assert cmd[:5] == ["/py", "-m", SERVER_MODULE, "--model", "/models/x"]
    assert cmd[cmd.index("--scheduler-cls") + 1] == SCHEDULER_CLS
    assert cmd[cmd.index("--worker-cls") + 1] == WORKER_CLS
    rest, config = _tail(cmd)
    assert rest == user  # vLLM's own --seed is the engine's, not the design's
    assert config == {"kvcert": {"compression_ratio": 0.25, "scorer": "keydiff", "sketch": None}}


def test_model_as_flag_json_fields_and_the_users_additional_config():
    cmd, _ = server_command(["--model", "/m", "--kvcert", '{"seed": 3, "granularity": "block"}', "--kvcert-delta",
                             "0.1", "--additional-config", '{"other_plugin": {"a": 1}}'], python="/py")
    assert cmd[3:5] == ["--model", "/m"]
    rest, config = _tail(cmd)
    assert rest == []
    assert config == {"other_plugin": {"a": 1}, "kvcert": {"seed": 3, "granularity": "block", "delta": 0.1}}
    # the plugin's settings given inside the user's additional config are kept as they are
    cmd, _ = server_command(["/m", "--additional-config", '{"kvcert": {"compression_ratio": 0.0}}'], python="/py")
    assert _tail(cmd)[1] == {"kvcert": {"compression_ratio": 0.0}}


def test_no_model_means_the_default_model(monkeypatch, tmp_path):
    import kvcert.vllm.model as model

    monkeypatch.setattr(model, "default_model_path", lambda: tmp_path)
    cmd, _ = server_command(["--port", "1"], python="/py")
    assert cmd[3:5] == ["--model", str(tmp_path)] and _tail(cmd) == (["--port", "1"], {"kvcert": {}})


@pytest.mark.parametrize("argv, named", [
    (["/m", "--scheduler-cls", "x.Y"], "--scheduler-cls"),
    (["/m", "--worker-cls=x.Y"], "--worker-cls"),
    (["/m", "--kvcert-compression-ratio", "1.5"], "compression_ratio"),
    (["/m", "--kvcert-compresion-ratio", "0.5"], "--kvcert-compresion-ratio"),
    (["/m", "--kvcert-seed", "x"], "seed"),
    (["/m", "--kvcert", "[1]"], "--kvcert must be a JSON object"),
    (["/m", "--kvcert-seed"], "--kvcert-seed needs a value"),
    (["/m", "--additional-config", '{"kvcert": {"seed": 1}}', "--kvcert-seed", "2"], "use one"),
    (["/m", "--additional-config", '{"kvcert": {"floor": 2}}'], "--additional-config's 'kvcert'"),
    (["/m", "--model", "/n"], "already given"),
])
def test_refusals_name_the_flag(argv, named):
    with pytest.raises(ServeError, match=named.replace("[", r"\[")):
        server_command(argv, python="/py")


def test_the_cli_prints_the_command_or_the_error(capsys):
    assert cli_main(["serve", "/m", "--port", "9", "--kvcert-compression-ratio", "0", "--print-command"]) == 0
    printed = shlex.split(capsys.readouterr().out.strip())
    assert printed[1:6] == ["-m", SERVER_MODULE, "--model", "/m", "--port"]
    assert json.loads(printed[printed.index("--additional-config") + 1]) == {"kvcert": {"compression_ratio": 0}}
    assert cli_main(["serve", "/m", "--worker-cls", "w"]) == 2
    err = capsys.readouterr().err
    assert "kvcert serve: error: --worker-cls" in err and "usage: kvcert serve" in err
    assert cli_main(["serve", "--help"]) == 0 and "kvcert serve [MODEL]" in capsys.readouterr().out
