"""Elastic ``horovodrun`` behaves as Horovod 0.28.1's does, scenario by scenario.

The scenarios and the numbers they check are those of Horovod's own elastic
integration tests (``test/integration/elastic_common.py``): the same flags,
a discovery script that changes over epochs (it counts the lines the
training script logged), and per epoch the world size, the start rank
(``HOROVOD_RANK``) and host of rank 0, and how many rendezvous the training
state has been through. Hosts are the loopback names ``localhost`` and
``127.0.0.1``, two slots each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
HOROVODRUN = [sys.executable, "-c",
              "import sys; from hora.runner.launch import horovodrun_main; "
              "sys.exit(horovodrun_main())"]
WORKER = Path(__file__).with_name("elastic_horovodrun_worker.py")
BOTH = ["localhost:2", "127.0.0.1:2"]


def discovery_script(tmp_path: Path, logfile: Path,
                     schedule: list[tuple[int | None, list[str]]]) -> Path:
    """A script offering ``hosts`` while the log holds ``epoch`` lines (None: otherwise)."""
    lines = ["#!/bin/sh", f"epoch=$(cat {logfile} 2>/dev/null | wc -l | tr -d ' ')"]
    for epoch, hosts in schedule:
        echo = "; ".join(f"echo {host}" for host in hosts)
        if epoch is None:
            lines.append(echo)
        else:
            lines.append(f'if [ "$epoch" = "{epoch}" ]; then {echo}; exit 0; fi')
    script = tmp_path / "discover.sh"
    script.write_text("\n".join(lines) + "\n")
    script.chmod(0o755)
    return script


def run(tmp_path: Path, schedule: list[tuple[int | None, list[str]]], *,
        flags: list[str] = (), worker_args: list[str] = (),
        timeout: float = 240) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    logfile = tmp_path / "log.jsonl"
    script = discovery_script(tmp_path, logfile, schedule)
    cmd = [*HOROVODRUN, "-np", "2", "--min-num-proc", "2", "--max-num-proc", "4",
           "--host-discovery-script", str(script), *flags,
           sys.executable, str(WORKER), str(logfile), *worker_args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HORA_START_TIMEOUT": "120"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env=env)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        log = logfile.read_text() if logfile.exists() else ""
        raise AssertionError(f"horovodrun ran over {timeout} s\n{log}\n{err[-6000:]}") from None
    epochs = ([json.loads(line) for line in logfile.read_text().splitlines()]
              if logfile.exists() else [])
    return proc, epochs


def summary(epochs: list[dict]) -> list[tuple[int, int, str, int]]:
    """(size, start rank, host, rendezvous) of rank 0, per epoch."""
    return [(e["size"], e["start_rank"], e["hostname"], e["rendezvous"]) for e in epochs]


LOCAL = [[0, "localhost"], [1, "localhost"]]
OTHER = [[2, "127.0.0.1"], [3, "127.0.0.1"]]


def worlds(epochs: list[dict]) -> list[list[list]]:
    """Every rank's [start rank, host] by hvd.rank(), per epoch."""
    return [e["world"] for e in epochs]


def explain(proc: subprocess.CompletedProcess[str], epochs: list[dict]) -> str:
    return f"exit {proc.returncode}\nepochs {epochs}\n{proc.stderr[-6000:]}"


