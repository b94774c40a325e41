"""Unit tests: horovodrun's flags that hora accepts, maps, ignores or refuses,
Horovod's ``--config-file``, and the worker settings they end in."""

from __future__ import annotations

import logging
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest

from hora.runner.args import parse_args
from hora.settings import MiB, Settings, configure_logging

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def _hvd(*argv: str):
    return parse_args([*argv, "cmd"], environ={}, prog="horovodrun", horovod_compat=True)


def test_one_dash_hostfile(tmp_path: Path) -> None:
    config = _hvd("-np", "2", "-hostfile", "hosts.txt")
    assert config.hostfile == "hosts.txt"


def test_min_and_max_num_proc_are_min_and_max_np() -> None:
    config = _hvd("-np", "2", "--min-num-proc", "1", "--max-num-proc", "3", "-H", "a:3")
    assert config.elastic is not None
    assert (config.elastic.min_np, config.elastic.max_np) == (1, 3)


@pytest.mark.parametrize("argv, expected", [
    (["--gloo-timeout-seconds", "45"], {"collective_timeout": timedelta(seconds=45)}),
    (["--no-autotune"], {}),
    (["--autotune", "--autotune-warmup-samples", "2", "--autotune-bayes-opt-max-samples", "9"],
     {"autotune": True, "autotune_warmup_samples": 2, "autotune_max_samples": 9}),
    (["--stall-check"], {}),
    (["--timeline-filename", "t.json", "--no-timeline-mark-cycles"],
     {"timeline": "t.json"}),
    (["--log-level", "INFO", "--log-without-timestamp"],
     {"log_level": "INFO", "log_hide_time": True}),
    (["--log-with-timestamp"], {"log_hide_time": False}),
    (["--disable-cache"], {}),
    # Asking for what hora does anyway needs no notice.
    (["--no-hierarchical-allreduce", "--no-hierarchical-allgather"], {}),
    (["--no-mpi-threads-disable", "--gloo"], {}),
])
def test_flags_map_to_worker_settings(argv: list[str], expected: dict) -> None:
    config = _hvd("-np", "1", *argv)
    assert dict(config.worker_settings) == expected
    assert config.notices == ()


def test_stall_check_after_no_stall_check_turns_it_back_on() -> None:
    assert _hvd("-np", "1", "--no-stall-check", "--stall-check").worker_settings == {}


def test_prefix_output_with_timestamp() -> None:
    assert _hvd("-np", "1", "--prefix-output-with-timestamp").prefix_timestamp
    assert _hvd("-np", "1", "-prefix-timestamp").prefix_timestamp
    assert not _hvd("-np", "1").prefix_timestamp


def test_tcp_keeps_nccl_off_infiniband() -> None:
    config = _hvd("-np", "1", "--tcp")
    assert dict(config.worker_env) == {"NCCL_IB_DISABLE": "1"}


@pytest.mark.parametrize("argv, flag", [
    (["--hierarchical-allreduce"], "--hierarchical-allreduce"),
    (["--hierarchical-allgather"], "--hierarchical-allgather"),
    (["--torus-allreduce"], "--torus-allreduce"),
    (["--num-nccl-streams", "2"], "--num-nccl-streams"),
    (["--thread-affinity", "3"], "--thread-affinity"),
    (["--binding-args", "--bind-to core"], "--binding-args"),
    (["--mpi-threads-disable"], "--mpi-threads-disable"),
    (["--mpi-args=--map-by ppr:6:node"], "--mpi-args"),
    (["--autotune", "--autotune-steps-per-sample", "5"], "--autotune-steps-per-sample"),
    (["--autotune", "--autotune-gaussian-process-noise", "0.5"],
     "--autotune-gaussian-process-noise"),
])
def test_flags_hora_has_no_use_for_are_ignored_with_one_line(argv: list[str],
                                                            flag: str) -> None:
    config = _hvd("-np", "1", *argv)
    assert len(config.notices) == 1
    assert config.notices[0].startswith(f"ignoring {flag}:")
    assert "autotune" in config.worker_settings or config.worker_settings == {}


