"""What a person sees when a command line or a connection is wrong: argparse's error naming the
flag and the value (exit 2, no traceback), a help text and default on every option, and a client
that fails within seconds with the library's own error and a hint instead of waiting out its
retries."""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import time
from pathlib import Path

import pytest
from kvalloc.server import cli
from kvalloc.server.client import Client
from kvalloc.server.contract.errors import ServiceUnreachable, TokenRejected
from kvalloc.server.devtools.launch import ServiceProcess, kvalloc_command


def fails_with(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run ``kvalloc argv`` in this process; it must exit 2. Its stderr."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(list(argv))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--port", "99999"], "argument --port: port 99999 is out of range 0-65535"),
    (["--port", "-1"], "argument --port: port -1 is out of range 0-65535"),
    (["--port", "http"], "argument --port: port 'http' is not a number"),
    (["--ipc", "garbage"],
     "argument --ipc: 'garbage' is not ipc:///path, tcp://host:port or stream:///path"),
    (["--ipc", "foo://bar"],
     "argument --ipc: 'foo://bar' is not ipc:///path, tcp://host:port or stream:///path"),
    (["--ipc", "tcp://127.0.0.1:99999"], "argument --ipc: port 99999 is out of range 0-65535"),
    (["--ipc", "tcp://:5555"], "need tcp://host:port"),
    (["--num-blocks", "many"], "argument --num-blocks: invalid int value: 'many'"),
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--cache-group", "team"], "argument --cache-group: 'team' is not NAME=ID[,ID...]"),
    (["--cache-group", "=a,b"], "argument --cache-group: '=a,b' is not NAME=ID[,ID...]"),
])
def test_serve_refuses_a_bad_flag_naming_it_and_the_value(capsys, argv, message):
    err = fails_with(capsys, "serve", *argv)
    assert message in err
    assert err.startswith("usage: kvalloc serve")


@pytest.mark.parametrize("argv, message", [
    (["--num-blocks", "-3"], "--num-blocks -3: Input should be greater than 0"),
    (["--max-workers", "0"], "--max-workers 0: Input should be greater than 0"),
    (["--device", "tpu"], "--device tpu: device: 'tpu' is not a torch device"),
    (["--cache-group", "x=a", "--cache-group", "y=a,b"],
     "configuration: cache_groups: worker 'a' is in groups 'x' and 'y'"),
    # Socket directories are checked where the service runs (a deployed command line is also
    # read elsewhere), before anything is bound.
    (["--ipc", "ipc:///nonexistent/x"],
     "argument --ipc: /nonexistent/x: directory /nonexistent does not exist"),
    (["--uds", "/nonexistent/dir/rest.sock"],
     "argument --uds: /nonexistent/dir/rest.sock: directory /nonexistent/dir does not exist"),
])
def test_serve_reports_an_invalid_configuration_by_its_flag(capsys, argv, message):
    assert cli.main(["serve", "--no-tcp", *argv]) == 2
    assert f"kvalloc serve: error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "argument --steps: 0 is not in [1, inf]"),
    (["--duration", "-1"], "argument --duration: -1 is not in (0, inf]"),
    (["--skip-rate", "2"], "argument --skip-rate: 2 is not in [0, 1]"),
    (["--draft-len", "-1"], "argument --draft-len: -1 is not in [0, inf]"),
    (["--address", "garbage"], "must start with ipc://, tcp://, stream://, http:// or unix://"),
    (["--address", "http://127.0.0.1:70000"], "port 70000 is out of range 0-65535"),
    (["--address", "tcp://127.0.0.1"], "need tcp://host:port"),
    (["--prompt-len", "9:3"], "'9:3': need 1 <= MIN <= MAX"),
])
def test_loadgen_refuses_a_bad_flag_naming_it_and_the_value(capsys, argv, message):
    assert message in fails_with(capsys, "loadgen", *argv)


@pytest.mark.parametrize("argv, message", [
    (["--num-blocks", "0"], "argument --num-blocks: 0 is not in [1, inf]"),
    (["--osl", "0"], "argument --osl: 0 is not in [1, inf]"),
    (["--plot", "/nonexistent/sim.png"], "argument --plot: /nonexistent/sim.png: directory "
                                         "/nonexistent does not exist"),
    (["--json", "/nonexistent/sim.json"], "argument --json: /nonexistent/sim.json"),
])
def test_simulate_refuses_a_bad_flag_before_simulating(capsys, argv, message):
    assert message in fails_with(capsys, "simulate", *argv)


