"""The container image and the docker compose cluster, built and run for real.

The image is built by ``docker compose build`` (the path of a user's first
``docker compose up``; BuildKit) from ``deploy/Dockerfile``, on a Debian base
made here with debootstrap (no image registry is reachable from the test
machines), from a wheelhouse that the host's pip fills (``PIP_OFFLINE=1``).
Compose then runs the repository's ``docker-compose.yml``: a coordinator and
trainer containers that join it by themselves, with the settings a user puts
in ``.env``.

Cached between runs on one machine: the base image, the wheelhouse
(``deploy/wheels``) and the image's layers. Needs docker (a daemon; started
here when installed but down), the Compose v2 plugin and debootstrap:
``make deploy-deps`` installs them.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from deploy_tools import (
    RESULTS,
    ROOT,
    TIMINGS,
    ComposeProject,
    checkout_tag,
    docker_missing,
    require,
    run,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc

BASE_SUITE = "bookworm"
BASE = f"hora-test-base:{BASE_SUITE}"
BASE_PYTHON = "3.11"  # Debian bookworm's python3
require("container image and docker compose", docker_missing(BASE))

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(900)]

TOOLS = ROOT / "deploy" / "tools"
IMAGE = checkout_tag("hora:test")
ELASTIC = ["docker-compose.yml", "docker-compose.elastic.yml"]
ACCURACY = re.compile(r"Test set: (?:Average loss: [\d.]+, )?Accuracy: ([\d.]+)")
_projects = itertools.count()


def build(tag: str, env_file: Path, root: Path = ROOT, check: bool = True,
          **settings: str) -> subprocess.CompletedProcess:
    """``docker compose build`` of ``root``'s docker-compose.yml on the test base, offline."""
    project = ComposeProject(
        f"horatest-build-{os.getpid()}", ["docker-compose.yml"], env_file,
        {"HORA_TOKEN": "not-used-by-a-build", "HORA_IMAGE": tag, "HORA_BASE": BASE,
         "HORA_PIP_OFFLINE": "1", **settings}, root=root)
    return project.compose("build", timeout=1800, check=check)


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> str:
    """The image, built from this checkout (layers cached across runs)."""
    started = time.monotonic()
    # The wheelhouse (mostly network) is filled while debootstrap makes the base (mostly
    # CPU): for the base's Python, known from its Debian release and checked below.
    log = tmp_path_factory.mktemp("wheelhouse") / "log"
    with open(log, "w") as out:
        wheelhouse = subprocess.Popen(
            [str(TOOLS / "wheelhouse.sh"), sys.executable, BASE_PYTHON],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        run([str(TOOLS / "base-image.sh"), BASE], timeout=1200,
            env={**os.environ, "HORA_DEBIAN_SUITE": BASE_SUITE})
        wheelhouse.wait(timeout=1800)
    finally:
        if wheelhouse.poll() is None:
            wheelhouse.kill()
            wheelhouse.wait(timeout=30)
    assert wheelhouse.returncode == 0, (
        f"wheelhouse.sh exited with {wheelhouse.returncode}\n{log.read_text()[-5000:]}")
    TIMINGS["base image and wheelhouse, side by side"] = time.monotonic() - started
    version = run(["docker", "run", "--rm", BASE, "python3", "-c",
                   "import sys; print('%d.%d' % sys.version_info[:2])"], timeout=120)
    assert version.stdout.strip() == BASE_PYTHON, f"{BASE} has Python {version.stdout}"
    started = time.monotonic()
    build(IMAGE, tmp_path_factory.mktemp("build") / "env")
    TIMINGS["image build"] = time.monotonic() - started
    return IMAGE


@pytest.fixture
def compose(image, tmp_path) -> Iterator[Callable[..., ComposeProject]]:
    """Makes compose projects of this checkout's files with the test image; each is torn
    down after the test (a test that checks the teardown has done it already)."""
    made: list[ComposeProject] = []

    def make(files=("docker-compose.yml",), **settings: str) -> ComposeProject:
        n = next(_projects)
        project = ComposeProject(
            f"horatest-{os.getpid()}-{n}", files, tmp_path / f"env.{n}",
            {"HORA_TOKEN": secrets.token_hex(16), "HORA_IMAGE": image,
             # Any free port on this machine, so that runs side by side do not collide.
             "HORA_GRPC_PUBLISH": "127.0.0.1:", "HORA_HTTP_PUBLISH": "127.0.0.1:",
             **settings})
        made.append(project)
        return project

    yield make
    for project in made:
        if project.leftovers()["containers"]:
            print(project.all_logs()[-8000:])  # shown when the test failed
        project.down()


def assert_torn_down(project: ComposeProject) -> None:
    """``docker compose down -v`` leaves none of the project's containers, networks, volumes."""
    left = project.down()
    assert left == {"containers": [], "networks": [], "volumes": []}, left
    done = int(RESULTS.get("projects torn down, nothing left", "0")) + 1
    RESULTS["projects torn down, nothing left"] = str(done)


def last_line(text: str) -> str:
    lines = text.rstrip().splitlines()
    return lines[-1].strip() if lines else ""


def api(project: ComposeProject, path: str, token: str | None = None) -> httpx.Response:
    url = f"http://{project.published('coordinator', 8080)}{path}"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(url, headers=headers, timeout=10)


def inspect(container: str, template: str) -> str:
    return run(["docker", "inspect", "--format", template, container], timeout=30).stdout.strip()


def test_image_runs_as_a_user_that_is_not_root(image):
    assert inspect(image, "{{.Config.User}}") == "hora:hora"
    out = run(["docker", "run", "--rm", image, "python", "-c",
               "import os, torch; print(os.getuid(), torch.__version__, torch.cuda.is_available())"],
              timeout=120).stdout.split()
    assert out == ["10001", "2.13.0+cpu", "False"]


def test_a_code_change_rebuilds_only_the_layers_after_torch_and_the_dependencies(
        image, tmp_path):
    # The same build context, with one line of client code changed.
    context = tmp_path / "context"
    context.mkdir()
    for name in ("pyproject.toml", "README.md", ".dockerignore", "docker-compose.yml"):
        shutil.copy2(ROOT / name, context / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "checkpoints")
    for name in ("proto", "native", "client_sdk", "services", "examples"):
        shutil.copytree(ROOT / name, context / name, ignore=skip)
    (context / "deploy").mkdir()
    shutil.copy2(ROOT / "deploy" / "Dockerfile", context / "deploy" / "Dockerfile")
    shutil.copytree(ROOT / "deploy" / "tools", context / "deploy" / "tools")
    # Hard links: the wheelhouse is hundreds of MB.
    shutil.copytree(ROOT / "deploy" / "wheels", context / "deploy" / "wheels",
                    copy_function=os.link, ignore=shutil.ignore_patterns(".*"))
    with open(context / "client_sdk" / "hora" / "_net.py", "a") as f:
        f.write("# a code change\n")
    tag = f"{image}-code-change"
    started = time.monotonic()
    try:
        build(tag, tmp_path / "env", root=context)
        TIMINGS["rebuild after a code change"] = time.monotonic() - started
        before = json.loads(inspect(image, "{{json .RootFS.Layers}}"))
        after = json.loads(inspect(tag, "{{json .RootFS.Layers}}"))
    finally:
        run(["docker", "rmi", "--force", tag], timeout=120, check=False)
    # The layers: the base, the user and the virtualenv, torch, hora's dependencies,
    # then hora, the examples (and WORKDIR's).
    assert len(before) == len(after) >= 6, before
    assert before[:4] == after[:4], "torch or the dependencies were reinstalled"
    assert before[4] != after[4], "the changed code did not reach the image"


def test_an_unknown_torch_flavour_stops_the_build_naming_the_choices(image, tmp_path):
    proc = build(f"{image}-rocm", tmp_path / "env", check=False, HORA_TORCH_FLAVOUR="rocm")
    assert proc.returncode != 0
    assert "TORCH_FLAVOUR must be cpu or cuda, not 'rocm'" in proc.stdout + proc.stderr


def test_compose_trains_digits_on_two_trainer_containers_that_join_by_themselves(compose):
    project = compose()
    token = project.settings["HORA_TOKEN"]
    started = time.monotonic()
    project.compose("up", "--detach", "--no-build", timeout=300)
    coordinator = project.containers("coordinator")[0]["Name"]
    assert inspect(coordinator, "{{.State.Health.Status}}") == "healthy"

    # Published ports: the REST API (token required off loopback) and gRPC health.
    assert api(project, "/readyz").json() == {"status": "ready"}
    assert api(project, "/api/v1/jobs").status_code == 401
    with grpc.insecure_channel(project.published("coordinator", 50051)) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=10)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING

    trainers = project.wait_exited("trainer", 2, timeout=600)
    TIMINGS["compose: 2 trainers, 8 epochs"] = time.monotonic() - started
    assert [t["ExitCode"] for t in trainers] == [0, 0], project.all_logs()[-5000:]
    logs = {t["Name"]: project.logs(t["Name"]) for t in trainers}
    (rank0,) = [name for name, text in logs.items() if "Test set" in text]
    line = last_line(logs[rank0])
    match = ACCURACY.search(line)
    assert match, f"rank 0's last line is {line!r}"
    assert float(match[1]) >= 0.90, line
    RESULTS["compose, 2 trainers, rank 0's last line"] = line

    # Each trainer is a container of its own: its own network stack and /dev/shm.
    names = list(logs)
    assert {inspect(n, "{{.HostConfig.IpcMode}}") for n in names} == {"private"}
    # A bridge network: each container in a network namespace of its own (not "host",
    # not another container's).
    assert {inspect(n, "{{.HostConfig.NetworkMode}}") for n in names} == {
        f"{project.name}_default"}

    # The dashboard from this machine, its pages shipped in the image's wheel.
    page = api(project, "/jobs/digits", token)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"], page
    assert "<title>" in page.text
    (job,) = [j for j in api(project, "/api/v1/jobs", token).json() if j["job_id"] == "digits"]
    assert (job["state"], job["size"], job["generation"]) == ("finished", 2, 1)
    members = api(project, "/api/v1/jobs/digits", token).json()["members"]
    hostnames = {inspect(n, "{{.Config.Hostname}}") for n in names}
    assert {m["host"] for m in members} == hostnames
    assert sorted((m["rank"], m["local_rank"]) for m in members) == [(0, 0), (1, 0)]

    assert_torn_down(project)


