"""Stands in for ``ssh`` in the launcher tests (``HORA_SSH_COMMAND``).

It runs the remote command on this machine the way sshd would on another:
through ``/bin/sh -c`` in a session of its own (so signals horarun sends to
the ssh process's group never reach it), with a fresh minimal environment
(so everything the worker needs must travel on the command line), and with
a stdin that closes when this "ssh" process ends or its own stdin closes,
which is what a dropped connection looks like to the remote side.

Hosts whose name starts with ``unreachable`` fail as ssh does when a name
does not resolve (exit 255). Each call appends a JSON line
``[HOST, OPTIONS, COMMAND]`` to the file named by ``FAKE_SSH_LOG``, if set.
"""

from __future__ import annotations

import json
import os
import sys
import threading

_WITH_VALUE = {"-o", "-p", "-i", "-F", "-l"}


def main(argv: list[str]) -> int:
    args = list(argv)
    options = []
    while args and args[0].startswith("-"):
        option = args.pop(0)
        options.append(option)
        if option in _WITH_VALUE:
            options.append(args.pop(0))
    host, command = args[0], " ".join(args[1:])
    log = os.environ.get("FAKE_SSH_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps([host, " ".join(options), command]) + "\n")
    if host.startswith("unreachable"):
        print(f"ssh: Could not resolve hostname {host}: Name or service not known",
              file=sys.stderr)
        return 255
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        os.setsid()
        os.dup2(read_end, 0)
        os.close(read_end)
        os.close(write_end)
        env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent-fake-home", "FAKE_SSH_HOST": host}
        os.execve("/bin/sh", ["/bin/sh", "-c", command], env)
    os.close(read_end)

    def relay_stdin() -> None:
        # The remote side reads what we are sent, and sees EOF when our stdin
        # does (or when we die).
        while data := os.read(0, 4096):
            os.write(write_end, data)
        os.close(write_end)

    threading.Thread(target=relay_stdin, daemon=True).start()
    _, status = os.waitpid(child, 0)
    return os.waitstatus_to_exitcode(status) & 0xFF


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
