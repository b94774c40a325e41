"""Every command the README and the docs show in a shell code block is a real one.

For each ``bash``/``sh`` block in README.md, ARCHITECTURE.md, bench/README.md
and docs/*.md: a ``make`` target exists in the Makefile; a flag given to
``horarun``, ``horovodrun`` or ``hora-coordinator`` is in its ``--help``; a
``python`` script or module exists; anything else is one of the ordinary
tools the pages tell an operator to use. A renamed target, flag or file
fails here instead of in a reader's terminal.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "bench" / "README.md",
         *sorted((ROOT / "docs").glob("*.md"))]
OURS = {"horarun": "hora.runner.launch", "horovodrun": "hora.runner.launch",
        "hora-coordinator": "hora_coordinator"}
# Tools the pages tell people to run that are not ours.
TOOLS = {"cd", "curl", "docker", "echo", "export", "kill", "kubectl", "sed", "pip", "ssh",
         "ray", "git", "cat", "ls", "mkdir", "kustomize"}
# The user's own training script in examples of how to launch one.
PLACEHOLDER_SCRIPTS = {"train.py"}
_BLOCK = re.compile(r"```(bash|sh|shell)\n(.*?)```", re.S)


def shell_commands(page: Path) -> list[tuple[str, list[str]]]:
    """(line, words) of every simple command in the page's shell blocks."""
    found = []
    for block in _BLOCK.finditer(page.read_text()):
        for line in block.group(2).replace("\\\n", " ").splitlines():
            try:  # a command substitution's value is a word, not a command
                words = shlex.split(re.sub(r"\$\([^)]*\)", "VALUE", line), comments=True)
            except ValueError:
                words = line.split()
            command: list[str] = []
            for word in [*words, ";"]:
                if word in (";", "&&", "||", "|") or word.endswith(";"):
                    if word.endswith(";") and word != ";":
                        command.append(word[:-1])
                    if command:
                        found.append((line.strip(), command))
                    command = []
                else:
                    command.append(word)
    return found


def _strip(words: list[str]) -> list[str]:
    """Drops leading ``VAR=value`` assignments and a subshell's parenthesis."""
    words = [w.lstrip("(").rstrip(")") for w in words]
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        words = words[1:]
    return [w for w in words if w]


@cache
def make_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text()
    return frozenset(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M))


@cache
def help_text(program: str) -> str:
    argv = [sys.executable, "-m", OURS[program], "--help"]
    if program == "horovodrun":
        argv = [sys.executable, "-c", "import sys; from hora.runner.launch import "
                "horovodrun_main; sys.argv[0] = 'horovodrun'; horovodrun_main()", "--help"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT)
    return out.stdout + out.stderr


def problems_of(words: list[str]) -> list[str]:
    words = _strip(words)
    if not words:
        return []
    program, args = Path(words[0]).name, words[1:]
    if program == "make":
        return [f"make target {a!r} is not in the Makefile" for a in args
                if not a.startswith("-") and "=" not in a and a not in make_targets()]
    if program in OURS:
        usage = help_text(program)
        flags = []
        for a in args:
            if a in ("python", "python3") or a.endswith(".py"):
                break  # the launched command's own arguments start here
            if a.startswith("-"):
                flags.append(a.split("=", 1)[0])
        return [f"{program} has no flag {f}" for f in flags
                if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", usage)]
    if program in ("python", "python3"):
        if args[:1] == ["-m"]:
            module = args[1]
            return [] if importlib.util.find_spec(module) else [f"no module {module}"]
        scripts = [a for a in args if a.endswith(".py")]
        return [f"no script {s}" for s in scripts
                if s not in PLACEHOLDER_SCRIPTS and not (ROOT / s).exists()]
    if program in TOOLS:
        return []
    return [f"unknown command {program!r}"]


def test_the_pages_show_shell_commands():
    assert sum(len(shell_commands(p)) for p in PAGES) > 20


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shown_command_is_real(page: Path):
    wrong = [f"{line}: {problem}" for line, words in shell_commands(page)
             for problem in problems_of(words)]
    assert not wrong, "\n".join(wrong)


def test_a_wrong_target_flag_or_script_is_caught():
    assert problems_of(["make", "no-such-target"])
    assert problems_of(["horarun", "--no-such-flag", "python", "train.py"])
    assert problems_of(["python", "examples/no_such_example.py"])
    assert problems_of(["frobnicate"])
    assert not problems_of(["horarun", "-np", "2", "python", "train.py", "--epochs", "3"])