def test_elastic_compose_finishes_with_one_trainer_when_the_other_is_killed(compose):
    project = compose(ELASTIC, HORA_EPOCHS="60")
    token = project.settings["HORA_TOKEN"]
    started = time.monotonic()
    project.compose("up", "--detach", "--no-build", timeout=300)
    # Rank 0 logs its progress: kill it once both train, so that the survivor must
    # take over as rank 0.
    rank0 = project.wait_for_line("trainer", "world 2", timeout=300)
    run(["docker", "kill", rank0], timeout=60)
    trainers = project.wait_exited("trainer", 2, timeout=600)
    TIMINGS["compose elastic: a trainer killed"] = time.monotonic() - started
    codes = {t["Name"]: t["ExitCode"] for t in trainers}
    assert codes.pop(rank0) == 137  # SIGKILL
    ((survivor, code),) = codes.items()
    assert code == 0, project.logs(survivor)[-5000:]
    line = last_line(project.logs(survivor))
    assert line.endswith("(world of 1)"), line
    match = ACCURACY.search(line)
    assert match and float(match[1]) >= 0.90, line
    RESULTS["elastic, one trainer killed, the survivor's last line"] = line

    (job,) = [j for j in api(project, "/api/v1/jobs", token).json()
              if j["job_id"] == "digits-elastic"]
    assert job["state"] == "finished" and job["elastic"] and job["generation"] >= 2, job
    events = api(project, "/api/v1/jobs/digits-elastic/events", token).json()
    formed = [e["message"] for e in events if e["kind"] == "generation"]
    assert formed[0].startswith("generation 1 formed with 2 member(s)"), formed
    assert formed[-1].startswith(f"generation {job['generation']} formed with 1 member(s)")
    RESULTS["elastic, one trainer killed, generations"] = " / ".join(formed)
    assert any(e["kind"] == "lost" for e in events), events

    assert_torn_down(project)


