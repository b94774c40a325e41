"""The options table (``hora_proto.options``): each option declared once.

What is made from the table must agree with it: ``Settings`` (fields,
defaults, ``from_env``/``to_env``), ``horarun``'s flags, and the job-level
options a worker sends when it joins, which the coordinator reads back
through the same table.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest

from hora.runner.args import parse_args
from hora.runner.flags import build_parser
from hora.settings import ENV_VARS, Settings
from hora_coordinator import wire
from hora_coordinator.errors import InvalidRequestError
from hora_proto.options import (
    BY_FIELD,
    JOB_LEVEL,
    LAUNCHER_ONLY,
    OPTIONS,
    default_of,
    format_value,
    job_value,
)
from hora_proto.v1 import rendezvous_pb2 as rpb

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_every_option_has_a_hora_name_first_and_no_name_twice():
    names = [name for option in OPTIONS for name in option.names]
    assert len(names) == len(set(names))
    for option in OPTIONS:
        assert option.names and option.names[0].startswith("HORA_"), option.field
        assert all(n.startswith(("HORA_", "HOROVOD_")) for n in option.names), option.field
        assert option.help, option.field
    assert len(BY_FIELD) == len(OPTIONS)


def test_flags_are_unique_and_each_is_in_horarun_s_parser():
    spellings = [name for o in OPTIONS if o.flag is not None
                 for name in (*o.flag.names, *((o.flag.off,) if o.flag.off else ()),
                              *(o.flag.exclusive[0] if o.flag.exclusive else ()))]
    dests = [o.flag.dest for o in OPTIONS if o.flag is not None]
    assert len(spellings) == len(set(spellings))
    assert len(dests) == len(set(dests))
    known = build_parser()._option_string_actions
    assert [s for s in spellings if s not in known] == []


def test_defaults_survive_the_text_they_travel_as():
    for option in OPTIONS:
        default = default_of(option)
        if default is None:
            continue
        assert option.parse(format_value(option, default)) == default, option.field


def test_settings_has_one_field_per_worker_option_with_the_table_s_default():
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    assert list(fields) == [o.field for o in ENV_VARS]
    assert {o.field for o in OPTIONS} - set(fields) == set(LAUNCHER_ONLY)
    plain = Settings()
    for option in ENV_VARS:
        assert getattr(plain, option.field) == default_of(option), option.field


def test_a_horovod_alias_is_read_and_the_hora_name_wins():
    settings = Settings.from_env({"HOROVOD_ELASTIC_TIMEOUT": "30", "HOROVOD_CYCLE_TIME": "5",
                                  "HORA_CYCLE_TIME": "7"})
    assert settings.elastic_timeout == timedelta(seconds=30)
    assert settings.cycle_time == timedelta(milliseconds=7)
    assert Settings.from_env(settings.to_env()) == settings


def test_a_flag_reaches_the_setting_in_the_setting_s_unit():
    config = parse_args(["-np", "2", "--fusion-threshold-mb", "2", "--cycle-time-ms", "3",
                         "--log-without-timestamp", "--no-autotune", "true"], environ={})
    assert config.worker_settings == {"fusion_threshold": 2 * 1024 * 1024,
                                      "cycle_time": timedelta(milliseconds=3),
                                      "log_hide_time": True}


def _joined(settings: Settings) -> rpb.JoinRequest:
    return rpb.JoinRequest(job_id="j", worker_id="w", host="h", expected_size=2,
                           job_options=settings.job_options())


def test_job_level_options_round_trip_through_the_join_and_the_coordinator():
    settings = Settings(fusion_threshold=5000, stall_warning_time=timedelta(seconds=3),
                        stall_shutdown_time=timedelta(seconds=9), min_size=1, max_size=4,
                        elastic_timeout=timedelta(seconds=42))
    request = wire.join_request(_joined(settings))
    assert set(request.job_options) == {o.field for o in JOB_LEVEL}
    for option in JOB_LEVEL:
        assert job_value(request.job_options, option.field) == getattr(settings, option.field)
    assert (request.fusion_threshold_bytes, request.stall_warning_ms, request.stall_shutdown_ms,
            request.min_size, request.max_size, request.elastic_timeout_ms) == (
        5000, 3000, 9000, 1, 4, 42_000)


@pytest.mark.parametrize("options", [{"elastic_timeout": "soon"},
                                     {"elastic_timeout": "1e300"}, {"min_size": "-1"},
                                     {"fusion_threshold": "9" * 100},
                                     {"x" * 65: "1"}, {"bad\nname": "1"},
                                     {f"newer_{i}": "1" for i in range(65)}])
def test_the_coordinator_refuses_job_options_it_cannot_read(options):
    with pytest.raises(InvalidRequestError):
        wire.join_request(rpb.JoinRequest(job_id="j", worker_id="w", expected_size=1,
                                          job_options=options))


def test_an_option_this_coordinator_does_not_know_is_kept_and_not_acted_on():
    """A newer worker's job-level option: the Join succeeds, the REST view keeps it."""
    request = wire.join_request(rpb.JoinRequest(
        job_id="j", worker_id="w", expected_size=1,
        job_options={"newer_option": "on", "min_size": "2"}))
    assert request.job_options == {"newer_option": "on", "min_size": "2"}
    assert request.min_size == 2
