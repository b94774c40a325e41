"""The job dashboard: two HTML pages and the files they load, served by the coordinator.

``GET /`` is the jobs list, ``GET /jobs/{job_id}`` one job's page. Both are
static files: the page's script reads the job id from its own URL and every
figure from the REST API and its server-sent events (:mod:`..http`,
:mod:`..http_telemetry`), so nothing on the page is made up in the browser
and nothing about a job is written into the HTML by the server.

Everything the pages load ships inside this package (``static/``: plain
JavaScript, CSS and an SVG icon, no build step, charts drawn as inline SVG)
and is served by :data:`router` under ``/static/``: nothing is fetched from
elsewhere at run time, and the pages' Content-Security-Policy says so to
the browser too. Off loopback the token guard (:mod:`..rest_auth`) covers
these paths like every other.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import Final

from fastapi import APIRouter, HTTPException
from fastapi.responses import Response

__all__ = ["PAGE_HEADERS", "STATIC_PREFIX", "router"]

#: Where the pages' scripts, styles and icon are served.
STATIC_PREFIX: Final = "/static"

_TYPES: Final = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".html": "text/html; charset=utf-8",
}

#: Headers of the HTML pages: only this origin's files, no inline script, no
#: frames, and no Referer that could carry a ``?token=`` elsewhere.
PAGE_HEADERS: Final = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Revalidated on every load: a coordinator upgraded in place serves its new page.
    "Cache-Control": "no-cache",
}


@dataclass(frozen=True)
class _File:
    body: bytes
    media_type: str


def _load() -> dict[str, _File]:
    """The package's static files by name, read once (a few tens of kB)."""
    files: dict[str, _File] = {}
    for entry in resources.files(__package__).joinpath("static").iterdir():
        suffix = entry.name[entry.name.rfind("."):]
        if entry.is_file() and suffix in _TYPES:
            files[entry.name] = _File(entry.read_bytes(), _TYPES[suffix])
    return files


_FILES: Final = _load()

router = APIRouter(tags=["dashboard"], include_in_schema=False)


def _send(name: str, headers: dict[str, str] | None = None) -> Response:
    item = _FILES.get(name)
    if item is None:
        raise HTTPException(status_code=404, detail="no such dashboard file")
    return Response(item.body, media_type=item.media_type,
                    headers=headers or {"Cache-Control": "no-cache",
                                        "X-Content-Type-Options": "nosniff"})


@router.get("/", response_class=Response)
async def jobs_page() -> Response:
    """The jobs list (HTML)."""
    return _send("index.html", PAGE_HEADERS)


@router.get("/jobs/{job_id}", response_class=Response)
async def job_page(job_id: str) -> Response:
    """One job's page (HTML). The same file for every job, also one not (yet) known:
    ``horarun`` prints the URL before the workers join, and the page waits for the job."""
    del job_id  # the page's script reads it from its URL
    return _send("job.html", PAGE_HEADERS)


@router.get(STATIC_PREFIX + "/{name}", response_class=Response)
async def static_file(name: str) -> Response:
    """A script, style sheet or icon of the pages."""
    if name.endswith(".html"):
        raise HTTPException(status_code=404, detail="no such dashboard file")
    return _send(name)
