"""The tensorshare command line, run as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tensorshare import Client, EmbeddedServer, MemoryLimitExceeded
from tests.conftest import interrupt, interruptible


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tensorshare", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_ls_lists_bins_and_item_counts(server: EmbeddedServer) -> None:
    with Client("127.0.0.1", server.port) as c:
        c.put("weights", torch.zeros(3))
        c.append("queue", 1)
        c.append("queue", 2)
    out = _cli("ls", "--port", str(server.port))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:3] == ["bin", "kind", "items"]
    rows = [ln.split()[:3] for ln in lines[2:4]]
    assert rows == [["queue", "list", "2"], ["weights", "value", "1"]]
    assert lines[-1].split()[:4] == ["total", "2", "bins", "3"]


@pytest.mark.parametrize("command", [["ls"], ["peek", "w"], ["stats"], ["watch", "w"],
                                     ["monitor"]])
def test_client_commands_with_no_server_fail_with_one_line(free_port: int,
                                                           command: list[str]) -> None:
    out = _cli(*command, "--port", str(free_port), "--timeout", "1")
    assert out.returncode == 1
    assert out.stdout == ""
    assert out.stderr.count("\n") == 1, out.stderr  # one line, no traceback
    assert out.stderr.startswith(f"tensorshare {command[0]}: cannot connect to tensorshare "
                                 f"server at 127.0.0.1:{free_port}: ")


def test_client_commands_take_the_connection_options() -> None:
    from tensorshare.cli.main import _parser

    for command in (["ls"], ["peek", "b"], ["watch", "b"], ["monitor"], ["stats"]):
        args = _parser().parse_args([*command, "--host", "10.1.2.3", "--port", "9",
                                     "--timeout", "2.5"])
        assert (args.host, args.port, args.timeout) == ("10.1.2.3", 9, 2.5)
    out = _cli("ls", "--timeout", "0")
    assert out.returncode == 2 and "seconds must be positive" in out.stderr


def test_the_no_token_refusal_names_the_command_lines_options() -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TENSORSHARE_TOKEN", "TENSORSHARE_TOKEN_FILE")}
    out = subprocess.run([sys.executable, "-m", "tensorshare", "serve", "--host", "0.0.0.0",
                          "--port", "0"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2 and out.stdout == ""
    err = out.stderr
    assert err.startswith("tensorshare serve: refusing to listen on 0.0.0.0 without a token")
    assert "--token-file PATH" in err and "--insecure" in err and err.count("\n") == 1
    assert "token=" not in err and "insecure=True" not in err  # (Python's spelling)


def test_a_relay_offers_no_disk_options_and_serve_does() -> None:
    from tensorshare.cli.main import _parser

    disk = ("--data-dir", "--fsync", "--snapshot-every", "--snapshot-log-bytes",
            "--truncate-corrupt-log")
    relay, serve = _cli("relay", "--help").stdout, _cli("serve", "--help").stdout
    assert all(o not in relay for o in disk) and all(o in serve for o in disk)
    with pytest.raises(SystemExit):
        _parser().parse_args(["relay", "--upstream", "h:1", "--data-dir", "/tmp/x"])
    args = _parser().parse_args(["relay", "--upstream", "h:1"])
    assert args.data_dir is None  # (what serve's code reads: nothing kept)


def test_the_demos_duration_is_told_alike_in_help_and_readme() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    intro = readme.split("**tensorshare shares", 1)[0]
    helptext = " ".join(_cli("--help").stdout.split())
    assert "under a minute" in intro and "under a minute" in helptext
    assert "about a minute" not in helptext and "ten seconds" not in intro


def test_serve_with_max_memory_refuses_what_does_not_fit() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "tensorshare", "serve", "--port", "0",
                             "--max-memory", "64K", "-q"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on 127.0.0.1:" in line
        port = int(line.rsplit(":", 1)[1])
        with Client("127.0.0.1", port) as c:
            c.put("small", torch.zeros(1000))  # 4 KB
            with pytest.raises(MemoryLimitExceeded, match="max_memory=65536"):
                c.put("big", torch.zeros(100_000))  # 400 KB
            assert c.list() == {"small": 1}
    finally:
        proc.kill()
        proc.wait(10)


def test_bad_size_argument_is_a_usage_error() -> None:
    out = _cli("serve", "--max-memory", "lots")
    assert out.returncode == 2 and "not a size" in out.stderr


def test_an_infinite_size_is_a_usage_error() -> None:
    out = _cli("serve", "--max-memory", "inf")
    assert out.returncode == 2 and "not a size" in out.stderr


def test_serve_stops_cleanly_on_ctrl_c() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "tensorshare", "serve", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **interruptible())
    try:
        assert proc.stdout is not None
        assert "listening on 127.0.0.1:" in proc.stdout.readline()
        assert interrupt(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_serve_on_a_unix_socket_and_ls_through_it(tmp_path: Path) -> None:
    path = tmp_path / "ts.sock"
    proc = subprocess.Popen([sys.executable, "-m", "tensorshare", "serve", "--port", "0",
                             "--unix", str(path), "-q"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **interruptible())
    try:
        assert proc.stdout is not None
        assert "listening on 127.0.0.1:" in proc.stdout.readline()
        assert proc.stdout.readline() == f"listening on unix://{path}\n"
        with Client(f"unix://{path}") as c:
            c.put("w", torch.zeros(3))
        out = _cli("ls", "--host", f"unix://{path}")
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines()[2].split()[:3] == ["w", "value", "1"]
        assert interrupt(proc) == 0
        assert not path.exists()  # the server removes its socket
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_bad_address_is_one_line() -> None:
    out = _cli("stats", "--host", "bogus://x")
    assert out.returncode == 1
    # One line saying what is wrong with it (the wording is the client's).
    assert out.stderr.startswith("tensorshare stats: ") and "'bogus://x'" in out.stderr
    assert out.stderr.count("\n") == 1


def test_the_readme_command_line_tour_uses_real_options() -> None:
    """Every command the README's command-line section shows parses as written."""
    import re
    import shlex

    from tensorshare.cli.main import _parser

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme.split("## The command line", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"^(?:\$ )?tensorshare (.+?)(?:\s+#.*)?$", section, flags=re.M)
    assert len(commands) >= 10
    for command in commands:
        _parser().parse_args(shlex.split(command))


