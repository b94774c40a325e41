# hora: two commands set everything up, `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch from the CPU wheel on this disk; a bare requirement would pull CUDA.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
PROTOS := $(wildcard proto/hora/v1/*.proto)

.PHONY: demo test test-fast lint format proto clean install

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[examples]"
	touch $@

# TensorFlow and tf-keras (hora[tensorflow]) for tests/multiprocess/test_tensorflow.py
# and the Keras examples; Lightning for hora.lightning. The installed torch is
# pinned, so that no extra (lightning) swaps the CPU wheel for a CUDA one.
$(TEST_STAMP): $(STAMP)
	$(PIP) install -q -e ".[test,examples,deploy,tensorflow,lightning]" \
	  "torch==$$($(PY) -c 'import torch; print(torch.__version__)')"
	touch $@

install: $(STAMP) native

# The DistributedOptimizer's C++ gradient hooks, compiled against the installed torch
# once per machine into ~/.cache/hora/torch_hooks (hora/torch/_native.py); without a
# C++ compiler the optimizer uses its Python hooks, and this says so.
.PHONY: native
native: $(STAMP)
	@$(PY) -c 'import hora.torch._native as n; n.prebuild()'

demo: $(STAMP) native
	$(VENV)/bin/horarun -np 2 $(PY) examples/pytorch_digits.py --epochs 8

test: $(TEST_STAMP) chromium native
	$(PY) -m pytest -q --durations=25 tests

# The dashboard's browser tests (tests/dashboard) drive Debian's chromium through
# Playwright, which never downloads a browser: install the apt package when missing.
# Without root (or password-less sudo) and apt, say so; those tests then skip, saying why.
.PHONY: chromium
chromium:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 \
	    || [ -n "$$HORA_CHROMIUM" ]; then exit 0; fi; \
	if ! command -v apt-get >/dev/null 2>&1; then \
	  echo "make: no chromium and no apt-get: the dashboard's browser tests will be skipped"; exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else \
	  echo "make: no chromium, and installing it needs root: the dashboard's browser tests will be skipped"; exit 0; fi; \
	echo "make: installing chromium (apt) for the dashboard's browser tests"; \
	$$SUDO apt-get install -y -q chromium >/dev/null 2>&1 \
	  || { $$SUDO apt-get update -q && $$SUDO apt-get install -y -q chromium; }

lint: $(TEST_STAMP)
	$(PY) -m ruff check proto/hora_proto client_sdk services native tests examples bench
	$(PY) -m mypy -p hora_proto -p hora_native -p hora -p hora_coordinator -p hora_negotiation

format: $(TEST_STAMP)
	$(PY) -m ruff format proto/hora_proto client_sdk services native tests examples bench

# Regenerates the gRPC stubs of proto/hora/v1 into the neutral package
# hora_proto.v1 (proto/hora_proto/v1), which the trainers and the coordinator import.
proto: $(TEST_STAMP)
	$(PY) -m grpc_tools.protoc -Ihora_proto=proto/hora --python_out=proto \
	  --grpc_python_out=proto --pyi_out=proto $(PROTOS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# Benchmarks against direct Gloo (and Horovod when HORA_BENCH_HOROVOD names its
# virtualenv); HORA_BENCH_QUICK=1 for a smoke run. See bench/README.md.
# Installs hora when the venv lacks it, but never reinstalls just because
# pyproject.toml changed: a benchmark should not touch the environment it times.
.PHONY: bench
bench:
	@test -f $(STAMP) || $(MAKE) install
	@$(PY) -c 'import hora.torch._native as n; n.prebuild()'
	@$(PY) -c "import lightning, tensorflow, tf_keras" 2>/dev/null \
	  || $(PIP) install -q -e ".[lightning,tensorflow]" \
	  "torch==$$($(PY) -c 'import torch; print(torch.__version__)')"
	$(PY) bench/run_all.py

# The coordinator under load: simulated workers (bench/locustfile.py, locust
# headless) against a fresh standalone coordinator; see bench/README.md.
.PHONY: bench-coordinator
bench-coordinator:
	@test -f $(STAMP) || $(MAKE) install
	@$(PY) -c "import locust" 2>/dev/null || $(PIP) install -q -e ".[bench]"
	$(PY) bench/coordinator_load.py

# Liveness: a worker killed, stopped or cut off -> the survivors' error or
# reset (network namespaces when run as root); see bench/README.md.
.PHONY: bench-liveness
bench-liveness:
	@test -f $(STAMP) || $(MAKE) install
	$(PY) bench/liveness.py

# ---- Deployment: the image, docker compose, Kubernetes (tests/deploy) ----------------
# `make test` runs tests/deploy with the rest; a part whose tools are missing is skipped,
# with one loud line at the end of the run naming it. `make deploy-deps` installs them
# when missing (root, Debian): docker.io, debootstrap, the Compose v2 plugin, and
# kubernetes-validate (the deploy extra) in $(VENV). `make test-deploy` runs only them.
.PHONY: deploy-deps test-deploy
deploy-deps: $(TEST_STAMP)
	deploy/tools/install-test-deps.sh $(PY)

test-deploy: $(TEST_STAMP)
	$(PY) -m pytest -q tests/deploy

# ---- Multi-host: horovodrun -H over real sshd in network namespaces ----------
# tests/deploy/test_multihost_ssh.py (3 hosts, each a network namespace running
# sshd) and bench/cross_host.py need root, iproute2 and OpenSSH (client and
# server). `make hosts-deps` installs OpenSSH with apt when missing (`make test`
# and .ci/run call it); `make test` runs these tests when the tools are there and
# prints one loud line when it skips them. See README, "Several machines".
HOSTS_MISSING = $(strip \
  $(if $(filter 0,$(shell id -u)),,root) \
  $(if $(shell command -v ip),,iproute2) \
  $(if $(wildcard /usr/sbin/sshd),,openssh-server) \
  $(if $(shell command -v ssh-keygen),,openssh-client))

.PHONY: hosts-deps hosts-check test-hosts bench-hosts
hosts-deps:
	-.ci/hosts-deps

# make test installs OpenSSH when it can (root and apt), then says loudly if it skips.
test: hosts-check
hosts-check: hosts-deps
	@$(if $(HOSTS_MISSING),echo "!!! make test SKIPS multi-host horovodrun over real sshd (tests/deploy/test_multihost_ssh.py): missing $(HOSTS_MISSING); run 'make hosts-deps' as root !!!",true)

# The multi-host tests on their own (about 1.5 minutes).
test-hosts: $(TEST_STAMP) hosts-deps
	$(PY) -m pytest -q tests/deploy/test_multihost_ssh.py

# allreduce across namespace hosts: hora against direct Gloo (bench/README.md).
bench-hosts: hosts-deps
	@test -f $(STAMP) || $(MAKE) install
	$(PY) bench/cross_host.py
# ---- end multi-host ----------------------------------------------------------

# ---- Ray and Spark clusters: hora.ray and hora.spark on real clusters (tests/clusters) ----
# test_ray.py starts a Ray head and worker nodes in network namespaces (root, iproute2);
# test_spark.py a local-cluster of two executor JVMs (Java 17). `make cluster-deps`
# installs Ray, PySpark (hora[ray,spark]) and, as root with apt, openjdk-17-jre-headless
# when missing; `make test` calls it, runs the suites when the tools are there, and
# prints one loud line for each suite it skips. `make test-clusters` runs only them.
CLUSTERS_MISSING = $(strip \
  $(if $(filter 0,$(shell id -u)),,root) \
  $(if $(shell command -v ip),,iproute2) \
  $(if $(or $(shell command -v java),$(JAVA_HOME)),,openjdk-17-jre-headless))

.PHONY: cluster-deps clusters-check test-clusters
cluster-deps: $(TEST_STAMP)
	-.ci/cluster-deps $(PY)

test: clusters-check
clusters-check: cluster-deps
	@$(if $(CLUSTERS_MISSING),echo "!!! make test SKIPS part of hora on Ray/Spark (tests/clusters): missing $(CLUSTERS_MISSING); run 'make cluster-deps' as root !!!",true)

test-clusters: $(TEST_STAMP) cluster-deps
	$(PY) -m pytest -q tests/clusters
# ---- end Ray and Spark -------------------------------------------------------
