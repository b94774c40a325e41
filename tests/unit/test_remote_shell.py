"""The ssh command lines horarun builds for workers on other machines."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hora.runner.remote import RemoteShell

pytestmark = pytest.mark.unit


def start_remote(argv: list[str], cwd: str, worker_env: dict[str, str] | None = None,
                 env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Runs a worker's remote command as sshd would (``sh -c``), and sends the
    environment line first, as horarun does."""
    remote = RemoteShell().worker_argv("h1", argv, cwd)[-1]
    proc = subprocess.Popen(["/bin/sh", "-c", remote], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError):  # it may have failed already
        proc.stdin.write(RemoteShell.environment_line(worker_env or {}).decode())
        proc.stdin.flush()
    return proc


def run_remote(argv: list[str], cwd: str, worker_env: dict[str, str] | None = None,
               env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """:func:`start_remote`, with stdin open, as a live connection's is, until it exits."""
    proc = start_remote(argv, cwd, worker_env, env)
    try:
        proc.wait(timeout=30)
        assert proc.stdout is not None and proc.stderr is not None
        return proc.returncode, proc.stdout.read(), proc.stderr.read()
    finally:
        proc.kill()
        proc.communicate()


def test_ssh_options_come_before_the_host_and_the_command():
    shell = RemoteShell(port=2222, identity_file="/keys/id", connect_timeout=7)
    argv = shell.ssh_argv("h1", "true")
    assert argv[0] == "ssh" and argv[-3:] == ["--", "h1", "true"]
    options = argv[1:-3]
    assert options[options.index("-p") + 1] == "2222"
    assert options[options.index("-i") + 1] == "/keys/id"
    assert "BatchMode=yes" in options and "ConnectTimeout=7" in options
    # A cut link (nothing closed) ends ssh within interval x count seconds.
    assert "ServerAliveInterval=5" in options and "ServerAliveCountMax=3" in options


def test_options_in_hora_ssh_command_come_first_so_that_they_win():
    shell = RemoteShell.from_env({"HORA_SSH_COMMAND": "ssh -o ServerAliveInterval=1"})
    argv = shell.ssh_argv("h1", "true")
    assert argv.index("ServerAliveInterval=1") < argv.index("ServerAliveInterval=5")


def test_the_ssh_program_comes_from_hora_ssh_command():
    shell = RemoteShell.from_env({"HORA_SSH_COMMAND": "ssh -F '/my dir/config'"}, port=22)
    assert shell.ssh_argv("h1", "true")[:3] == ["ssh", "-F", "/my dir/config"]
    assert RemoteShell.from_env({}).command == ("ssh",)


def test_the_remote_command_keeps_arguments_and_job_variables_intact(tmp_path):
    env = {
        "HORA_TOKEN": "t0k'en $x",
        "PYTHONPATH": "/shim:/site",
        "HOME": "/home/launcher",
        "SSH_AUTH_SOCK": "/tmp/agent",
        "PWD": "/elsewhere",
        "BASH_FUNC_x%%": "() { :; }",
    }
    script = ("import json, os, sys; print(json.dumps([sys.argv[1:], "
              "{k: os.environ.get(k) for k in ('HORA_TOKEN', 'PYTHONPATH', 'HOME', "
              "'SSH_AUTH_SOCK', 'PWD')}]))")
    argv = [sys.executable, "-c", script, "two words", "it's", "$HOME", "*"]
    remote = RemoteShell().worker_argv("h1", argv, str(tmp_path))[-1]
    assert "t0k" not in remote  # the token never shows on a command line
    code, out, err = run_remote(argv, str(tmp_path), env,
                                env={"PATH": "/usr/bin:/bin", "HOME": "/home/remote"})
    assert code == 0, err
    args, seen = json.loads(out)
    assert args == ["two words", "it's", "$HOME", "*"]
    assert seen["HORA_TOKEN"] == "t0k'en $x"
    assert seen["PYTHONPATH"] == "/shim:/site"
    # What describes the launching machine stays there.
    assert seen["HOME"] == "/home/remote"
    assert seen["SSH_AUTH_SOCK"] is None
    assert seen["PWD"] == str(tmp_path)


def test_the_remote_exit_code_comes_back(tmp_path):
    assert run_remote(["sh", "-c", "exit 7"], str(tmp_path))[0] == 7


def test_closing_the_connection_terminates_the_worker(tmp_path):
    # The worker starts a child of its own: stopping it must reach that too.
    pid_file = tmp_path / "child.pid"
    proc = start_remote(["sh", "-c", f"sleep 30 & echo $! > {pid_file}; wait"], str(tmp_path))
    try:
        deadline = time.monotonic() + 10
        while not pid_file.exists() or not pid_file.read_text().strip():
            assert time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        child = int(pid_file.read_text())
        assert proc.stdin is not None
        proc.stdin.close()  # what the remote side sees when ssh goes away
        assert proc.wait(timeout=10) == 128 + 15  # the worker got SIGTERM
        deadline = time.monotonic() + 5
        while Path(f"/proc/{child}").exists() and \
                Path(f"/proc/{child}/stat").read_text().split(") ")[1][0] != "Z":
            assert time.monotonic() < deadline, "the worker's child outlived it"
            time.sleep(0.02)
    finally:
        proc.kill()
        proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def test_a_missing_working_directory_fails_instead_of_running_elsewhere(tmp_path):
    missing = str(tmp_path / "not-on-this-host")
    code, _out, err = run_remote(["true"], missing)
    assert code == 1
    assert "not-on-this-host" in err