@pytest.mark.parametrize("argv, message", [
    (["--mpi"], "--mpi: hora starts its workers itself"),
    (["--jsrun"], "--jsrun: hora starts its workers itself"),
    (["--gloo", "--mpi"], "not allowed with"),
    (["--gloo-timeout-seconds", "0"], "must be > 0"),
    (["--autotune-gaussian-process-noise", "2"], "must be in [0, 1]"),
    (["--config-file", "/nonexistent/hvd.yaml"], "--config-file: cannot read"),
])
def test_refused(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        _hvd("-np", "1", *argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


CONFIG = """
    params:
      fusion_threshold_mb: 32
      cycle_time_ms: 2.5
      cache_capacity: 7
      hierarchical_allreduce: false
    autotune:
      enabled: true
      log_file: at.csv
      warmup_samples: 1
    timeline:
      filename: tl.json
      mark_cycles: true
    stall_check:
      enabled: true
      warning_time_seconds: 11
      shutdown_time_seconds: 22
    library_options:
      gloo_timeout_seconds: 40
      num_nccl_streams: 2
    logging:
      level: DEBUG
      with_timestamp: false
"""


def _config_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "hvd.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_config_file_fills_what_the_command_line_does_not(tmp_path: Path) -> None:
    path = _config_file(tmp_path, CONFIG)
    config = _hvd("-np", "1", "--config-file", path, "--cycle-time-ms", "5",
                  "--no-timeline-mark-cycles")
    assert dict(config.worker_settings) == {
        "fusion_threshold": 32 * MiB,
        "cycle_time": timedelta(milliseconds=5),  # the flag wins
        "cache_capacity": 7,
        "autotune": True,
        "autotune_log": "at.csv",
        "autotune_warmup_samples": 1,
        "timeline": "tl.json",  # mark_cycles: the flag said no
        "stall_warning_time": timedelta(seconds=11),
        "stall_shutdown_time": timedelta(seconds=22),
        "collective_timeout": timedelta(seconds=40),
        "log_level": "DEBUG",
        "log_hide_time": True,
    }
    assert len(config.notices) == 1
    assert config.notices[0].startswith("ignoring library_options.num_nccl_streams in "
                                        "--config-file: hora ")


def test_config_file_stall_check_disabled(tmp_path: Path) -> None:
    path = _config_file(tmp_path, "stall_check:\n  enabled: false\n")
    assert dict(_hvd("-np", "1", "--config-file", path).worker_settings) == {
        "stall_warning_time": timedelta(0), "stall_shutdown_time": timedelta(0)}
    assert dict(_hvd("-np", "1", "--config-file", path, "--stall-check").worker_settings) == {}


@pytest.mark.parametrize("text, message", [
    ("params: [1, 2]\n", "--config-file"),
    ("params:\n  cycle_time_ms: fast\n", "params.cycle_time_ms"),
    ("controller: mpi\n", "controller: mpi"),
    ("logging:\n  level: LOUD\n", "logging.level"),
    (":\n- [", "--config-file"),
])
def test_bad_config_file_is_a_usage_error(tmp_path: Path, text: str, message: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = _config_file(tmp_path, text)
    with pytest.raises(SystemExit) as info:
        _hvd("-np", "1", "--config-file", path)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_unknown_config_keys_are_named(tmp_path: Path) -> None:
    path = _config_file(tmp_path, "params:\n  fusion_treshold_mb: 1\n")
    config = _hvd("-np", "1", "--config-file", path)
    assert config.worker_settings == {}
    assert config.notices == ("ignoring params.fusion_treshold_mb in --config-file: "
                              "not a Horovod setting hora knows",)


# -- worker settings -----------------------------------------------------------


@pytest.mark.parametrize("name", ["HOROVOD_STALL_CHECK_DISABLE", "HORA_STALL_CHECK_DISABLE"])
def test_stall_check_disable_env_turns_both_stall_times_off(name: str) -> None:
    settings = Settings.from_env({name: "1", "HOROVOD_STALL_CHECK_TIME_SECONDS": "5"})
    assert settings.stall_warning_time == timedelta(0)
    assert settings.stall_shutdown_time == timedelta(0)
    assert Settings.from_env({name: "0"}).stall_warning_time == Settings().stall_warning_time


def test_new_settings_round_trip_through_the_environment() -> None:
    settings = Settings(log_hide_time=True, autotune_warmup_samples=2, autotune_max_samples=9,
                        collective_timeout=timedelta(seconds=45))
    assert Settings.from_env(settings.to_env()) == settings


@pytest.fixture
def hora_logger():
    logger = logging.getLogger("hora")
    saved = (logger.level, list(logger.handlers))
    yield logger
    logger.setLevel(saved[0])
    logger.handlers[:] = saved[1]


def test_a_configured_log_level_prints_hora_messages_once(hora_logger, capsys) -> None:
    settings = Settings.from_env({"HOROVOD_LOG_LEVEL": "debug"})
    configure_logging(settings)
    configure_logging(settings)  # shutdown() and init() again: still one handler
    logging.getLogger("hora.x").debug("marker %d", 7)
    err = capsys.readouterr().err
    assert err.count("marker 7") == 1 and "DEBUG" in err


def test_no_log_level_installs_no_handler(hora_logger) -> None:
    before = list(hora_logger.handlers)
    configure_logging(Settings.from_env({}))
    assert hora_logger.handlers == before
