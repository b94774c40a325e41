"""hora-coordinator's command line: defaults, and bad values as usage errors."""

from __future__ import annotations

from datetime import timedelta

import pytest

from hora_coordinator.settings import build_parser, parse_command_line

pytestmark = pytest.mark.unit


def test_ended_jobs_are_kept_an_hour_by_default():
    assert parse_command_line([], {}).settings.job_retention == timedelta(hours=1)
    parsed = parse_command_line(["--job-retention-s", "0"], {})
    assert parsed.settings.job_retention == timedelta(0)


@pytest.mark.parametrize("argv", [["--job-retention-s", "-1"], ["--lease-s", "0"],
                                  ["--grpc-port", "70000"]])
def test_bad_values_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_command_line(argv, {})
    assert exc.value.code == 2
    assert "must" in capsys.readouterr().err


def test_the_fault_injection_hook_is_off_by_default_and_left_out_of_help():
    assert parse_command_line([], environ={}).settings.test_die_after_list == 0
    on = parse_command_line(["--test-die-after-list", "3"], environ={})
    assert on.settings.test_die_after_list == 3
    assert "test-die-after-list" not in build_parser().format_help()
