"""Runs every benchmark, prints the markdown, and writes bench/results/latest.md.

    make bench                                   # or: .venv/bin/python bench/run_all.py
    HORA_BENCH_HOROVOD=/tmp/horovod-venv make bench
    HORA_BENCH_QUICK=1 make bench                # smoke run, about a minute

Exits non-zero when a script fails or times out; the other sections are
still written.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
import time

from common import BENCH_DIR, RESULTS_DIR, SETTINGS, log

# In section order: 1, 1b, 2, 2b, 2c, 3, 3b, 3c, 3d, 4, 4b, 5.
SCRIPTS = ["allreduce.py", "many_small.py", "small_ops.py", "train_step.py", "keras_step.py",
           "lightning_step.py", "init_time.py",
           "elastic_recovery.py"]
SCRIPT_TIMEOUT = 540


def _output(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60,
                              check=False).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def machine() -> str:
    """The facts a reader needs to compare this table with another."""
    import torch

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    mem = _output(["free", "-h"]).splitlines()
    fields = mem[1].split() if len(mem) > 1 else []
    memory = f"{fields[1]} total, {fields[-1]} available" if len(fields) >= 7 else "unknown"
    horovod = "not measured"
    if SETTINGS.horovod_venv is not None:
        python = str(SETTINGS.horovod_venv / "bin" / "python")
        horovod = _output([python, "-c", "import horovod; print(horovod.__version__)"])
        horovod = f"{horovod} ({SETTINGS.horovod_venv})"
    commit = _output(["git", "-C", str(BENCH_DIR.parent), "rev-parse", "--short", "HEAD"])
    dirty = _output(["git", "-C", str(BENCH_DIR.parent), "status", "--porcelain"])
    lines = [
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- mode: {'quick (HORA_BENCH_QUICK=1)' if SETTINGS.quick else 'full'}",
        f"- nproc: {_output(['nproc'])}; CPU: {cpu}",
        f"- memory (free -h): {memory}",
        f"- python {platform.python_version()}, torch {torch.__version__}, "
        f"Horovod {horovod}",
        f"- hora: git {commit}{' + uncommitted changes' if dirty else ''}",
        "- every process: 1 thread (OMP_NUM_THREADS=1, torch.set_num_threads(1))",
    ]
    return "\n".join(lines)


def main() -> int:
    started = time.perf_counter()
    parts = ["# hora benchmarks", "", machine(), ""]
    print("\n".join(parts), flush=True)
    failed = []
    for script in SCRIPTS:
        log(f"running {script}")
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, str(BENCH_DIR / script)],
                                  stdout=subprocess.PIPE, text=True, timeout=SCRIPT_TIMEOUT,
                                  check=False, env=os.environ.copy())
            text, rc = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as exc:
            text = exc.stdout if isinstance(exc.stdout, str) else ""
            rc = -1
        if rc != 0:
            failed.append(script)
            text += f"\n_{script} failed (rc={rc}) after {time.perf_counter() - t0:.0f} s_\n"
        print(text, flush=True)
        parts.append(text)
    total = time.perf_counter() - started
    parts.append(f"_Whole run: {total:.0f} s._\n")
    print(parts[-1], flush=True)
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "latest.md").write_text("\n".join(parts).rstrip() + "\n", encoding="utf-8")
    log(f"wrote {RESULTS_DIR / 'latest.md'} in {total:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