@pytest.mark.parametrize("where", ["a directory", "/proc"])
def test_simulate_refuses_an_output_it_cannot_write_before_the_run(capsys, tmp_path, where):
    """Checked when the flags are read, not when a finished run writes its summary; the check
    leaves no file behind."""
    target = tmp_path if where == "a directory" else Path("/proc/kvalloc-summary.json")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["simulate", "--num-requests", "2", "--no-progress", "--json", str(target)])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert f"argument --json: {target}" in err and "Traceback" not in err
    assert out == "", "no run started"
    assert list(tmp_path.iterdir()) == []


def test_simulate_writes_its_summary_to_a_writable_path(capsys, tmp_path):
    summary = tmp_path / "summary.json"
    assert cli.main(["simulate", "--num-requests", "2", "--no-progress",
                     "--json", str(summary)]) in (0, 1)
    assert json.loads(summary.read_text())


def test_simulate_reports_flags_that_make_no_pool(capsys):
    assert cli.main(["simulate", "--num-blocks", "3", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "kvalloc simulate: error: max_seq_len: 132088 needs 516 blocks per sequence but the " \
           "pool has 3" in err
    assert "Value error" not in err


def test_a_bad_flag_from_the_installed_command_is_no_traceback(tmp_path: Path):
    r = subprocess.run([*kvalloc_command(), "serve", "--ipc", "tcp://127.0.0.1:99999"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "port 99999 is out of range" in r.stderr and "Traceback" not in r.stderr


def parser_of(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"kvalloc {command}", formatter_class=cli.HelpFormatter)
    importlib.import_module(cli.COMMANDS[command][0]).add_arguments(parser)
    return parser


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_option_has_a_help_text_and_shows_its_default(command):
    parser = parser_of(command)
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{action.option_strings} has no help text"
        if action.default is not None and action.default is not False:
            assert "default" in action.help or f"(default: {action.default})" in text, (
                f"{action.option_strings} does not show its default {action.default!r}")


def test_the_top_level_help_describes_the_tool_in_whole_sentences(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert cli.DESCRIPTION in out and cli.DESCRIPTION.endswith(".")
    for name in cli.COMMANDS:
        assert name in out


# ---------------------------------------------------------------- the client's connection errors


@pytest.mark.parametrize("address", ["ipc:///nonexistent/kvalloc.ipc", "tcp://127.0.0.1:9",
                                     "stream:///nonexistent/kvalloc.stream",
                                     "http://127.0.0.1:9", "unix:///nonexistent/rest.sock"])
def test_a_client_with_no_service_fails_within_seconds_with_a_hint(address):
    start = time.monotonic()
    with Client(address, timeout_s=10, retries=2) as client, \
            pytest.raises(ServiceUnreachable) as exc_info:
        client.register()
    # The reply timeout and retries (30 s here) are not waited out: no call was delivered.
    assert time.monotonic() - start < 10
    assert f"is kvalloc serve running at {address}?" in str(exc_info.value)
    assert isinstance(exc_info.value, ConnectionError)


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory):
    with ServiceProcess(tmp_path_factory.mktemp("guarded"), "--device", "cpu", "--num-blocks",
                        "300", env={"KVALLOC_TOKEN": "s3cret"}) as svc:
        yield svc


@pytest.mark.parametrize("transport", ["ipc", "stream", "rest_tcp", "rest_unix"])
@pytest.mark.parametrize("token, says", [
    ("", "the service requires a token and none was sent: set KVALLOC_TOKEN"),
    ("wrong", "the service rejected the token (KVALLOC_TOKEN or token=) as wrong"),
])
def test_a_refused_token_is_named_as_such_on_every_transport(guarded, monkeypatch, transport,
                                                             token, says):
    monkeypatch.delenv("KVALLOC_TOKEN", raising=False)
    with Client(getattr(guarded, transport), token=token) as client, \
            pytest.raises(TokenRejected) as exc_info:
        client.register()
    assert exc_info.value.status == 401
    assert str(exc_info.value) == f"401 unauthorized: {says}"
    with Client(getattr(guarded, transport), token="s3cret") as client:
        assert client.register(attach=False).epoch == guarded.epoch
        client.deregister()


def test_loadgen_against_a_guarded_service_says_the_token_is_missing(guarded, monkeypatch):
    monkeypatch.delenv("KVALLOC_TOKEN", raising=False)
    r = subprocess.run([*kvalloc_command(), "loadgen", "--no-progress", "--steps", "3",
                        "--address", guarded.ipc], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "none was sent: set KVALLOC_TOKEN" in r.stderr and "Traceback" not in r.stderr
