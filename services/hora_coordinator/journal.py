"""The coordinator's journal: what a restarted coordinator resumes from.

With ``--state-dir`` the coordinator writes, before it acknowledges them,
every job's record (phase, generation, members, elastic bounds, the process
sets of the negotiation table, counters), every event and every store key.
A coordinator started on the same state dir loads them: running jobs come
back with their members, whose leases start again at the restart, and the
members re-attach (:mod:`.state.restore`). What is in flight is not kept:
tensors waiting for negotiation are sent again by the workers when they
re-attach, and Joins and process set calls are retried by their callers.

:class:`Journal` is the interface; :class:`SqliteJournal` keeps it in SQLite
in WAL mode (one file, ``coordinator.db``), and a distributed store (etcd)
could implement the same five methods. With ``synchronous=NORMAL`` a commit
survives a crash of the process (kill -9), which is the failure the journal
is for; a power cut may lose the newest commits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sqlite3
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hora_negotiation import NegotiationTable

from . import state

__all__ = [
    "NO_JOURNAL",
    "Journal",
    "Restored",
    "SqliteJournal",
    "job_from_record",
    "job_record",
    "open_journal",
]

logger = logging.getLogger("hora_coordinator")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (job_id TEXT PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    job_id TEXT NOT NULL, seq INTEGER NOT NULL, event TEXT NOT NULL,
    PRIMARY KEY (job_id, seq));
CREATE TABLE IF NOT EXISTS store (
    job_id TEXT NOT NULL, key TEXT NOT NULL, value BLOB NOT NULL,
    PRIMARY KEY (job_id, key));
"""


@dataclass
class Restored:
    """What a journal held: jobs (with their events) and their stores."""

    jobs: list[state.Job] = field(default_factory=list)
    stores: dict[str, dict[str, bytes]] = field(default_factory=dict)


class Journal(Protocol):
    """Where the coordinator writes what must outlive it."""

    def load(self, now: float, max_events: int = state.EVENT_LOG_LIMIT) -> Restored:
        """Every job and store kept; members' leases start at ``now``, and each
        job's log keeps its last ``max_events`` events."""
        ...

    def save_job(self, job: state.Job, new_events: Iterable[state.JobEvent]) -> None:
        """Writes the job's record and appends its events recorded since the last save."""
        ...

    def store_write(self, job_id: str, key: str, value: bytes | None) -> None:
        """Sets (or, with None, deletes) one store key."""
        ...

    def forget(self, job_id: str) -> None:
        """Drops everything kept of a job."""
        ...

    def close(self) -> None: ...


class _NoJournal:
    """Keeps nothing (no ``--state-dir``)."""

    def load(self, now: float, max_events: int = state.EVENT_LOG_LIMIT) -> Restored:
        return Restored()

    def save_job(self, job: state.Job, new_events: Iterable[state.JobEvent]) -> None:
        pass

    def store_write(self, job_id: str, key: str, value: bytes | None) -> None:
        pass

    def forget(self, job_id: str) -> None:
        pass

    def close(self) -> None:
        pass


NO_JOURNAL: Journal = _NoJournal()


class SqliteJournal:
    """The journal in ``state_dir/coordinator.db`` (SQLite, WAL).

    Each write is its own transaction, committed before the call returns.
    """

    def __init__(self, state_dir: Path) -> None:
        private_dir(state_dir)
        self.path = state_dir / "coordinator.db"
        private_files(self.path)
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def load(self, now: float, max_events: int = state.EVENT_LOG_LIMIT) -> Restored:
        restored = Restored()
        events: dict[str, list[state.JobEvent]] = {}
        for job_id, text in self._db.execute("SELECT job_id, event FROM events ORDER BY seq"):
            events.setdefault(job_id, []).append(state.JobEvent(**json.loads(text)))
        for (text,) in self._db.execute("SELECT record FROM jobs"):
            job = job_from_record(json.loads(text), now, max_events)
            job.events.extend(events.get(job.job_id, ()))
            restored.jobs.append(job)
        for job_id, key, value in self._db.execute("SELECT job_id, key, value FROM store"):
            restored.stores.setdefault(job_id, {})[key] = bytes(value)
        return restored

    def save_job(self, job: state.Job, new_events: Iterable[state.JobEvent]) -> None:
        rows = [
            (job.job_id, job.event_count - i, json.dumps(dataclasses.asdict(e)))
            for i, e in enumerate(reversed(list(new_events)))
        ]
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT OR REPLACE INTO jobs (job_id, record) VALUES (?, ?)",
                (job.job_id, json.dumps(job_record(job))),
            )
            self._db.executemany(
                "INSERT OR REPLACE INTO events (job_id, seq, event) VALUES (?, ?, ?)", rows
            )
            # The log is bounded like the job's own: the oldest go first.
            self._db.execute(
                "DELETE FROM events WHERE job_id = ? AND seq <= ?",
                (job.job_id, job.event_count - (job.events.maxlen or state.EVENT_LOG_LIMIT)),
            )

    def store_write(self, job_id: str, key: str, value: bytes | None) -> None:
        if value is None:
            self._db.execute("DELETE FROM store WHERE job_id = ? AND key = ?", (job_id, key))
        else:
            self._db.execute(
                "INSERT OR REPLACE INTO store (job_id, key, value) VALUES (?, ?, ?)",
                (job_id, key, value),
            )

    def forget(self, job_id: str) -> None:
        with self._db:
            self._db.execute("BEGIN")
            for table in ("jobs", "events", "store"):
                self._db.execute(f"DELETE FROM {table} WHERE job_id = ?", (job_id,))

    def close(self) -> None:
        self._db.close()


