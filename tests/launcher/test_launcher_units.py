"""Unit tests: argument parsing, host parsing, rank placement, worker env."""

from __future__ import annotations

import io
import signal
import socket
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from hora.runner.args import parse_address, parse_args
from hora.runner.env import worker_environment
from hora.runner.fixed import FixedPlanner, WorkerSpec
from hora.runner.hosts import (
    HostError,
    HostSlots,
    SlotInfo,
    assign_ranks,
    data_plane_address,
    is_local_host,
    parse_hostfile,
    parse_hosts,
)
from hora.runner.output import WorkerOutput
from hora.runner.supervisor import Supervisor, describe_exit, exit_code_of
from hora.settings import MiB, Settings
from hora_proto.auth import job_token

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


# -- args --------------------------------------------------------------------


def test_command_keeps_its_own_flags() -> None:
    config = parse_args(["-np", "2", "python", "train.py", "--epochs", "3", "-np", "9",
                         "-H", "x:1"], environ={})
    assert config.num_proc == 2
    assert config.command == ("python", "train.py", "--epochs", "3", "-np", "9", "-H", "x:1")
    assert config.hosts_arg is None


def test_double_dash_before_command_is_dropped() -> None:
    assert parse_args(["-np", "1", "--", "echo", "--x"], environ={}).command == ("echo", "--x")


def test_settings_flags_become_settings_fields() -> None:
    config = parse_args([
        "--num-proc", "4", "--fusion-threshold-mb", "32", "--cycle-time-ms", "2.5",
        "--start-timeout", "30", "--stall-check-warning-time-seconds", "10",
        "--stall-check-shutdown-time-seconds", "20", "--log-level", "debug",
        "--timeline-filename", "/tmp/t.json", "--timeline-mark-cycles", "--autotune",
        "--autotune-log-file", "/tmp/at.csv", "--cache-capacity", "7",
        "cmd",
    ], environ={})
    assert config.worker_settings == {
        "fusion_threshold": 32 * MiB,
        "cycle_time": timedelta(milliseconds=2.5),
        "start_timeout": timedelta(seconds=30),
        "stall_warning_time": timedelta(seconds=10),
        "stall_shutdown_time": timedelta(seconds=20),
        "log_level": "DEBUG",
        "timeline": "/tmp/t.json",
        "timeline_mark_cycles": True,
        "autotune": True,
        "autotune_log": "/tmp/at.csv",
        "cache_capacity": 7,
    }


def test_no_stall_check_turns_both_stall_times_off() -> None:
    config = parse_args(["-np", "1", "--no-stall-check", "cmd"], environ={})
    assert config.worker_settings == {"stall_warning_time": timedelta(0),
                                      "stall_shutdown_time": timedelta(0)}


def test_hora_spellings_of_stall_flags() -> None:
    config = parse_args(["-np", "1", "--stall-check-time", "5", "--stall-shutdown-time", "0",
                         "cmd"], environ={})
    assert config.worker_settings == {"stall_warning_time": timedelta(seconds=5),
                                      "stall_shutdown_time": timedelta(0)}


def test_no_settings_flags_pass_nothing() -> None:
    config = parse_args(["-np", "1", "cmd"], environ={})
    assert config.worker_settings == {}
    assert config.coordinator is None and config.prefix


def test_token_from_flag_env_or_random() -> None:
    assert parse_args(["-np", "1", "--token", "t1", "c"], environ={"HORA_TOKEN": "e"}).token == "t1"
    assert parse_args(["-np", "1", "c"], environ={"HORA_TOKEN": "e"}).token == "e"
    first = parse_args(["-np", "1", "c"], environ={})
    second = parse_args(["-np", "1", "c"], environ={})
    assert first.token and first.token != second.token
    assert first.job_id and first.job_id != second.job_id


