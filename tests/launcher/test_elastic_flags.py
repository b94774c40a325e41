"""Unit tests of elastic mode's edges: the flags, discovery parsing and polling, and a
worker's environment (the planner and the executor: test_elastic_units.py)."""

from __future__ import annotations

import sys
from datetime import timedelta

import pytest

from hora.runner.args import ElasticPolicy, parse_args
from hora.runner.discovery import DiscoveryError, HostPoller, run_discovery_script
from hora.runner.env import elastic_worker_environment
from hora.runner.hosts import HostError, HostSlots, parse_discovery_output
from hora.settings import Settings
from hora_proto.auth import job_token

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

# -- flags -------------------------------------------------------------------------


def test_discovery_script_makes_the_job_elastic() -> None:
    config = parse_args(["--min-np", "2", "--max-np", "4", "--host-discovery-script",
                         "./discover.sh --zone a", "--slots-per-host", "2", "--reset-limit",
                         "3", "--blacklist-cooldown-range", "5", "30", "--elastic-timeout",
                         "60", "python", "train.py"], environ={})
    assert config.num_proc == 2  # -np defaults to --min-np
    assert config.elastic == ElasticPolicy(
        min_np=2, max_np=4, discovery_script="./discover.sh --zone a", slots_per_host=2,
        reset_limit=3, cooldown_range=(timedelta(seconds=5), timedelta(seconds=30)),
        elastic_timeout=timedelta(seconds=60))
    assert config.worker_settings == {"min_size": 2, "max_size": 4, "reset_limit": 3,
                                      "elastic_timeout": timedelta(seconds=60)}


def test_elastic_defaults() -> None:
    config = parse_args(["-np", "3", "--host-discovery-script", "d.sh", "c"], environ={})
    assert config.num_proc == 3
    assert config.elastic == ElasticPolicy(min_np=3, discovery_script="d.sh")
    assert config.elastic.elastic_timeout == timedelta(seconds=600)
    # No maximum: workers are not told one.
    assert config.worker_settings == {"min_size": 3, "elastic_timeout": timedelta(seconds=600)}


def test_min_max_with_a_fixed_host_list() -> None:
    config = parse_args(["-np", "3", "--min-np", "2", "--max-np", "4", "-H",
                         "127.0.0.2:2,127.0.0.3:2", "c"], environ={})
    assert config.elastic is not None and config.elastic.discovery_script is None
    assert (config.num_proc, config.elastic.min_np, config.elastic.max_np) == (3, 2, 4)
    assert config.hosts_arg == "127.0.0.2:2,127.0.0.3:2"


def test_static_job_is_not_elastic() -> None:
    config = parse_args(["-np", "2", "c"], environ={})
    assert config.elastic is None
    assert "min_size" not in config.worker_settings


