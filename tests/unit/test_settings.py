"""Worker settings: one place, HORA_* names first, HOROVOD_* accepted, clear errors."""

from __future__ import annotations

from datetime import timedelta

import pytest

from hora.settings import Settings, SettingsError

pytestmark = pytest.mark.unit


def test_defaults_are_horovods_where_horovod_has_one():
    s = Settings.from_env({})
    assert s.fusion_threshold == 128 * 1024 * 1024
    assert s.size == 1 and s.rank == -1
    assert s.stall_warning_time == timedelta(seconds=60)


def test_horovod_names_are_accepted_and_hora_names_win():
    env = {"HOROVOD_FUSION_THRESHOLD": "1024", "HOROVOD_CYCLE_TIME": "5",
           "HOROVOD_SIZE": "4", "HOROVOD_RANK": "2", "HORA_RANK": "3"}
    s = Settings.from_env(env)
    assert s.fusion_threshold == 1024
    assert s.cycle_time == timedelta(milliseconds=5)
    assert s.size == 4 and s.rank == 3


def test_bad_value_names_the_variable():
    with pytest.raises(SettingsError, match="HORA_START_TIMEOUT='soon'"):
        Settings.from_env({"HORA_START_TIMEOUT": "soon"})
    with pytest.raises(SettingsError, match="rank 5 is outside a world of size 2"):
        Settings.from_env({"HORA_SIZE": "2", "HORA_RANK": "5"})
    with pytest.raises(SettingsError, match="connect_timeout must be positive"):
        Settings.from_env({"HORA_CONNECT_TIMEOUT": "0"})


def test_to_env_round_trips():
    s = Settings.from_env({"HORA_CYCLE_TIME": "2.5", "HORA_START_TIMEOUT": "7",
                           "HORA_COORDINATOR": "h:1", "HORA_SIZE": "3", "HORA_RANK": "1"})
    assert Settings.from_env(s.to_env()) == s