# ---- the job record ------------------------------------------------------------------

_MEMBER_FIELDS = (
    "rank", "worker_id", "host", "pid", "data_plane_address", "local_rank", "local_size",
    "cross_rank", "cross_size", "cause", "rejoin",
)
_COUNTERS = (
    "arrivals", "negotiated_tensors", "errors", "negotiation_messages", "reset_count",
    "host_update_epoch", "generation_host_epoch", "removals_only", "event_count", "history_restarted", "events_dropped",
    "is_homogeneous", "generation", "failure", "created_at",
)


def job_record(job: state.Job) -> dict[str, Any]:
    """What the journal keeps of ``job`` (JSON-able); not its event log or store."""
    return {
        "job_id": job.job_id,
        "phase": job.phase.value,
        "config": dataclasses.asdict(job.config) if job.config is not None else None,
        "elastic": dataclasses.asdict(job.elastic) if job.elastic is not None else None,
        "members": [
            {**{name: getattr(m, name) for name in _MEMBER_FIELDS}, "state": m.state.value}
            for m in job.members
        ],
        "process_sets": {
            str(set_id): list(members.ranks)
            for set_id, members in job.table.process_sets.items()
            if set_id != 0
        },
        **{name: getattr(job, name) for name in _COUNTERS},
    }


def job_from_record(record: dict[str, Any], now: float,
                    max_events: int = state.EVENT_LOG_LIMIT) -> state.Job:
    """The job a record describes, its members' leases starting at ``now``.

    A job that was gathering its next world comes back without the round:
    the joiners' Joins broke with the coordinator and they join again.
    """
    job = state.new_job(record["job_id"], record["created_at"], max_events)
    for name in _COUNTERS:
        if name in record:  # a journal written before the field existed lacks it
            setattr(job, name, record[name])
    job.phase = state.JobPhase(record["phase"])
    if record["config"] is not None:
        job.config = state.JobConfig(**record["config"])
    if record["elastic"] is not None:
        job.elastic = state.ElasticBounds(**record["elastic"])
    job.members = [
        state.Member(
            **{name: m[name] for name in _MEMBER_FIELDS},
            state=state.MemberState(m["state"]),
            last_heartbeat=now,
        )
        for m in record["members"]
    ]
    job.by_worker = {m.worker_id: m for m in job.members}
    if job.config is not None:
        job.table = NegotiationTable(job.config.size, job.config.fusion_threshold_bytes)
        for set_id, ranks in sorted(record["process_sets"].items(), key=lambda i: int(i[0])):
            job.table.add_process_set(int(set_id), ranks)
    return job


def private_dir(path: Path) -> None:
    """Makes ``path`` (and its missing parents) mode 0700, or narrows it to 0700.

    The journal holds hosts, ports and shared-memory prefixes: nobody else reads it.

    Raises:
        PermissionError: it exists, belongs to another user and lets others in.
    """
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        if path.stat().st_uid != os.geteuid():
            raise PermissionError(
                f"--state-dir {path} has mode {mode:04o} and belongs to another user: "
                "others could read the journal; give a directory of your own")
        os.chmod(path, 0o700)
        logger.warning("hora-coordinator: --state-dir %s had mode %04o; now 0700", path, mode)


def private_files(db: Path) -> None:
    """Creates the database ``db`` mode 0600 (SQLite gives its WAL and shared-memory
    files the same), and narrows existing ones to 0600."""
    os.close(os.open(db, os.O_CREAT | os.O_RDWR, 0o600))
    for path in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        with contextlib.suppress(FileNotFoundError):
            if stat.S_IMODE(path.stat().st_mode) & 0o077:
                os.chmod(path, 0o600)


def open_journal(state_dir: Path | None) -> Journal:
    """The journal under ``state_dir``, or :data:`NO_JOURNAL` without one."""
    if state_dir is None:
        return NO_JOURNAL
    started = time.monotonic()
    try:
        journal = SqliteJournal(state_dir)
    except (OSError, sqlite3.Error) as exc:
        raise RuntimeError(f"cannot open the journal in --state-dir {state_dir}: {exc}") from exc
    logger.info("hora-coordinator: journal %s (opened in %.0f ms)", journal.path,
                (time.monotonic() - started) * 1000)
    return journal
