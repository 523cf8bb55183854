"""``kvalloc serve``'s command line: with no arguments it runs the embedded default, loopback only,
on the documented addresses; pool and service flags map onto the configuration."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from command_help import help_and_imports
from kvalloc.allocator import PoolConfig
from kvalloc.server import serve
from kvalloc.server.contract.addresses import (
    DEFAULT_PORT,
    default_client_address,
    default_ipc_endpoints,
)
from kvalloc.server.devtools.launch import ServiceProcess, free_port, kvalloc_command


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(argv)


def test_no_arguments_mean_the_embedded_default_on_loopback(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("KVALLOC_TOKEN", raising=False)
    args = parse()
    assert (args.host, args.port, args.no_tcp, args.uds, args.ipc) == (
        "127.0.0.1", DEFAULT_PORT, False, None, None)
    assert default_ipc_endpoints() == [f"stream://{tmp_path}/kvalloc/kvalloc.stream"]
    monkeypatch.delenv("KVALLOC_ADDRESS", raising=False)
    assert default_client_address() == f"stream://{tmp_path}/kvalloc/kvalloc.stream"
    config = serve._config(args)
    defaults = PoolConfig(num_blocks=4096)
    assert config.pool == defaults and config.token is None
    assert config.lease_ttl_s == 30.0


def test_flags_and_the_token_environment_variable_configure_the_service(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVALLOC_TOKEN", "t0ken")
    config = serve._config(parse("--device", "cpu", "--num-blocks", "300", "--head-dim", "32",
                                 "--lease-ttl-s", "2.5", "--max-workers", "3",
                                 "--ipc-spin-s", "0.02"))
    assert (config.pool.num_blocks, config.pool.head_dim, config.pool.device) == (300, 32, "cpu")
    assert (config.lease_ttl_s, config.max_workers, config.ipc_spin_s) == (2.5, 3, 0.02)
    assert config.pool.kv_layout == "kv"
    latent = serve._config(parse("--device", "cpu", "--kv-layout", "latent", "--num-kv-heads",
                                 "1", "--head-dim", "576"))
    assert (latent.pool.kv_layout, latent.pool.kv_planes) == ("latent", 1)
    assert config.token is not None and config.token.get_secret_value() == "t0ken"


def test_a_reproduction_slack_policy_is_a_flag_and_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    assert serve._config(parse("--device", "cpu")).pool.slack_policy == "reclaim"
    with caplog.at_level("WARNING", logger="kvalloc.serve"):
        config = serve._config(parse("--device", "cpu", "--slack-policy", "none"))
    assert config.pool.slack_policy == "none"
    assert "--slack-policy none" in caplog.text and "on purpose" in caplog.text


def test_help_builds_the_flags_without_torch_numba_or_fastapi() -> None:
    """``kvalloc serve --help`` answers from `server.serve_arguments` alone: the defaults it shows
    come from the configuration models, and none of the service's heavy imports are loaded."""
    text, imported = help_and_imports(["serve", "--help"],
                                      ("torch", "numba", "numpy", "triton", "fastapi"))
    assert imported == []
    words = " ".join(text.split())  # as argparse wrapped it for whatever width
    assert "--kv-events-shape" in words and "--max-step-tokens" in words
    assert "--kv-layout {kv,latent}" in words and "latent: one MLA latent" in words
    assert f"output tokens (default {PoolConfig.model_fields['max_seq_len'].default})" in words


def test_version_prints_the_installed_release() -> None:
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    release = re.search(r'^version = "(.+)"$', pyproject, re.M).group(1)
    proc = subprocess.run([*kvalloc_command(), "--version"], capture_output=True, text=True,
                          timeout=60)
    assert (proc.returncode, proc.stdout.strip()) == (0, f"kvalloc {release}")


def test_a_bad_configuration_exits_2_naming_the_field(tmp_path: Path) -> None:
    svc = ServiceProcess(tmp_path, "--device", "cpu", "--max-step-tokens", "8",
                         ready_timeout_s=30)
    with pytest.raises(RuntimeError, match="exited with 2"):
        svc.start()
    assert "max_step_tokens" in svc.log()