def test_demo_has_an_option_for_each_run_demo_argument_with_its_default() -> None:
    import inspect

    from tensorshare.cli.main import _parser
    from tensorshare.rl.demo import run_demo

    args = vars(_parser().parse_args(["demo"]))
    for name, param in inspect.signature(run_demo).parameters.items():
        assert name in args, f"`tensorshare demo` has no option for run_demo's {name!r}"
        assert args[name] == param.default, name
    out = _cli("demo", "--server", "nowhere")  # passed through: the demo itself refuses it
    assert out.returncode == 2 and out.stderr.startswith("tensorshare demo: ")


# --------------------------------------------------------------------------- health


def test_health_of_a_running_server_is_one_line_and_exit_0(server: EmbeddedServer) -> None:
    out = _cli("health", "--port", str(server.port), "--timeout", "5")
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert out.stdout.startswith(f"ok: 127.0.0.1:{server.port} answered in ")
    assert out.stdout.count("\n") == 1


def test_health_with_nothing_listening_is_exit_1_at_once(free_port: int) -> None:
    import time

    start = time.monotonic()
    out = _cli("health", "--port", str(free_port), "--timeout", "2")
    assert time.monotonic() - start < 10  # refused: no waiting for the timeout
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"tensorshare health: cannot connect to tensorshare server "
                                 f"at 127.0.0.1:{free_port}: ")


def test_health_of_a_server_that_never_answers_fails_within_the_timeout() -> None:
    import socket
    import time

    with socket.socket() as silent:  # accepts connections (the backlog) and says nothing
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        start = time.monotonic()
        out = _cli("health", "--port", str(port), "--timeout", "1")
        took = time.monotonic() - start
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith("tensorshare health: ") and out.stderr.count("\n") == 1
    assert took < 10, took  # the interpreter's start, and 1 s, and a margin


def test_health_checks_the_token_and_takes_unix(tmp_path: Path) -> None:
    from tensorshare.server import ServerConfig

    token, wrong = tmp_path / "token", tmp_path / "wrong"
    token.write_text("health-test-token\n")
    wrong.write_text("not-the-token\n")
    sock = tmp_path / "ts.sock"
    with EmbeddedServer(port=0, unix=str(sock), config=ServerConfig(token="health-test-token")
                        ) as srv:
        ok = _cli("health", "--port", str(srv.port), "--token-file", str(token))
        assert ok.returncode == 0, ok.stderr
        ok = _cli("health", "--unix", str(sock), "--token-file", str(token))
        assert ok.returncode == 0 and ok.stdout.startswith(f"ok: unix://{sock} "), ok.stderr
        for bad in ([], ["--token-file", str(wrong)]):
            out = _cli("health", "--port", str(srv.port), *bad)
            assert out.returncode == 1 and out.stdout == ""
            assert out.stderr.startswith("tensorshare health: ") and "token" in out.stderr
            assert out.stderr.count("\n") == 1
            # In the command line's terms, never the Python API's keywords.
            assert "--token-file PATH" in out.stderr and "token=" not in out.stderr
    both = _cli("health", "--host", "127.0.0.1", "--unix", str(sock))
    assert both.returncode == 2 and "not both" in both.stderr


def test_health_in_process_returns_the_exit_status(server: EmbeddedServer, free_port: int,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from tensorshare.cli.main import main

    assert main(["health", "--port", str(server.port)]) == 0
    assert capsys.readouterr().out.startswith("ok: ")
    assert main(["health", "--port", str(free_port), "--timeout", "1"]) == 1
    assert capsys.readouterr().err.startswith("tensorshare health: cannot connect")
