"""Starting workers on other machines over ssh, as horovodrun does.

A remote worker is a local ``ssh`` process whose remote command changes to
the launcher's working directory and runs a small POSIX ``sh`` guard:

- **Environment over stdin.** The guard's first input line is the worker's
  environment, as base64 of ``export NAME='value'`` lines, which ``horarun``
  writes to the ssh process's stdin. The job token never appears on a command
  line on either machine, and no size limit on one argument applies.
- **One session per worker.** The worker runs in a session of its own
  (``setsid``, where the machine has it), so that stopping it reaches
  whatever it started too.
- **Tied to the connection.** ``horarun`` holds the rest of stdin open and
  never writes to it again. When it closes (horarun stopped the ssh
  process, exited or was killed, or the connection dropped), the guard sends
  the worker's session SIGTERM, then SIGKILL after a grace period.
- **A dead link ends the connection.** ssh sends a keep-alive every
  ``alive_interval`` seconds (``ServerAliveInterval``) and gives up after
  ``alive_count`` unanswered ones, so a host whose network is cut (no
  socket is closed, nothing else would ever tell) counts as gone for
  ``horarun`` within about 15 s instead of never. The remote sshd lets the
  connection go by its own ``ClientAliveInterval``, if configured, or when
  TCP gives up; then the guard stops the worker.
- **Exit code.** The worker's exit code comes back as ssh's (a death by
  signal N as 128+N). What the worker leaves running when it exits gets
  SIGTERM, so that nothing holds the connection open.

What every machine needs, as with horovodrun: the same working directory
and command paths (a shared file system or identical installs), ``sh`` and
``base64``, and password-less ssh from the launching machine.
``HORA_SSH_COMMAND`` replaces ``ssh`` (for example
``"ssh -F ~/.ssh/cluster_config"``); options given there come before
hora's, and ssh keeps the first value it is given for an option, so
``"ssh -o ServerAliveInterval=1"`` overrides the keep-alive default.
"""

from __future__ import annotations

import base64
import concurrent.futures
import os
import re
import shlex
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from hora_proto.options import BY_FIELD, env_value

__all__ = ["SSH_COMMAND_VAR", "RemoteShell", "UnreachableHostError"]

_SSH_COMMAND = BY_FIELD["ssh_command"]
SSH_COMMAND_VAR = _SSH_COMMAND.names[0]

# Variables that describe the launching machine or shell, not the job: the
# remote machine keeps its own.
_LOCAL_ONLY = re.compile(
    r"(HOSTNAME|HOST|PWD|OLDPWD|SHLVL|_|SHELL|HOME|USER|LOGNAME|MAIL|TMPDIR|TMP|TEMP"
    r"|TERM|TERMCAP|COLUMNS|LINES|DISPLAY|XAUTHORITY|LS_COLORS|SSH_.*|BASH_FUNC_.*"
    r"|XDG_RUNTIME_DIR|XDG_SESSION_.*|DBUS_.*|KRB5CCNAME)")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# Reads the environment line, runs "$@" as the worker in a session of its own,
# and ends that session when stdin (the ssh channel) closes. fd 3 keeps the
# channel's stdin: an asynchronous command's stdin is /dev/null in a shell
# without job control, unless redirected explicitly. One line, for login
# shells that refuse newlines inside quotes.
_GUARD = (
    'IFS= read -r hora_env || exit 1; '
    'eval "$(printf %s "$hora_env" | base64 -d)" || exit 1; unset hora_env; '
    'exec 3<&0; '
    'if command -v setsid >/dev/null 2>&1; '
    'then setsid "$@" 3<&- </dev/null & else "$@" 3<&- </dev/null & fi; '
    'worker=$!; '
    '( read -r _ <&3; '
    'kill -s TERM -- -"$worker" 2>/dev/null || kill -s TERM "$worker"; sleep {grace}; '
    'kill -s KILL -- -"$worker" 2>/dev/null || kill -s KILL "$worker" ) >/dev/null 2>&1 & '
    'watcher=$!; exec 3<&-; '
    'wait "$worker"; code=$?; '
    'kill "$watcher" 2>/dev/null; kill -s TERM -- -"$worker" 2>/dev/null; '
    'exit "$code"'
)


class UnreachableHostError(RuntimeError):
    """ssh could not run a command on one or more hosts; the message names them."""


