"""hora_proto.refusals: the one rate-limited log of refused calls and connections."""

from __future__ import annotations

import logging

from hora_proto.refusals import MAX_KINDS, RefusalLog


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_kind_per_interval_and_the_next_line_counts_the_rest(caplog):
    clock = Clock()
    log = RefusalLog(10.0, logging.getLogger("hora.test"), clock)
    with caplog.at_level(logging.WARNING, logger="hora.test"):
        for _ in range(4):
            log.refused("a", "refused a")
        log.refused("b", "refused b")
        clock.now = 11.0
        log.refused("a", "refused a again")
    assert [r.getMessage() for r in caplog.records] == [
        "refused a", "refused b", "refused a again (3 more like it since the last such line)"]


def test_a_stranger_varying_its_address_cannot_grow_the_table(caplog):
    clock = Clock()
    log = RefusalLog(60.0, logging.getLogger("hora.test"), clock)
    with caplog.at_level(logging.WARNING, logger="hora.test"):
        for i in range(5 * MAX_KINDS):
            log.refused(("10.0.0.1", i), "refused")
    assert len(log) <= MAX_KINDS
    assert len(caplog.records) == 5 * MAX_KINDS  # every new kind still gets its line
