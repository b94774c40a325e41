"""``hora-coordinator``: run the coordinator as its own process.

Exit status: 0 after SIGTERM/SIGINT, 1 when it cannot start (a port in use,
an unusable TLS or token file), 2 for bad flags (argparse's usage error).

A token it made up is printed on stderr once serving, with how to connect
(:func:`.tokens.connect_help`); a given one never is.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

# gRPC core logs every failed TLS handshake at INFO, which absl prints when
# GRPC_VERBOSITY is unset: one line per stranger's connection (issue 25). Its
# errors still show; set GRPC_VERBOSITY to see more. Read when gRPC starts.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from hora_proto.auth import job_token  # noqa: E402

from .connections import raise_open_file_limit  # noqa: E402
from .server import ServingInfo, serve  # noqa: E402
from .settings import CommandLine, parse_command_line  # noqa: E402
from .tokens import (  # noqa: E402
    TokenFileError,
    TokenSource,
    WeakTokenError,
    check_strength,
    connect_help,
    resolve_token,
)

__all__ = ["main", "write_ready_file"]

logger = logging.getLogger("hora_coordinator")


def write_ready_file(path: Path, info: ServingInfo) -> None:
    """Writes ``{grpc_port, http_port, pid, token}`` as JSON, atomically.

    A reader polling for ``path`` never sees a half-written file: the JSON
    goes to a temporary file in the same folder, which is then renamed.
    """
    payload = {
        "grpc_port": info.grpc_port,
        "http_port": info.http_port,
        "pid": info.pid,
        "token": info.token,
        "host": info.host,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def print_job_token(command: CommandLine, job_id: str) -> int:
    """Prints the token of job ``job_id`` (``--print-job-token``): it opens that job
    only, and is what its workers should get. Never makes an admin token up."""
    token = command.settings.token
    if not token and command.token_file is not None and command.token_file.exists():
        try:
            token = resolve_token(command.settings, command.token_file).settings.token
        except TokenFileError as exc:
            logger.error("hora-coordinator: %s", exc)
            return 1
    if not token:
        logger.error("hora-coordinator: --print-job-token needs the coordinator's token: "
                     "--token, $HORA_TOKEN or an existing --token-file")
        return 1
    print(job_token(token, job_id))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the coordinator until SIGTERM or SIGINT; the exit status."""
    command = parse_command_line(argv)
    logging.basicConfig(
        level=command.settings.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if command.print_job_token is not None:
        return print_job_token(command, command.print_job_token)
    try:
        resolved = resolve_token(command.settings, command.token_file)
        weak = check_strength(resolved.settings)
    except (TokenFileError, WeakTokenError) as exc:
        logger.error("hora-coordinator: %s", exc)
        return 1
    if weak is not None:
        logger.warning("hora-coordinator: %s", weak)
    settings = resolved.settings
    if resolved.source is TokenSource.FILE:
        logger.info("hora-coordinator: job token read from --token-file %s", command.token_file)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

        def ready(info: ServingInfo) -> None:
            if resolved.source is TokenSource.MADE_UP:
                help_text = connect_help(
                    info.host,
                    info.grpc_port,
                    info.http_port,
                    info.token,
                    info.tls,
                    command.token_file,
                )
                print(help_text, file=sys.stderr, flush=True)
            if command.ready_file is not None:
                write_ready_file(command.ready_file, info)

        await serve(settings, ready, stop)

    # Headroom for connections (the caps in .connections bound them, not this).
    raise_open_file_limit()
    try:
        asyncio.run(run())
    except RuntimeError as exc:
        logger.error("hora-coordinator: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