@dataclass(frozen=True)
class RemoteShell:
    """How to reach other machines: the ssh command and its options.

    Attributes:
        port: ssh port (``-p``), or None for ssh's default.
        identity_file: private key (``-i``), or None.
        connect_timeout: seconds ssh may take to connect.
        alive_interval: seconds between ssh's keep-alives (``ServerAliveInterval``).
        alive_count: unanswered keep-alives after which ssh gives up
            (``ServerAliveCountMax``).
        grace_period: seconds between SIGTERM and SIGKILL for a remote worker
            whose connection closed.
        command: the ssh program and fixed arguments (``HORA_SSH_COMMAND``).
    """

    port: int | None = None
    identity_file: str | None = None
    connect_timeout: float = 10.0
    alive_interval: float = 5.0
    alive_count: int = 3
    grace_period: float = 5.0
    command: tuple[str, ...] = ("ssh",)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **options: object
                 ) -> RemoteShell:
        """Options as given, the ssh program from ``HORA_SSH_COMMAND`` if set."""
        env = os.environ if environ is None else environ
        command = tuple(shlex.split(env_value(env, _SSH_COMMAND) or "")) or ("ssh",)
        return cls(command=command, **options)  # type: ignore[arg-type]

    def ssh_argv(self, host: str, remote_command: str) -> list[str]:
        """The local command that runs ``remote_command`` on ``host``."""
        argv = [*self.command,
                "-o", "BatchMode=yes",
                "-o", "StrictHostKeyChecking=no",
                "-o", f"ConnectTimeout={max(1, round(self.connect_timeout))}",
                "-o", f"ServerAliveInterval={max(1, round(self.alive_interval))}",
                "-o", f"ServerAliveCountMax={max(1, self.alive_count)}"]
        if self.port is not None:
            argv += ["-p", str(self.port)]
        if self.identity_file is not None:
            argv += ["-i", self.identity_file]
        return [*argv, "--", host, remote_command]

    def worker_argv(self, host: str, argv: Sequence[str], cwd: str) -> list[str]:
        """The local command that runs worker ``argv`` on ``host`` in ``cwd``.

        Its stdin must first receive :meth:`environment_line`, then stay open
        for as long as the worker may run.
        """
        guard = _GUARD.format(grace=max(1, round(self.grace_period)))
        remote = (f"cd {shlex.quote(cwd)} || exit 1; exec /bin/sh -c {shlex.quote(guard)} "
                  f"hora-worker {' '.join(shlex.quote(arg) for arg in argv)}")
        return self.ssh_argv(host, remote)

    @staticmethod
    def environment_line(env: Mapping[str, str]) -> bytes:
        """The worker's environment as the guard reads it: one base64 line.

        The variables that describe the launching machine (``HOME``,
        ``SSH_*``, ``PWD``, ...) are left out; the remote machine keeps its own.
        """
        script = "".join(f"export {name}={shlex.quote(value)}\n"
                         for name, value in sorted(env.items()) if _exportable(name))
        return base64.b64encode(script.encode()) + b"\n"

    def check(self, hosts: Iterable[str], env: Mapping[str, str] | None = None) -> None:
        """Runs ``true`` on every host at once; fails naming each host that did not.

        Raises:
            UnreachableHostError: some host refused, timed out or failed;
                with ssh's own message for each.
        """
        hosts = sorted(set(hosts))
        if not hosts:
            return
        deadline = self.connect_timeout + 5.0
        with concurrent.futures.ThreadPoolExecutor(min(16, len(hosts))) as pool:
            answers = list(pool.map(lambda h: self._try(h, deadline, env), hosts))
        failed = [f"{host}: {problem}" for host, problem in zip(hosts, answers, strict=True)
                  if problem is not None]
        if failed:
            raise UnreachableHostError(
                "cannot run commands over ssh on " + "; ".join(failed) +
                ". Workers on other machines start over password-less ssh "
                f"(set {SSH_COMMAND_VAR}, -p/--ssh-port or -i/--ssh-identity-file)")

    def _try(self, host: str, deadline: float, env: Mapping[str, str] | None) -> str | None:
        try:
            done = subprocess.run(self.ssh_argv(host, "true"), stdin=subprocess.DEVNULL,
                                  capture_output=True, timeout=deadline, check=False,
                                  env=None if env is None else dict(env))
        except subprocess.TimeoutExpired:
            return f"no answer within {deadline:g} s"
        except OSError as exc:
            return f"cannot run {self.command[0]!r}: {exc.strerror or exc}"
        if done.returncode == 0:
            return None
        message = done.stderr.decode(errors="replace").strip().splitlines()
        return f"exit code {done.returncode}" + (f" ({message[-1]})" if message else "")


def _exportable(name: str) -> bool:
    return _NAME.fullmatch(name) is not None and _LOCAL_ONLY.fullmatch(name) is None