def test_elastic_compose_grows_when_a_trainer_is_scaled_up(compose):
    # Epochs enough that the job is still running when the third trainer has joined,
    # however slow this machine: growing is what is checked, not finishing (the test
    # above finishes a job); down ends it.
    project = compose(ELASTIC, HORA_EPOCHS="100000")
    token = project.settings["HORA_TOKEN"]
    started = time.monotonic()
    project.compose("up", "--detach", "--no-build", timeout=300)
    project.wait_for_line("trainer", "world 2", timeout=300)
    project.compose("up", "--detach", "--no-build", "--scale", "trainer=3", timeout=300)
    project.wait_for_line("trainer", "world 3", timeout=300)
    TIMINGS["compose elastic: scaled up to 3"] = time.monotonic() - started
    assert len(project.containers("trainer")) == 3
    (job,) = [j for j in api(project, "/api/v1/jobs", token).json()
              if j["job_id"] == "digits-elastic"]
    assert job["state"] == "running" and job["size"] == 3 and job["generation"] >= 2, job
    events = api(project, "/api/v1/jobs/digits-elastic/events", token).json()
    formed = [e["message"] for e in events if e["kind"] == "generation"]
    assert formed[0].startswith("generation 1 formed with 2 member(s)"), formed
    assert formed[-1].startswith(f"generation {job['generation']} formed with 3 member(s)")
    RESULTS["elastic, scaled up, generations"] = " / ".join(formed)
    members = api(project, "/api/v1/jobs/digits-elastic", token).json()["members"]
    assert sorted(m["rank"] for m in members if m["state"] == "active") == [0, 1, 2], members
    assert_torn_down(project)
