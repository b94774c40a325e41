"""Prints hora's requirements, one per line: its dependencies and those of the given extras.

    python3 deploy/tools/requirements.py pyproject.toml examples [cuda ...]

The image build (deploy/Dockerfile) installs them before it copies any code, and
deploy/tools/wheelhouse.sh downloads them, from this one reading of pyproject.toml.
Extras may also be given comma-separated; an unknown extra is an error.
"""

from __future__ import annotations

import sys

try:
    import tomllib
except ImportError:  # Python 3.10
    raise SystemExit("deploy/tools/requirements.py needs Python 3.11 or later (tomllib)") from None


def requirements(pyproject: str, extras: list[str]) -> list[str]:
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    lines = list(project["dependencies"])
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise SystemExit(f"pyproject.toml has no extra {extra!r} (it has: "
                             f"{', '.join(sorted(optional))})")
        lines += optional[extra]
    return lines


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: requirements.py PYPROJECT [EXTRA ...]")
    extras = [e for arg in argv[1:] for e in arg.replace(",", " ").split()]
    print("\n".join(dict.fromkeys(requirements(argv[0], extras))))


if __name__ == "__main__":
    main(sys.argv[1:])
