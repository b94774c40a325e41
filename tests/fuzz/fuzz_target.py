"""The coordinator a fuzz module attacks, and what must hold once it has.

Each fuzz module gets its own real coordinator process (``fuzz_target``
fixture). After the fuzzing, :meth:`FuzzTarget.assert_survived` checks that
it still answers ``/readyz``, that a fresh 2-rank job trains on it (real
workers through ``horarun --coordinator``), that its RSS grew by less than
:data:`RSS_GROWTH_LIMIT_KIB`, and that its log holds no traceback.

The coordinator runs with small limits, so that the fuzzers reach every
refusal quickly (a size above 64 is refused at once instead of waiting to
gather), and short leases and retention, so that the jobs the fuzzers leave
behind are lost and forgotten as they would be in a long-lived coordinator.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import httpx
from hypothesis import HealthCheck, settings
from support.coordinator import CoordinatorProcess

__all__ = [
    "ALLOWED_CODES",
    "DETAILS_LIMIT",
    "FUZZ_FLAGS",
    "RESPONSE_ERROR_LIMIT",
    "RSS_GROWTH_LIMIT_KIB",
    "FuzzTarget",
    "assert_refusal_ok",
    "fuzz_settings",
]

FUZZ_FLAGS = (
    "--lease-s", "3",
    "--stall-check-interval-s", "0.5",
    "--job-retention-s", "2",
    "--max-jobs", "2000",
    "--max-members-per-job", "64",
    "--max-id-length", "256",
    "--max-store-key-bytes", "1024",
    "--max-store-value-bytes", "65536",
    "--max-tensor-name-length", "256",
    "--max-events-per-job", "100",
    "--max-message-bytes", "262144",
    # Every wrong token is checked and refused as such: the fuzzers mix wrong and right
    # tokens on one channel, and the wrong-token slow-down (tested in tests/security)
    # would refuse the right ones unchecked for a while.
    "--guess-burst", "0",
)

#: How much the coordinator's resident memory may grow over one fuzz module
#: (about 8 MiB after the gRPC fuzzers, 1.5 MiB after the API fuzzer when
#: written). Every job the fuzzers make is small (64 members, 64 KiB store
#: values at most) and forgotten within seconds; what stays is the
#: allocator's high water mark. Something kept per call (a future, an
#: outbox, a store, a 256 KiB message) over the thousands of calls would pass it.
RSS_GROWTH_LIMIT_KIB = 32 * 1024

#: Status codes a refused call may end with. UNKNOWN and INTERNAL (a
#: handler raised something unplanned), UNAVAILABLE (the process died) and
#: UNIMPLEMENTED (a method of the contract nobody serves) are defects.
ALLOWED_CODES = frozenset({
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAUTHENTICATED,
})

#: Longest status details a refusal may carry. gRPC sends them in a trailer,
#: and a trailer past the caller's metadata limit (16 KiB by default) turns the
#: refusal into RESOURCE_EXHAUSTED "received metadata size exceeds hard
#: limit": the caller learns nothing of what was wrong with its call. The
#: coordinator's own texts are short; only quoted input could grow them.
DETAILS_LIMIT = 4096
#: Longest error text in a response on a negotiation stream, however many
#: ranks sent however long a request: each rank gets it, on every error.
RESPONSE_ERROR_LIMIT = 16 * 1024

# What the coordinator's log must not show: Python tracebacks, gRPC's own
# "Unexpected error" for a handler that raised, asyncio's lost exceptions.
_LOG_DEFECTS = ("Traceback", "Unexpected error", "Exception in callback",
                "exception was never retrieved")

_TRAIN = Path(__file__).with_name("train_tiny.py")


def assert_refusal_ok(code: grpc.StatusCode, details: str, call: object) -> None:
    """A call ended OK or with a planned refusal whose details reach the caller whole."""
    assert code in ALLOWED_CODES, (code, details, call)
    assert len(details) <= DETAILS_LIMIT, (code, len(details), details[:300], call)
    assert "metadata size" not in details, (code, details, call)


def fuzz_settings(max_examples: int) -> settings:
    """Hypothesis settings for a bounded, reproducible fuzz run."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.function_scoped_fixture,
                               HealthCheck.filter_too_much],
    )


def rss_kib(pid: int) -> int:
    """Resident memory of ``pid`` in KiB (VmRSS of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


class FuzzTarget:
    """A running coordinator and its resident memory before the fuzzing."""

    def __init__(self, proc: CoordinatorProcess) -> None:
        self.proc = proc
        self._warm_up()
        self.baseline_kib = rss_kib(proc.pid)

    def _warm_up(self) -> None:
        # Lazy imports and first-call allocations are not growth.
        with httpx.Client(base_url=self.proc.http_url, timeout=10) as http:
            for path in ("/readyz", "/metrics", "/api/v1/jobs", "/openapi.json"):
                http.get(path)

    def log_defects(self) -> list[str]:
        """Lines of the log that show a defect (with their neighbours)."""
        lines = self.proc.log().splitlines()
        return [
            "\n".join(lines[max(0, i - 2):i + 12])
            for i, line in enumerate(lines)
            if any(d in line for d in _LOG_DEFECTS)
        ]

    def assert_survived(self, tmp_path: Path) -> None:
        """The coordinator serves, trains a fresh job, stayed small and logged no traceback."""
        proc = self.proc
        assert proc.running(), f"the coordinator died:\n{proc.log()[-5000:]}"
        ready = httpx.get(f"{proc.http_url}/readyz", timeout=10)
        assert ready.status_code == 200, ready.text
        self.assert_trains(tmp_path)
        grown = rss_kib(proc.pid) - self.baseline_kib
        assert grown < RSS_GROWTH_LIMIT_KIB, (
            f"RSS grew by {grown} KiB (limit {RSS_GROWTH_LIMIT_KIB} KiB)"
        )
        defects = self.log_defects()
        assert not defects, "\n---\n".join(defects[:5])

    def assert_trains(self, tmp_path: Path) -> None:
        """A fresh 2-rank job trains a few steps on this coordinator (horarun --coordinator)."""
        job = f"after-fuzz-{uuid.uuid4().hex[:8]}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        began = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "hora.runner.launch", "--coordinator",
             self.proc.grpc_address, "--token", self.proc.token, "--job-id", job,
             "-np", "2", sys.executable, str(_TRAIN)],
            capture_output=True, text=True, timeout=90, env=env, cwd=tmp_path,
        )
        took = time.monotonic() - began
        assert result.returncode == 0, (
            f"training failed (exit {result.returncode}, {took:.1f} s):\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
        for rank in (0, 1):
            assert f"[{rank}]<stdout>:trained rank {rank} of 2" in result.stdout, result.stdout
