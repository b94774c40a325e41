"""A script failing out of ``hvd.elastic.run``: the retry loop says so, and an
uncaught failure ends the process at once, without a graceful leave."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from hora.elastic import ObjectState, run_fn
from hora.errors import HorovodInternalError, HostsUpdatedInterrupt

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_only_a_failure_that_leaves_the_loop_is_reported() -> None:
    failures: list[str] = []
    resets: list[str] = []
    state = ObjectState(bcast_object=lambda obj: obj, get_rank=lambda: 0, epoch=0)
    raised = iter([HostsUpdatedInterrupt(skip_sync=True), HorovodInternalError("peer"),
                   RuntimeError("the script's own bug")])

    def train(state: ObjectState) -> None:
        raise next(raised)

    wrapped = run_fn(train, lambda: resets.append("reset"),
                     on_failure=lambda: failures.append("failed"))
    with pytest.raises(RuntimeError, match="the script's own bug"):
        wrapped(state)
    assert resets == ["reset", "reset"] and failures == ["failed"]


def test_the_reset_limit_is_the_jobs_checked_after_re_joining() -> None:
    generation = [3]  # the world this worker joined had been reset twice already
    state = ObjectState(bcast_object=lambda obj: obj, get_rank=lambda: 0, epoch=0)
    calls: list[int] = []

    def train(state: ObjectState) -> None:
        calls.append(generation[0])
        raise HostsUpdatedInterrupt(skip_sync=False)

    def reset() -> None:
        generation[0] += 1

    wrapped = run_fn(train, reset, reset_limit=lambda: 3,
                     job_resets=lambda: generation[0] - 1)
    with pytest.raises(HorovodInternalError, match="reset limit 3 exceeded: the job has "
                                                   "been reset 4 times"):
        wrapped(state)
    # Trained in generations 3 and 4 (2 and 3 resets); generation 5 is beyond the limit.
    assert calls == [3, 4]


SCRIPT = """
    import atexit, sys
    from hora import _runtime
    atexit.register(lambda: print("atexit ran", flush=True))
    _runtime.abandon()
    if sys.argv[1] == "caught":
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            print("caught", flush=True)
    else:
        raise RuntimeError("boom")
"""


@pytest.mark.parametrize("how, code", [("uncaught", 1), ("caught", 0)])
def test_an_uncaught_failure_exits_at_once_and_a_caught_one_does_not(how: str,
                                                                     code: int) -> None:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), how],
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == code, proc.stderr
    if how == "uncaught":
        # The traceback as always, then no teardown (no atexit handler, no Leave).
        assert "RuntimeError: boom" in proc.stderr
        assert "atexit ran" not in proc.stdout
    else:
        assert proc.stdout.splitlines() == ["caught", "atexit ran"]