@pytest.mark.timeout(260)
def test_initial_world_takes_every_slot_up_to_max_num_proc(tmp_path: Path) -> None:
    """-np 2 --max-num-proc 4 with 4 slots offered: Horovod starts 4 workers, and
    a start rank 0 that fails at epoch 1 blacklists its host only: the two
    workers of the other host finish the job (Horovod's test_single_rank_failure)."""
    proc, epochs = run(tmp_path, [(None, BOTH)], worker_args=["--exit-at", "1", "0"])
    assert proc.returncode == 0, explain(proc, epochs)
    assert summary(epochs) == [(4, 0, "localhost", 1), (2, 2, "127.0.0.1", 2),
                               (2, 2, "127.0.0.1", 2)], explain(proc, epochs)
    # Rank 0 of the first world sat in slot 0 of the first host.
    assert epochs[0]["placement"] == {"size": "4", "local_rank": "0", "local_size": "2",
                                      "cross_rank": "0", "cross_size": "2"}
    # 127.0.0.1's first slot: rank 2 of 4, second host in the cross ranks.
    assert epochs[1]["placement"] == {"size": "4", "local_rank": "0", "local_size": "2",
                                      "cross_rank": "1", "cross_size": "2"}
    # hvd.rank() as Horovod numbers it: start ranks in the first world, the
    # surviving host's workers first after the failure.
    assert worlds(epochs) == [LOCAL + OTHER, OTHER, OTHER]
    assert "blacklisting localhost and killing its other worker" in proc.stderr
    assert proc.stderr.count("fails at epoch 1") == 1, "only start rank 0 fails"


HOSTS_ADDED_AND_REMOVED = [(0, ["localhost:2"]), (1, BOTH), (None, ["127.0.0.1:2"])]


@pytest.mark.timeout(260)
def test_hosts_added_and_removed_within_the_reset_limit(tmp_path: Path) -> None:
    """Horovod's test_hosts_added_and_removed, with --reset-limit 2 (two resets:
    its test_reset_limit's succeeding half)."""
    proc, epochs = run(tmp_path, HOSTS_ADDED_AND_REMOVED, flags=["--reset-limit", "2"],
                       worker_args=["--hold", "0", "4", "--hold", "1", "2"])
    assert proc.returncode == 0, explain(proc, epochs)
    assert summary(epochs) == [(2, 0, "localhost", 1), (4, 0, "localhost", 2),
                               (2, 2, "127.0.0.1", 3)], explain(proc, epochs)
    # The added host's workers started as ranks 2 and 3 of 4 and keep them.
    assert worlds(epochs) == [LOCAL, LOCAL + OTHER, OTHER]


@pytest.mark.timeout(260)
def test_one_reset_too_many_fails_the_job(tmp_path: Path) -> None:
    """The same schedule with --reset-limit 1: the second reset ends the job."""
    proc, epochs = run(tmp_path, HOSTS_ADDED_AND_REMOVED, flags=["--reset-limit", "1"],
                       worker_args=["--hold", "0", "4", "--hold", "1", "2"])
    assert proc.returncode != 0, explain(proc, epochs)
    assert "reset limit 1 exceeded" in proc.stderr, explain(proc, epochs)
    assert summary(epochs)[:2] == [(2, 0, "localhost", 1), (4, 0, "localhost", 2)], \
        explain(proc, epochs)
    assert len(epochs) == 2, explain(proc, epochs)


@pytest.mark.timeout(260)
def test_a_blacklisted_host_comes_back_after_its_cooldown(tmp_path: Path) -> None:
    """--blacklist-cooldown-range 1 2: the failed host sits out (Horovod's backoff,
    held at MAX: 2 s), then is appended to the assignment order and the world
    grows back to 4, with 127.0.0.1 now first."""
    proc, epochs = run(tmp_path, [(None, BOTH)],
                       flags=["--blacklist-cooldown-range", "1", "2"],
                       worker_args=["--exit-at", "1", "0", "--hold", "1", "4"])
    assert proc.returncode == 0, explain(proc, epochs)
    assert summary(epochs) == [(4, 0, "localhost", 1), (2, 2, "127.0.0.1", 2),
                               (4, 2, "127.0.0.1", 3)], explain(proc, epochs)
    # The host is back last in the order: its new workers start as ranks 2 and 3.
    assert worlds(epochs) == [LOCAL + OTHER, OTHER, OTHER + [[2, "localhost"], [3, "localhost"]]]
    assert "blacklisting localhost for 2.0 s" in proc.stderr, proc.stderr[-4000:]
    assert "host localhost is back after its 2.0 s cooldown" in proc.stderr
