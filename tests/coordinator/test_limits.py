"""Unit tests of the coordinator's Join size limits (pure, no servers)."""

from __future__ import annotations

import dataclasses

import pytest
from coordinator_transitions import jreq

from hora_coordinator import CoordinatorSettings
from hora_coordinator.errors import InvalidRequestError
from hora_coordinator.limits import check_join_limits

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_an_overlong_id_is_refused_naming_the_job_cut_to_64_characters():
    settings = CoordinatorSettings(max_id_length=100)
    long_job = dataclasses.replace(jreq("w", 1), job_id="j" * 101)
    with pytest.raises(InvalidRequestError) as info:
        check_join_limits(settings, None, long_job)
    assert str(info.value) == (
        f"job_id of 101 characters is longer than the limit of 100 (job '{'j' * 64}…')"
    )
    with pytest.raises(InvalidRequestError) as info:
        check_join_limits(settings, None, jreq("w" * 101, 1))
    assert str(info.value) == (
        "worker_id of 101 characters is longer than the limit of 100 (job 'job')"
    )