@pytest.mark.parametrize("argv, message", [
    (["python"], "required: -np/--num-proc"),
    (["-np", "2"], "no command given"),
    (["-np", "0", "c"], "must be at least 1"),
    (["-np", "two", "c"], "expected an integer"),
    (["-np", "2", "--bogus", "c"], "unrecognized arguments: --bogus"),
    (["-np", "2", "--num", "c"], "unrecognized arguments: --num"),  # no abbreviations
    (["-np", "2", "--coordinator", "nohost", "c"], "expected HOST:PORT"),
    (["-np", "2", "--coordinator", "h:99999", "c"], "port must be in 1..65535"),
    (["-np", "2", "-H", "a:1", "--hostfile", "f", "c"], "not allowed with"),
    (["-np", "2", "--cycle-time-ms", "0", "c"], "must be > 0"),
    (["-np", "2", "--log-level", "LOUD", "c"], "expected one of"),
])
def test_usage_errors_exit_2(argv: list[str], message: str,
                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(argv, environ={})
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: horarun -np N")
    assert message in err


@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:50051", ("127.0.0.1", 50051)),
    ("coord.example:1", ("coord.example", 1)),
    ("[::1]:8080", ("::1", 8080)),
])
def test_parse_address(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected


# -- hosts ---------------------------------------------------------------------


def test_parse_hosts() -> None:
    assert parse_hosts("h1:2, h2:3,h3") == [HostSlots("h1", 2), HostSlots("h2", 3),
                                             HostSlots("h3", 1)]
    assert parse_hosts("[::1]:2") == [HostSlots("::1", 2)]
    # A repeated host keeps its first position and adds up its slots.
    assert parse_hosts("a:1,b:1,a:2") == [HostSlots("a", 3), HostSlots("b", 1)]


@pytest.mark.parametrize("text", ["", "h1:0", "h1:x", ":2", "h1:2,,h2:1", "[::1:2"])
def test_parse_hosts_rejects(text: str) -> None:
    with pytest.raises(HostError):
        parse_hosts(text)


def test_parse_hostfile() -> None:
    lines = ["# cluster\n", "h1 slots=4\n", "\n", "h2:2  # rack b\n", "h3\n"]
    assert parse_hostfile(lines) == [HostSlots("h1", 4), HostSlots("h2", 2), HostSlots("h3", 1)]


def test_parse_hostfile_names_the_bad_line() -> None:
    with pytest.raises(HostError, match=r"hosts.txt:2: expected 'HOST slots=N'"):
        parse_hostfile(["h1 slots=1", "h2 cpus=4"], name="hosts.txt")
    with pytest.raises(HostError, match="no hosts"):
        parse_hostfile(["# nothing"], name="hosts.txt")


def test_assign_ranks_fills_hosts_in_order() -> None:
    slots = assign_ranks([HostSlots("a", 2), HostSlots("b", 2), HostSlots("c", 1)], 5)
    assert [(s.hostname, s.rank, s.local_rank, s.local_size) for s in slots] == [
        ("a", 0, 0, 2), ("a", 1, 1, 2), ("b", 2, 0, 2), ("b", 3, 1, 2), ("c", 4, 0, 1)]
    # local_rank 0 lives on a, b and c; local_rank 1 only on a and b.
    assert [(s.cross_rank, s.cross_size) for s in slots] == [
        (0, 3), (0, 2), (1, 3), (1, 2), (2, 3)]
    assert all(s.size == 5 for s in slots)


def test_assign_ranks_leaves_later_hosts_empty() -> None:
    slots = assign_ranks([HostSlots("a", 2), HostSlots("b", 4)], 3)
    assert slots == [
        SlotInfo("a", 0, 3, 0, 2, 0, 2),
        SlotInfo("a", 1, 3, 1, 2, 0, 1),
        SlotInfo("b", 2, 3, 0, 1, 1, 2),
    ]
    # b has spare slots, and a host with no rank counts in no cross size.
    assert assign_ranks([HostSlots("a", 2), HostSlots("b", 4)], 2)[0].cross_size == 1


def test_assign_ranks_single_host() -> None:
    slots = assign_ranks([HostSlots("localhost", 3)], 3)
    assert [(s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots] == [
        (0, 3, 0, 1), (1, 3, 0, 1), (2, 3, 0, 1)]


def test_assign_ranks_too_few_slots() -> None:
    with pytest.raises(HostError, match=r"-np 5 needs 5 slots but the hosts have only 3 "
                                        r"\(a:1,b:2\)"):
        assign_ranks([HostSlots("a", 1), HostSlots("b", 2)], 5)


def test_local_hosts() -> None:
    for name in ("localhost", "127.0.0.1", "127.0.0.2", "::1", socket.gethostname()):
        assert is_local_host(name), name
    assert not is_local_host("gpu-node-17.example.invalid")
    assert not is_local_host("10.255.255.254")


def test_data_plane_address() -> None:
    assert data_plane_address("127.0.0.3") == "127.0.0.3"
    assert data_plane_address("localhost") == "127.0.0.1"
    assert data_plane_address(socket.gethostname()) == "127.0.0.1"


# -- worker environment ----------------------------------------------------------


def test_worker_environment() -> None:
    slot = SlotInfo("127.0.0.3", rank=2, size=3, local_rank=0, local_size=1,
                    cross_rank=1, cross_size=2)
    env = worker_environment(
        {"PATH": "/bin", "OMP_NUM_THREADS": "4", "HORA_RANK": "7"}, slot,
        coordinator="127.0.0.1:5000", job_id="j", token="t",
        worker_settings={"fusion_threshold": 8 * MiB, "cycle_time": timedelta(milliseconds=3)},
    )
    assert env == {
        "PATH": "/bin",
        "OMP_NUM_THREADS": "4",  # the user's choice is kept
        "PYTHONUNBUFFERED": "1",
        "HORA_COORDINATOR": "127.0.0.1:5000",
        "HORA_JOB_ID": "j",
        "HORA_TOKEN": job_token("t", "j"),  # the job's token, never the admin's
        "HORA_SIZE": "3",
        "HORA_RANK": "2",
        "HORA_HOSTNAME": "127.0.0.3",
        "HORA_DATA_PLANE_ADDRESS": "127.0.0.3",
        "HORA_FUSION_THRESHOLD": str(8 * MiB),
        "HORA_CYCLE_TIME": "3.0",
        "HOROVOD_RANK": "2",
        "HOROVOD_SIZE": "3",
        "HOROVOD_LOCAL_RANK": "0",
        "HOROVOD_LOCAL_SIZE": "1",
        "HOROVOD_CROSS_RANK": "1",
        "HOROVOD_CROSS_SIZE": "2",
        "HOROVOD_HOSTNAME": "127.0.0.3",
    }
    # What the worker reads back is what the launcher meant.
    settings = Settings.from_env(env)
    assert (settings.rank, settings.size, settings.fusion_threshold) == (2, 3, 8 * MiB)
    assert settings.cycle_time == timedelta(milliseconds=3)
    assert worker_environment({}, slot, coordinator="c:1", job_id="j",
                              token="t")["OMP_NUM_THREADS"] == "1"


# -- supervision helpers ----------------------------------------------------------


def test_exit_codes() -> None:
    assert exit_code_of(0) == 0
    assert exit_code_of(3) == 3
    assert exit_code_of(-signal.SIGKILL) == 137
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"


@pytest.mark.timeout(20)
def test_supervisor_kills_workers_that_ignore_sigterm(tmp_path: Path) -> None:
    # In-process with a short grace period, so the SIGKILL escalation is
    # tested without waiting the real 5 s.
    ready = tmp_path / "ready"
    stubborn = ("import pathlib, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                f"print('ready', flush=True); pathlib.Path({str(ready)!r}).touch(); "
                "time.sleep(30)")
    # Fails only once rank 0 ignores SIGTERM, so the escalation is certain.
    failing = ("import pathlib, time\n"
               f"while not pathlib.Path({str(ready)!r}).exists(): time.sleep(0.01)\n"
               "raise SystemExit(4)")
    specs = [WorkerSpec(0, "localhost", [sys.executable, "-c", stubborn], {}),
             WorkerSpec(1, "localhost", [sys.executable, "-c", failing], {})]
    out, err = io.StringIO(), io.StringIO()
    code = Supervisor(FixedPlanner(specs), WorkerOutput(stdout=out, stderr=err),
                      grace_period=0.5).run()
    assert code == 4
    assert "[0]<stdout>:ready\n" in out.getvalue()
    messages = err.getvalue()
    assert "rank 1 (pid" in messages and "exited with code 4; stopping the other 1 worker" \
        in messages
    assert "1 worker still running after 0.5 s; killing rank 0 (pid" in messages


def test_a_job_on_one_machine_keeps_everything_on_loopback():
    from hora.runner.launch import _network

    network = _network(parse_args(["-np", "2", "-H", "localhost:1,127.0.0.2:1", "true"]),
                       ["localhost", "127.0.0.2"])
    assert (network.remote, network.host) == (None, "127.0.0.1")
    assert network.worker_settings("localhost") == {}


def test_a_job_across_machines_gives_every_worker_a_routable_address():
    from hora.runner.launch import _network, _UsageError

    config = parse_args(["-np", "2", "-H", "localhost:1,node-a:1", "true"])
    try:
        network = _network(config, ["localhost", "node-a"])
    except _UsageError:
        pytest.skip("node-a does not resolve and this machine has no default route")
    assert network.remote is not None
    # Workers here use the coordinator's address; elsewhere each finds its own.
    assert network.worker_settings("localhost") == {"data_plane_address": network.host}
    assert network.worker_settings("node-a") == {"data_plane_address": "auto"}
    named = _network(parse_args(["-np", "2", "-H", "localhost:1,node-a:1",
                                 "--network-interface", "lo,eth0", "true"]),
                     ["localhost", "node-a"])
    assert named.host == "127.0.0.1"
    assert named.worker_settings("node-a") == {"network_interface": "lo"}
