"""A stranger on the network: floods every listening port it finds on some hosts.

    python stranger.py OUT STOP MAX NS=ADDRESS [NS=ADDRESS ...]

Runs in a network namespace that reaches the hosts. Every millisecond it
lists the listening TCP ports inside each host's namespace (sshd's port left
out) and keeps every port it ever saw; four threads connect to those ports in
turn, half the time closing at once, half the time sending garbage first,
until MAX connections were tried or the file STOP exists. Writes its
counts to OUT as JSON. Never needs a token: it has none.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

SSH_PORT = 2222
TIME_LIMIT = 90.0
# Each attacking thread's pause between connections (s): the flood lasts as
# long as the job rather than spending its bound in the first second.
PACE = 0.004


def main() -> None:
    out, stop, most = sys.argv[1], sys.argv[2], int(sys.argv[3])
    hosts = dict(arg.split("=", 1) for arg in sys.argv[4:])
    seen: dict[tuple[str, int], None] = {}  # insertion-ordered set
    counts = {"tried": 0, "accepted": 0, "refused": 0, "other": 0, "discoveries": 0}
    lock = threading.Lock()
    end = time.monotonic() + TIME_LIMIT

    def done() -> bool:
        return counts["tried"] >= most or os.path.exists(stop) or time.monotonic() > end

    # Any process of a host's namespace shows that namespace's sockets in its
    # /proc/PID/net/tcp: reading it takes microseconds, so even listeners that
    # live only during set-up are found.
    tables = {address: [f"/proc/{pid}/net/{table}" for table in ("tcp", "tcp6")]
              for namespace, address in hosts.items()
              for pid in subprocess.run(["ip", "netns", "pids", namespace], capture_output=True,
                                        text=True, timeout=10).stdout.split()[:1]}

    def discover() -> None:
        while not done():
            for address, paths in tables.items():
                for path in paths:
                    for port in _listening_ports(path):
                        if port != SSH_PORT:
                            with lock:
                                seen.setdefault((address, port), None)
            counts["discoveries"] += 1
            time.sleep(0.001)

    def attack(worker: int) -> None:
        turn = worker
        while not done():
            with lock:
                targets = list(seen)
            if not targets:
                time.sleep(0.005)
                continue
            turn += 1
            target = targets[turn % len(targets)]
            with lock:
                counts["tried"] += 1
            try:
                with socket.create_connection(target, timeout=0.5) as conn:
                    if turn % 2:
                        conn.sendall(os.urandom(64))
                kind = "accepted"
            except ConnectionRefusedError:
                kind = "refused"
            except OSError:
                kind = "other"
            with lock:
                counts[kind] += 1
            time.sleep(PACE)

    threads = [threading.Thread(target=discover)]
    threads += [threading.Thread(target=attack, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    with open(out, "w", encoding="utf-8") as f:
        json.dump({**counts, "ports": [f"{a}:{p}" for a, p in seen]}, f)


def _listening_ports(path: str) -> list[int]:
    try:
        with open(path, encoding="ascii") as f:
            rows = f.read().splitlines()[1:]
    except OSError:
        return []  # that process exited: the next discovery round reads again
    # Columns: sl, local address (hex ip:port), remote address, state (0A: LISTEN), ...
    return [int(row.split()[1].rsplit(":", 1)[1], 16) for row in rows
            if row.split()[3] == "0A"]


if __name__ == "__main__":
    main()
