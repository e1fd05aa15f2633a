"""One command-line language: the same flag for the same thing in every command, a version,
bad options refused in one line, amounts in the game's currency."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest

from capsvc import __version__
from tests.support.servers import RedisServer, free_port
from tests.support.service import ServiceProcess

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "capsvc.toml"
TEST_CONFIG = Path(__file__).resolve().parents[1] / "capsvc-test.toml"


def capsvc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "capsvc", *args], capture_output=True,
                          text=True, timeout=60, check=False)


def test_version() -> None:
    out = capsvc("--version")
    assert (out.returncode, out.stdout.strip()) == (0, f"capsvc {__version__}")


def test_a_bad_log_level_is_one_line_naming_the_choices() -> None:
    out = capsvc("serve", "--log-level", "verbose")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert "invalid choice: 'VERBOSE'" in out.stderr
    assert "DEBUG" in out.stderr


@pytest.mark.parametrize("command", [
    ("serve",), ("check-config",), ("journal", "restore"), ("journal", "verify"),
    ("report", "--game", "g", "--draw", "1"),
    ("reconcile", "--game", "g", "--draw", "1", "--sold", "x")])
def test_every_command_names_its_configuration_and_redis_alike(command: tuple[str, ...]
                                                               ) -> None:
    out = capsvc(*command, "--help")
    assert out.returncode == 0
    assert "--config" in out.stdout
    assert "--redis-url" in out.stdout
    if command not in (("serve",), ("journal", "restore")):
        assert "--format" in out.stdout
    assert "--json" not in out.stdout
    assert "--redis " not in out.stdout


def test_check_config_writes_amounts_in_the_game_s_currency() -> None:
    out = capsvc("check-config", "--config", str(CONFIG))
    assert out.returncode == 0, out.stderr
    assert "stakes 1.00 EUR, 2.00 EUR" in out.stdout
    assert "cap 50.00 EUR" in out.stdout
    assert "daily limit 40000.00 MAD" in out.stdout
    as_json = capsvc("check-config", "--config", str(CONFIG), "--format", "json")
    assert '"currency": "EUR"' in as_json.stdout


def test_health_answers_for_the_configured_port(redis_server: RedisServer,
                                                tmp_path: Path) -> None:
    """`capsvc health` (the image's HEALTHCHECK): 0 while the service on the configuration's
    port answers /healthz; one line naming the URL and 1 when nothing answers there."""
    service = ServiceProcess(str(TEST_CONFIG), redis_server.url).start()
    try:
        ok = capsvc("health", "--config", str(TEST_CONFIG), "--port", str(service.port))
        assert ok.returncode == 0, ok.stderr
    finally:
        service.stop()
    closed = free_port()
    config = tmp_path / "capsvc.toml"
    config.write_text(TEST_CONFIG.read_text().replace("[server]", f"[server]\nport = {closed}", 1))
    down = capsvc("health", "--config", str(config))
    assert down.returncode == 1
    assert f"http://127.0.0.1:{closed}/healthz" in down.stderr
    assert len(down.stderr.strip().splitlines()) == 1


def test_every_command_takes_several_configuration_files(tmp_path: Path) -> None:
    """`--config` repeated merges the files in order, in every command that reads one;
    a problem names the file it is in."""
    redis = tmp_path / "redis.toml"
    redis.write_text('[redis]\nurl = "redis://:secret@redis.example:6380/2"\n')
    out = capsvc("check-config", "--config", str(redis), "--config", str(CONFIG))
    assert out.returncode == 0, out.stderr
    assert f"{redis}, {CONFIG}: OK" in out.stdout
    assert "redis: redis://redis.example:6380/2" in out.stdout
    assert "secret" not in out.stdout
    broken = tmp_path / "broken.toml"
    broken.write_text("[server]\nportt = 1\n")
    out = capsvc("check-config", "--config", str(CONFIG), "--config", str(broken))
    assert out.returncode == 2
    assert f"{broken}: server.portt: unknown field (did you mean 'port'?)" in out.stderr
    assert "Traceback" not in out.stderr
    for command in (("report", "--game", "fdj-keno", "--draw", "1", "--dir", str(tmp_path)),
                    ("journal", "verify"), ("health",)):
        out = capsvc(*command, "--config", str(CONFIG), "--config", str(broken))
        assert out.returncode == 2, (command, out.stderr)
        assert "server.portt" in out.stderr, command
        assert "Traceback" not in out.stderr, command


def test_serve_with_several_workers_reads_every_file(redis_server: RedisServer,
                                                     tmp_path: Path) -> None:
    """The workers read the same files, in the same order, as the command given them: a
    game of the second file is in every worker's list of games."""
    extra = tmp_path / "extra.toml"
    extra.write_text('[[games]]\nid = "second-keno"\npreset = "lnm-keno"\n'
                     '[[channels]]\nid = "second"\ngames = ["second-keno"]\nscopes = ["read"]\n'
                     f'token_sha256 = "{hashlib.sha256(b"t-second").hexdigest()}"\n')
    service = ServiceProcess(str(TEST_CONFIG), redis_server.url,
                             args=("--config", str(extra), "--workers", "2")).start()
    try:
        for _ in range(8):  # new connections: either worker
            request = urllib.request.Request(f"{service.base_url}/v1/games",
                                             headers={"Authorization": "Bearer t-second"})
            with urllib.request.urlopen(request, timeout=10) as r:
                assert "second-keno" in r.read().decode()
    finally:
        service.stop()


def test_check_config_takes_its_files_as_arguments_too() -> None:
    """`capsvc check-config PATH` (the contract's form) is `--config PATH`."""
    positional = capsvc("check-config", str(TEST_CONFIG))
    flagged = capsvc("check-config", "--config", str(TEST_CONFIG))
    assert positional.returncode == flagged.returncode == 0, positional.stderr
    assert positional.stdout == flagged.stdout


def test_output_piped_into_a_command_that_stops_reading_ends_quietly() -> None:
    """`capsvc check-config … | head -1`: no BrokenPipeError traceback."""
    shell = subprocess.run(
        f"{sys.executable} -m capsvc check-config {TEST_CONFIG} | head -1",
        shell=True, capture_output=True, text=True, timeout=60)
    assert shell.stdout.endswith(": OK\n")
    assert "Traceback" not in shell.stderr


@pytest.mark.parametrize(("command", "name"), [
    (("serve",), "serve"), (("check-config",), "check-config"), (("health",), "health"),
    (("watch", "fdj-keno"), "watch"), (("journal", "restore"), "journal restore"),
    (("journal", "ship", "--to", "x"), "journal ship"), (("journal", "verify"), "journal verify"),
    (("report",), "report"),
    (("reconcile", "--game", "g", "--draw", "1", "--sold", "x"), "reconcile")])
def test_an_unknown_option_is_refused_with_its_command_s_usage(command: tuple[str, ...],
                                                               name: str) -> None:
    """`capsvc serve --bogus` prints `serve`'s usage (its options), not the top level's
    list of commands."""
    out = capsvc(*command, "--bogus")
    assert out.returncode == 2
    assert out.stderr.startswith(f"usage: capsvc {name} "), out.stderr
    assert out.stderr.splitlines()[-1] == (
        f"capsvc {name}: error: unrecognized arguments: --bogus")


def test_health_says_which_port_it_asks() -> None:
    """`capsvc health` asks the configuration's port (it cannot know a `serve --port`):
    its help says so and says to give `--port`, and so does its line when nothing
    answers there."""
    help_text = " ".join(capsvc("health", "--help").stdout.split())
    assert "[server] port, or on --port" in help_text
    assert "`serve --port` is not known here" in help_text
    closed = free_port()
    config = TEST_CONFIG.read_text().replace("[server]", f"[server]\nport = {closed}", 1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "capsvc.toml"
        path.write_text(config)
        down = capsvc("health", "--config", str(path))
    assert down.returncode == 1
    assert down.stderr.strip().endswith(
        f"(port {closed}: the configuration's [server] port; for a service started with "
        "`serve --port N`, give `health --port N`)"), down.stderr


def test_an_invalid_configuration_names_the_files_read_and_why(tmp_path: Path) -> None:
    """An override file with one typo given alone: the error says that file is the whole
    configuration (the built-in one is not read), which is why it also has no games."""
    override = tmp_path / "override.toml"
    override.write_text("[server]\nprot = 9000\n")
    read = (f"read: {override} (the built-in configuration is not read when --config is "
            "given: the files given are the whole configuration)")
    for command in (("serve", "--port", "0"), ("check-config",), ("health",),
                    ("journal", "verify")):
        out = capsvc(*command, "--config", str(override))
        assert out.returncode == 2, (command, out.stderr)
        assert out.stderr.splitlines() == [
            "invalid configuration (2 problem(s)):",
            "  - server.prot: unknown field (did you mean 'port'?)",
            "  - games: at least one [[games]] entry is needed", read], command
    out = capsvc("report", "--game", "g", "--draw", "1", "--config", str(override))
    assert out.returncode == 2
    assert out.stderr.strip().endswith(f"; {read}"), out.stderr
    env = {**os.environ, "CAPSVC_CONFIG": str(override)}
    listed = subprocess.run([sys.executable, "-m", "capsvc", "check-config"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert listed.returncode == 2
    assert listed.stderr.splitlines()[-1] == (
        f"read: {override} (from $CAPSVC_CONFIG; the built-in configuration is not read "
        "when it is set: the files it lists are the whole configuration)")
