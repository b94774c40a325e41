"""Asking a coordinator's HTTP API from inside a test's network namespace.

:data:`PROBE` runs there (``python -c PROBE URL CASES``): one GET per case
(``name: [path, headers, cookies]``), printed as JSON with the status, the
body and the headers the auth tests read. :func:`run_inside` runs a Python
program in the namespace and returns what it printed.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

__all__ = ["PROBE", "run_inside"]

PROBE = textwrap.dedent("""
    import json, sys
    import httpx
    url, cases = sys.argv[1], json.loads(sys.argv[2])
    out = {}
    for name, (path, headers, cookies) in cases.items():
        with httpx.Client(base_url=url, timeout=10, cookies=cookies) as client:
            answer = client.get(path, headers=headers)
        out[name] = {"status": answer.status_code, "body": answer.text,
                     "www": answer.headers.get("www-authenticate", ""),
                     "set_cookie": answer.headers.get("set-cookie", ""),
                     "location": answer.headers.get("location", "")}
    print(json.dumps(out))
""")


def run_inside(netns: Any, *argv: str, timeout: float = 60.0) -> str:
    """Runs ``python ARGV`` inside ``netns``; its stdout (the test fails on a non-zero exit)."""
    done = subprocess.run([*netns.prefix, sys.executable, *argv], capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
