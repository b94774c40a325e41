"""Coordinator settings: the one place its configuration is read.

Flags win over the environment; the environment is read once, here. The
token comes from ``--token`` or ``HORA_TOKEN``; when neither is given it is
read from ``--token-file`` if that exists, else a random one is generated at
start (:mod:`.tokens`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

__all__ = ["CommandLine", "CoordinatorSettings", "build_parser", "parse_command_line"]

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Size limits, each with a flag of the same name (--max-jobs, ...).
_LIMITS = (
    "max_jobs",
    "max_members_per_job",
    "max_id_length",
    "max_store_key_bytes",
    "max_store_value_bytes",
    "max_tensor_name_length",
    "max_events_per_job",
    "max_message_bytes",
)
# What a CompareSet carries besides its two values: field tags, lengths, the
# key and the job id (at most 4 bytes a character).
_FRAMING_BYTES = 64


@dataclass(frozen=True)
class CoordinatorSettings:
    """Everything the coordinator needs, with defaults in one place.

    Attributes:
        host: Address both servers bind to.
        grpc_port: gRPC port; 0 picks a free one.
        http_port: HTTP port; 0 picks a free one.
        token: Job token every gRPC call must carry; empty means "generate one".
            Off loopback the REST API wants it too (:mod:`.rest_auth`).
        tls_cert: PEM certificate (chain) both servers present; with ``tls_key``
            they serve TLS, without both plaintext.
        tls_key: PEM private key of ``tls_cert``.
        lease: How long a member stays alive without a heartbeat or stream message
            while the coordinator is lightly loaded: the shortest lease. Leases
            grow with the load (see ``heartbeat_budget``).
        heartbeat_interval: How often members renew their lease while the
            coordinator is lightly loaded (at most a quarter of ``lease``).
        heartbeat_budget: Heartbeats per second all members together may send.
            When the members' heartbeats at ``heartbeat_interval`` would pass
            it, intervals and leases grow so that they do not (shared between
            jobs max-min fairly: small jobs keep the shortest lease); see
            :mod:`.state.leases`.
        stall_check_interval: Period of the background check for expired leases
            and stalled tensors; a lost member is noticed at most this long
            after its lease ran out.
        job_retention: How long a job that finished or failed stays (in the
            API, the metrics and memory) once nothing of it is left running;
            a long-lived coordinator would otherwise keep every job for ever.
        refusal_log_interval: At most one log line per kind of refused call
            (missing token, wrong token, undecodable bytes) per interval; the
            next line counts the ones left out. 0 logs every refusal.
        max_jobs: Most jobs held at once; a Join that would start one more is
            RESOURCE_EXHAUSTED (finished jobs count until ``job_retention`` drops them).
        max_members_per_job: Largest world (expected, min or max size) a Join may
            ask for, and most joiners a round holds.
        max_id_length: Longest job id and worker id, in characters.
        max_store_key_bytes: Longest store key, in UTF-8 bytes.
        max_store_value_bytes: Largest store value, in bytes.
        max_tensor_name_length: Longest tensor name in a negotiation request, in
            characters; a longer one fails that request only (an ERROR response
            of kind INVALID), the stream and the job go on.
        max_events_per_job: Events a job's log keeps; the oldest are dropped
            first, and the job counts how many were (``events_dropped``).
        max_message_bytes: Largest gRPC message the coordinator receives
            (gRPC's own max receive message length); a larger one is refused
            with RESOURCE_EXHAUSTED before any handler runs. Must leave room
            for a CompareSet of two values of ``max_store_value_bytes``.
        log_level: Name of a :mod:`logging` level.
        state_dir: Where the journal lives (SQLite in WAL mode); None keeps no
            journal, and a restart then rebuilds running jobs from their
            members' reports alone.
    """

    host: str = "127.0.0.1"
    grpc_port: int = 0
    http_port: int = 0
    token: str = ""
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # A stopped worker (or a host gone without closing its sockets) is noticed
    # within lease + stall_check_interval: under 3 s while load allows.
    lease: timedelta = timedelta(seconds=2)
    heartbeat_interval: timedelta = timedelta(milliseconds=500)
    # About 0.1 ms of coordinator CPU each (bench/README.md): a fifth of a core.
    heartbeat_budget: float = 2000.0
    stall_check_interval: timedelta = timedelta(milliseconds=250)
    job_retention: timedelta = timedelta(hours=1)
    refusal_log_interval: timedelta = timedelta(seconds=10)
    max_jobs: int = 10_000
    max_members_per_job: int = 65_536
    max_id_length: int = 256
    max_store_key_bytes: int = 4096
    max_store_value_bytes: int = 1024 * 1024
    max_tensor_name_length: int = 4096
    max_events_per_job: int = 10_000
    max_message_bytes: int = 4 * 1024 * 1024
    log_level: str = "INFO"
    state_dir: Path | None = None
    # Test only (hidden flag --test-die-after-list; 0, the default, is off): exit
    # the process right after writing the global set's response list of this
    # number to rank 0's stream, never to the others' (issue 28's fault injection).
    test_die_after_list: int = 0

    def __post_init__(self) -> None:
        for name in ("grpc_port", "http_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {port}")
        for name in ("lease", "heartbeat_interval", "stall_check_interval"):
            if getattr(self, name) <= timedelta(0):
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.heartbeat_budget > 0:
            raise ValueError(f"heartbeat_budget must be positive, got {self.heartbeat_budget}")
        for name in ("job_retention", "refusal_log_interval"):
            if getattr(self, name) < timedelta(0):
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        for name in _LIMITS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(
                "--tls-cert and --tls-key go together: give both, or neither for plaintext"
            )
        needed = (2 * self.max_store_value_bytes + self.max_store_key_bytes
                  + 4 * self.max_id_length + _FRAMING_BYTES)
        if self.max_message_bytes < needed:
            raise ValueError(
                f"max_message_bytes {self.max_message_bytes} is too small for a store "
                f"CompareSet of two values of max_store_value_bytes "
                f"{self.max_store_value_bytes}: it needs at least {needed}"
            )
        if self.log_level.upper() not in _LOG_LEVELS:
            raise ValueError(
                f"log_level must be one of {', '.join(_LOG_LEVELS)}, got {self.log_level!r}"
            )

    @property
    def tls(self) -> bool:
        """Whether both servers serve TLS."""
        return self.tls_cert is not None

    def with_token(self) -> CoordinatorSettings:
        """These settings, with a fresh random token when none was given."""
        if self.token:
            return self
        return dataclasses.replace(self, token=secrets.token_hex(16))


@dataclass(frozen=True)
class CommandLine:
    """What ``hora-coordinator`` was asked to do.

    Attributes:
        settings: The coordinator's settings.
        ready_file: Where to write the ready JSON once serving, if anywhere.
        token_file: Where the token is kept (mode 0600), if anywhere: read at
            start when no token is given and it exists, else written
            (:func:`.tokens.resolve_token`).
    """

    settings: CoordinatorSettings
    ready_file: Path | None
    token_file: Path | None = None


def build_parser() -> argparse.ArgumentParser:
    """The ``hora-coordinator`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="hora-coordinator",
        description="Serve hora's rendezvous, store and negotiation (gRPC) and job state (HTTP).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    parser.add_argument("--grpc-port", type=int, default=0, help="gRPC port, 0 for a free one")
    parser.add_argument("--http-port", type=int, default=0, help="HTTP port, 0 for a free one")
    parser.add_argument(
        "--token",
        default=None,
        help="job token (default: $HORA_TOKEN, else read from --token-file, else a random "
        "one, printed with how to connect)",
    )
    defaults = CoordinatorSettings()
    parser.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help="keep the token in this file (mode 0600): read when it exists and no token is "
        "given, so a restart keeps the token; written otherwise",
    )
    parser.add_argument(
        "--tls-cert",
        type=Path,
        default=None,
        help="serve gRPC and HTTP over TLS with this PEM certificate (chain); needs --tls-key",
    )
    parser.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    parser.add_argument(
        "--lease-s",
        type=float,
        default=defaults.lease.total_seconds(),
        help="seconds a member lives without a heartbeat while the coordinator is lightly "
        "loaded; longer under load (default %(default)s)",
    )
    parser.add_argument(
        "--heartbeat-interval-s",
        type=float,
        default=defaults.heartbeat_interval.total_seconds(),
        help="seconds between a member's heartbeats while the coordinator is lightly loaded, "
        "at most a quarter of the lease (default %(default)s)",
    )
    parser.add_argument(
        "--heartbeat-budget",
        type=float,
        default=defaults.heartbeat_budget,
        help="heartbeats per second all members together may send; past it intervals and "
        "leases grow (default %(default)s)",
    )
    parser.add_argument(
        "--stall-check-interval-s",
        type=float,
        default=defaults.stall_check_interval.total_seconds(),
        help="seconds between lease and stall checks (default %(default)s)",
    )
    parser.add_argument(
        "--job-retention-s",
        type=float,
        default=3600.0,
        help="seconds a finished or failed job stays listed once none of its workers "
        "is left (default %(default)s)",
    )
    parser.add_argument(
        "--refusal-log-interval-s",
        type=float,
        default=10.0,
        help="at most one log line per kind of refused call per this many seconds; "
        "the next line counts the ones left out (default %(default)s)",
    )
    for name in _LIMITS:
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            default=getattr(defaults, name),
            help=f"limit: {name.replace('_', ' ')} (default %(default)s)",
        )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="keep a journal of jobs, generations, events and store keys here "
        "(SQLite, WAL), so that a restarted coordinator resumes them "
        "(default: $HORA_STATE_DIR, else none)",
    )
    # Test-only fault injection, off by default and left out of --help.
    parser.add_argument("--test-die-after-list", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--ready-file",
        type=Path,
        default=None,
        help="write {grpc_port, http_port, pid, token} as JSON here once serving",
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=_LOG_LEVELS,
        default=None,
        help="logging level (default: $HORA_LOG_LEVEL, else INFO)",
    )
    return parser


def parse_command_line(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> CommandLine:
    """Parses flags, falling back to ``HORA_TOKEN`` and ``HORA_LOG_LEVEL``.

    Bad values end in argparse's usage error (exit status 2), never a traceback.
    """
    env = os.environ if environ is None else environ
    parser = build_parser()
    args = parser.parse_args(argv)
    log_level = args.log_level or env.get("HORA_LOG_LEVEL", "").upper() or "INFO"
    try:
        settings = CoordinatorSettings(
            host=args.host,
            grpc_port=args.grpc_port,
            http_port=args.http_port,
            token=args.token if args.token is not None else env.get("HORA_TOKEN", ""),
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            lease=timedelta(seconds=args.lease_s),
            heartbeat_interval=timedelta(seconds=args.heartbeat_interval_s),
            heartbeat_budget=args.heartbeat_budget,
            stall_check_interval=timedelta(seconds=args.stall_check_interval_s),
            job_retention=timedelta(seconds=args.job_retention_s),
            refusal_log_interval=timedelta(seconds=args.refusal_log_interval_s),
            **{name: getattr(args, name) for name in _LIMITS},
            log_level=log_level,
            state_dir=args.state_dir or (Path(env["HORA_STATE_DIR"])
                                         if env.get("HORA_STATE_DIR") else None),
            test_die_after_list=args.test_die_after_list,
        )
    except ValueError as exc:
        parser.error(str(exc))
    return CommandLine(settings=settings, ready_file=args.ready_file, token_file=args.token_file)