def test_the_default_pool_serves_and_logs_where_it_listens(tmp_path: Path) -> None:
    with ServiceProcess(tmp_path, "--device", "cpu") as svc:
        log = svc.log()
    assert f"serving REST on {svc.rest_tcp}, {svc.rest_unix}, IPC on {svc.ipc}" in log
    assert ("cpu pool: 4096 blocks x 16 tokens, bfloat16, 2 layers x 2 KV heads x 64 (kv layout)"
            in log)


def test_a_second_service_on_the_same_sockets_refuses_to_start(tmp_path: Path) -> None:
    with ServiceProcess(tmp_path, "--device", "cpu", "--num-blocks", "300") as first:
        for taken in (["--uds", str(first.uds)], ["--ipc", first.ipc]):
            second = subprocess.run(
                [*kvalloc_command(), "serve", "--device", "cpu", "--num-blocks", "300",
                 "--port", str(free_port()), "--ipc", f"ipc://{tmp_path / 'other.ipc'}", *taken],
                capture_output=True, text=True, timeout=60)
            assert second.returncode == 1
            assert "is in use by a running server" in second.stderr
        assert first.ready()


def test_a_killed_owner_leaves_no_service_behind(tmp_path: Path) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER.format(tmp=str(tmp_path))], stdout=subprocess.PIPE,
        text=True)
    try:
        service_pid = int(owner.stdout.readline())  # type: ignore[union-attr]
    finally:
        owner.kill()  # SIGKILL: no cleanup code of the owner runs
        owner.wait()
    deadline = time.monotonic() + 15
    while Path(f"/proc/{service_pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{service_pid}").exists()
    assert "stopping on SIGTERM" in (tmp_path / "serve.log").read_text()


OWNER = """
import time
from pathlib import Path
from server.devtools.launch import ServiceProcess
svc = ServiceProcess(Path({tmp!r}), "--device", "cpu", "--num-blocks", "300").start()
print(svc.proc.pid, flush=True)
time.sleep(600)
"""


def test_layer_groups_are_a_repeatable_flag() -> None:
    config = serve._config(parse("--device", "cpu", "--num-layers", "12",
                                 "--layer-group", "full:0-3,8,10-11:300",
                                 "--layer-group", "sliding:4-7,9:80:1024"))
    assert [(g.name, g.layers, g.num_blocks, g.window) for g in config.groups] == [
        ("full", (0, 1, 2, 3, 8, 10, 11), 300, None), ("sliding", (4, 5, 6, 7, 9), 80, 1024)]
    assert serve._config(parse("--device", "cpu")).groups == []


@pytest.mark.parametrize(("value", "says"), [
    ("full:0-3", "is not NAME:LAYERS:BLOCKS[:WINDOW]"),
    ("full:0-3:64:8:9", "is not NAME:LAYERS:BLOCKS[:WINDOW]"),
    ("full:3-0:64", "layers: '3-0' runs backwards"),
    ("full:0,x:64", "'x' is not a whole number"),
    ("full:0-3:-5", "'-5' is not a whole number"),
    ("full:0-3:0", "num_blocks: Input should be greater than 0"),
    ("full:0-3:64:0", "window: Input should be greater than 0"),
    ("bad-name:0-3:64", "name: String should match pattern"),
])
def test_a_bad_layer_group_is_an_error_naming_the_flag(value: str, says: str,
                                                       capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse("--layer-group", value)
    err = capsys.readouterr().err
    assert f"argument --layer-group: '{value}'" in err and says in err


def test_groups_that_do_not_partition_the_layers_exit_2_naming_the_flag(
        capsys: pytest.CaptureFixture) -> None:
    args = parse("--device", "cpu", "--num-layers", "4", "--layer-group", "full:0-2:64",
                 "--log-level", "error")
    assert serve.run(args) == 2
    assert ("--layer-group: groups: the groups' layers [0, 1, 2] do not partition the pool's 4 "
            "layers") in capsys.readouterr().err