@pytest.mark.parametrize("argv, message", [
    (["--host-discovery-script", "d.sh", "c"], "needs --min-np or -np"),
    (["--min-np", "3", "--max-np", "2", "--host-discovery-script", "d.sh", "c"],
     "--min-np 3 is larger than --max-np 2"),
    (["-np", "1", "--min-np", "2", "--host-discovery-script", "d.sh", "c"],
     "-np 1 is below --min-np 2"),
    (["-np", "5", "--min-np", "2", "--max-np", "4", "--host-discovery-script", "d.sh", "c"],
     "-np 5 is above --max-np 4"),
    (["--min-np", "1", "--host-discovery-script", "d.sh", "--blacklist-cooldown-range", "9",
      "3", "c"], "MIN 9 is larger than MAX 3"),
    (["--min-np", "1", "--host-discovery-script", "d.sh", "--blacklist-cooldown-range", "9",
      "c"], "expected a number"),
    (["--min-np", "2", "--max-np", "4", "c"], "needs --host-discovery-script"),
    (["-np", "2", "--reset-limit", "3", "c"], "--reset-limit applies to elastic jobs only"),
    (["-np", "2", "--elastic-timeout", "3", "c"], "--elastic-timeout applies to elastic"),
    (["--min-np", "1", "-H", "a:1", "--slots-per-host", "2", "c"],
     "--slots-per-host applies to --host-discovery-script only"),
    (["--min-np", "1", "-H", "a:1", "--host-discovery-script", "d.sh", "c"],
     "not allowed with argument -H/--hosts"),
    (["--min-np", "0", "--host-discovery-script", "d.sh", "c"], "must be at least 1"),
    (["--min-np", "1", "--host-discovery-script", "d.sh", "--elastic-timeout", "0", "c"],
     "must be > 0"),
    (["--min-np", "1", "--host-discovery-script", "d.sh", "--reset-limit", "-1", "c"],
     "must be >= 0"),
    (["--min-np", "1", "--host-discovery-script", " ", "c"], "empty command"),
])
def test_elastic_usage_errors_exit_2(argv: list[str], message: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(argv, environ={})
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: horarun -np N")
    assert message in err


# -- discovery ---------------------------------------------------------------------


def test_parse_discovery_output() -> None:
    text = "# from the scheduler\n127.0.0.2:2\n\n  127.0.0.3  \nh4:1 # rack b\n127.0.0.2:1\n"
    assert parse_discovery_output(text, default_slots=4) == [
        HostSlots("127.0.0.2", 3), HostSlots("127.0.0.3", 4), HostSlots("h4", 1)]
    assert parse_discovery_output("[::1]:2\n") == [HostSlots("::1", 2)]
    assert parse_discovery_output("") == []
    assert parse_discovery_output("# nobody\n\n") == []


@pytest.mark.parametrize("text, message", [
    ("h1:2\nh2 slots=2\n", "line 2: expected HOST or HOST:SLOTS"),
    ("h1:0\n", "line 1: slots must be at least 1"),
    ("h1:x\n", "slots must be an integer"),
    (":2\n", "empty host name"),
])
def test_parse_discovery_output_rejects(text: str, message: str) -> None:
    with pytest.raises(HostError, match=message):
        parse_discovery_output(text)


def test_run_discovery_script() -> None:
    script = f"{sys.executable} -c \"print('127.0.0.2:2'); print('127.0.0.3')\""
    assert run_discovery_script(script, default_slots=3) == [
        HostSlots("127.0.0.2", 2), HostSlots("127.0.0.3", 3)]


@pytest.mark.parametrize("script, message", [
    ("echo oops >&2; exit 3", "exited with code 3: oops"),
    ("echo 'a b c'", "expected HOST or HOST:SLOTS"),
    ("exec sleep 5", "did not finish within 0.3 s"),
])
def test_run_discovery_script_failures(script: str, message: str) -> None:
    with pytest.raises(DiscoveryError, match=message):
        run_discovery_script(script, timeout=0.3)


def test_poller_keeps_the_last_good_list_and_says_a_failure_once() -> None:
    answers: list[list[HostSlots] | Exception] = [
        [HostSlots("a", 1)], DiscoveryError("boom"), DiscoveryError("boom"),
        [HostSlots("b", 2)]]
    said: list[str] = []

    def find() -> list[HostSlots]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    poller = HostPoller(find, say=said.append)
    assert poller.latest() is None
    poller.poll_once()
    assert poller.latest() == (1, [HostSlots("a", 1)])
    poller.poll_once()
    poller.poll_once()
    assert poller.latest() == (1, [HostSlots("a", 1)])
    assert said == ["host discovery failed: boom; keeping the previous host list "
                    "(not repeated until discovery works again)"]
    poller.poll_once()
    assert poller.latest() == (2, [HostSlots("b", 2)])
    assert said[1:] == ["host discovery works again"]


# -- worker environment ------------------------------------------------------------------


def test_elastic_worker_environment() -> None:
    env = elastic_worker_environment(
        {"PATH": "/bin", "HOROVOD_RANK": "5", "HOROVOD_LOCAL_RANK": "1"}, "127.0.0.3",
        size=2, coordinator="127.0.0.1:5000", job_id="j", token="t",
        worker_settings={"min_size": 1, "max_size": 4, "reset_limit": 2,
                         "elastic_timeout": timedelta(seconds=30)})
    assert env == {
        "PATH": "/bin",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "HORA_COORDINATOR": "127.0.0.1:5000",
        "HORA_JOB_ID": "j",
        "HORA_TOKEN": job_token("t", "j"),  # the job's token, never the admin's
        "HORA_SIZE": "2",
        "HORA_RANK": "-1",
        "HORA_HOSTNAME": "127.0.0.3",
        "HORA_DATA_PLANE_ADDRESS": "127.0.0.3",
        "HORA_MIN_SIZE": "1",
        "HORA_MAX_SIZE": "4",
        "HORA_RESET_LIMIT": "2",
        "HORA_ELASTIC_TIMEOUT": "30.0",
        "HOROVOD_HOSTNAME": "127.0.0.3",
    }
    settings = Settings.from_env(env)
    assert (settings.rank, settings.min_size, settings.max_size) == (-1, 1, 4)
    assert settings.elastic_timeout == timedelta(seconds=30)
