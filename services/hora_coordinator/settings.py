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
    "max_store_keys_per_job",
    "max_store_bytes_per_job",
    "max_stream_queue",
    "max_live_streams",
    "max_http_connections",
    "max_http_connections_per_address",
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
        max_store_keys_per_job: Most keys one job's store holds; a write of one
            more is RESOURCE_EXHAUSTED.
        max_store_bytes_per_job: Most bytes (keys and values) one job's store holds.
        max_stream_queue: Most messages waiting to be sent on one negotiation
            stream; a client that reads none of them (its stream stays full) is
            dropped, not buffered for without end.
        max_live_streams: Most live (server-sent events) streams at once; one
            more is 503. Streams of one kind share one computation per tick.
        max_http_connections: Most HTTP connections open at once; one more is
            closed as it is accepted.
        max_http_connections_per_address: Most HTTP connections open at once from
            one client address.
        max_grpc_connections: Most gRPC connections open at once (gRPC's own
            ``grpc.max_allowed_incoming_connections``); 0 sizes it to the open-file
            limit, less the HTTP connections and a reserve for the process itself.
        header_timeout: An HTTP connection that has not sent a whole request head
            this long after it opened (or after its last response) is closed; also
            the TLS and HTTP/2 handshake deadline of both servers.
        grpc_idle_timeout: A gRPC connection with no call for this long is closed
            (``grpc.max_connection_idle_ms``; clients reconnect by themselves).
        log_level: Name of a :mod:`logging` level.
        state_dir: Where the journal lives (SQLite in WAL mode); None keeps no
            journal, and a restart then rebuilds running jobs from their
            members' reports alone.
        guess_burst: Wrong tokens one client address may send before it is
            slowed down (:mod:`.guessing`); 0 never slows anyone.
        guess_rate: Wrong tokens per second it may send once slowed down.
        allow_weak_token: Serve off loopback with a token of under 128 bits
            (:func:`.tokens.check_strength`); on loopback a weak one only warns.
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
    # Gloo's bootstrap keeps a few keys per rank: room for the largest world.
    max_store_keys_per_job: int = 4 * 65_536
    max_store_bytes_per_job: int = 64 * 1024 * 1024
    max_stream_queue: int = 10_000
    max_live_streams: int = 32
    max_http_connections: int = 256
    max_http_connections_per_address: int = 32
    max_grpc_connections: int = 0
    header_timeout: timedelta = timedelta(seconds=10)
    grpc_idle_timeout: timedelta = timedelta(minutes=5)
    log_level: str = "INFO"
    state_dir: Path | None = None
    guess_burst: int = 500
    guess_rate: float = 5.0
    allow_weak_token: bool = False
    # Test only (hidden flag --test-die-after-list; 0, the default, is off): exit
    # the process right after writing the global set's response list of this
    # number to rank 0's stream, never to the others' (issue 28's fault injection).
    test_die_after_list: int = 0

    def __post_init__(self) -> None:
        for name in ("grpc_port", "http_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {port}")
        if self.max_grpc_connections < 0:
            raise ValueError(
                f"max_grpc_connections must not be negative, got {self.max_grpc_connections}")
        for name in ("lease", "heartbeat_interval", "stall_check_interval", "header_timeout",
                     "grpc_idle_timeout"):
            if getattr(self, name) <= timedelta(0):
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.guess_burst < 0 or not self.guess_rate > 0:
            raise ValueError(f"guess_burst must not be negative ({self.guess_burst}) and "
                             f"guess_rate must be positive ({self.guess_rate})")
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
        print_job_token: Print this job's token (derived from the admin token) and exit.
    """

    settings: CoordinatorSettings
    ready_file: Path | None
    token_file: Path | None = None
    print_job_token: str | None = None


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
    parser.add_argument(
        "--max-grpc-connections",
        type=int,
        default=defaults.max_grpc_connections,
        help="most gRPC connections open at once; 0 sizes it to the open-file limit "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--header-timeout-s",
        type=float,
        default=defaults.header_timeout.total_seconds(),
        help="seconds an HTTP connection may take to send a request head, and the TLS "
        "and HTTP/2 handshake deadline (default %(default)s)",
    )
    parser.add_argument(
        "--grpc-idle-timeout-s",
        type=float,
        default=defaults.grpc_idle_timeout.total_seconds(),
        help="seconds a gRPC connection without calls stays open (default %(default)s)",
    )
    for name in _LIMITS:
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            default=getattr(defaults, name),
            help=f"limit: {name.replace('_', ' ')} (default %(default)s)",
        )
    parser.add_argument(
        "--guess-burst", type=int, default=defaults.guess_burst,
        help="wrong tokens one address may send before its new connections are refused "
        "for a while; 0: never (default %(default)s)")
    parser.add_argument(
        "--guess-rate", type=float, default=defaults.guess_rate,
        help="wrong tokens per second an address may send past --guess-burst "
        "(default %(default)s)")
    parser.add_argument(
        "--print-job-token", metavar="JOB_ID", default=None,
        help="print the token of job JOB_ID (it opens that job only: give it to the job's "
        "workers) from --token, $HORA_TOKEN or --token-file, and exit")
    parser.add_argument(
        "--allow-weak-token", action="store_true",
        help="serve off loopback even with a token of under 128 bits (refused otherwise)")
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
            max_grpc_connections=args.max_grpc_connections,
            header_timeout=timedelta(seconds=args.header_timeout_s),
            grpc_idle_timeout=timedelta(seconds=args.grpc_idle_timeout_s),
            log_level=log_level,
            guess_burst=args.guess_burst,
            guess_rate=args.guess_rate,
            allow_weak_token=args.allow_weak_token,
            state_dir=args.state_dir or (Path(env["HORA_STATE_DIR"])
                                         if env.get("HORA_STATE_DIR") else None),
            test_die_after_list=args.test_die_after_list,
        )
    except ValueError as exc:
        parser.error(str(exc))
    return CommandLine(settings=settings, ready_file=args.ready_file, token_file=args.token_file,
                       print_job_token=args.print_job_token)
