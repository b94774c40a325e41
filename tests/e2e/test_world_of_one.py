"""A script started without horarun is a world of one, with no coordinator.

The same checks as in a larger world run in process: an invalid call fails
alone and the next call works; process sets, join and a training step
behave as in Horovod. No coordinator server is imported, let alone started.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def run_alone(script: str, cwd) -> subprocess.CompletedProcess:
    """Runs ``script`` as a plain Python process, no horarun and no HORA_ settings;
    it must exit 0."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HORA_", "HOROVOD_"))}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    return done

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import hora.torch as hvd

    hvd.init()
    assert (hvd.size(), hvd.rank(), hvd.local_size(), hvd.cross_size()) == (1, 0, 1, 1)
    x = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    assert torch.equal(hvd.allreduce(x, op=hvd.Sum), x)
    assert torch.equal(hvd.allreduce(x, op=hvd.Average, prescale_factor=2.0), 2 * x)
    for _ in range(3):  # cached after the first step
        assert torch.equal(hvd.allreduce(x, name="grad.w", op=hvd.Sum), x)
    assert torch.equal(hvd.allgather(x), x)
    assert torch.equal(hvd.broadcast(x, root_rank=0), x)
    out, received = hvd.alltoall(x, splits=torch.tensor([3]))
    assert torch.equal(out, x) and received.tolist() == [3]
    assert torch.equal(hvd.reducescatter(x, op=hvd.Sum), x)
    assert [t.tolist() for t in hvd.grouped_allreduce([x, x + 1], op=hvd.Sum)] == \\
        [x.tolist(), (x + 1).tolist()]
    assert hvd.allreduce(torch.tensor([7], dtype=torch.int16), op=hvd.Sum).item() == 7
    try:
        hvd.broadcast(x, root_rank=3)
    except ValueError as exc:
        assert "root_rank 3" in str(exc), exc
    else:
        raise AssertionError("a root rank outside the world was accepted")
    assert torch.equal(hvd.broadcast(x, root_rank=0), x)  # the next call works
    try:  # as in Horovod: a set with the global set's ranks is refused
        hvd.add_process_set([0])
    except ValueError as exc:
        assert "duplicate process set" in str(exc), exc
    else:
        raise AssertionError("a set with the global set's ranks was accepted")
    assert torch.equal(hvd.allreduce(x, op=hvd.Sum, process_set=hvd.global_process_set), x)
    assert hvd.join() == 0
    hvd.barrier()

    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    before = model.weight.detach().clone()
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    assert not torch.equal(before, model.weight)

    servers = sorted(m for m in sys.modules
                     if m.startswith("hora_coordinator.") and m.rsplit(".", 1)[1]
                     in ("server", "servicer", "http", "coordinator"))
    assert servers == [], servers
    hvd.shutdown()
    hvd.init()  # and again, as after an elastic reset
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == 1.0
    hvd.shutdown()
    print("world of one: ok")
""")


def test_a_script_without_horarun_runs_as_a_world_of_one_without_a_coordinator(tmp_path):
    done = run_alone(SCRIPT, tmp_path)
    assert "world of one: ok" in done.stdout


PROCESS_SET_MISTAKES = textwrap.dedent("""
    import hora.torch as hvd
    import torch

    hvd.init()
    errors = []
    for call in (lambda: hvd.add_process_set([0, 5]),
                 lambda: hvd.remove_process_set(hvd.global_process_set)):
        try:
            call()
        except ValueError as exc:  # hvd.InvalidCallError, as in a larger world
            errors.append(f"{type(exc).__name__}: {exc}")
    # In a world of one every set has the global set's ranks, which Horovod refuses.
    ps = hvd.ProcessSet([0])
    try:
        hvd.add_process_set(ps)
    except ValueError as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    assert ps.process_set_id is None, ps  # not added
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == 1.0  # the next call works
    assert hvd.remove_process_set(ps) is False  # never added
    print("\\n".join(errors))
    hvd.shutdown()
""")


def test_a_world_of_one_refuses_a_bad_process_set_call_as_a_larger_world_does(tmp_path):
    done = run_alone(PROCESS_SET_MISTAKES, tmp_path)
    lines = done.stdout.splitlines()
    assert lines[0].startswith(
        "InvalidCallError: add_process_set failed on every rank because of rank 0: "), lines
    assert "[0, 5]" in lines[0], lines
    assert lines[1] == ("InvalidCallError: remove_process_set failed on every rank because of "
                        "rank 0: the global process set cannot be removed"), lines
    assert lines[2].startswith("InvalidCallError: add_process_set failed on every rank because "
                               "of rank 0: attempted to add a duplicate process set"), lines
    assert "process set 0" in lines[2], lines


BACKGROUND_ROUND_FAULT = textwrap.dedent("""
    import time
    import torch
    import hora.torch as hvd
    from hora.engine import transport

    hvd.init()
    t = torch.ones(4)
    for _ in range(3):  # cached from here on: the background thread runs its rounds
        hvd.allreduce(t, name="x")
    real = transport.GlooControl.exchange  # a world of one agrees without the mesh

    def broken(self, vector, ready, budget, *, spin=False):  # a fault, not a transport error
        raise RuntimeError("injected fault")

    transport.GlooControl.exchange = broken
    handle = hvd.allreduce_async(t, name="x")
    time.sleep(1.5)
    transport.GlooControl.exchange = real
    try:
        hvd.synchronize(handle)
        print("no error")
    except hvd.HorovodInternalError as exc:
        print(f"HorovodInternalError: {exc}")
""")


def test_a_background_round_that_fails_fails_the_generation(tmp_path):
    """Not only transport errors: anything that ends the rounds thread fails the
    generation, so no caller waits for rounds that will not come."""
    done = run_alone(BACKGROUND_ROUND_FAULT, tmp_path)
    assert ("HorovodInternalError: rank 0: the background round failed "
            "(RuntimeError('injected fault'))") in done.stdout, done.stdout + done.stderr


GROUPED_FAULT = textwrap.dedent("""
    import torch
    import hora.torch as hvd

    hvd.init()
    good = [torch.ones(2), torch.ones(2)]
    calls = {
        "grouped_allreduce_": lambda: hvd.grouped_allreduce_(
            [*good, torch.ones(2, dtype=torch.complex64)], name="g"),
        "grouped_reducescatter": lambda: hvd.grouped_reducescatter(
            [*good, torch.ones(2, dtype=torch.complex64)], name="r"),
    }
    for call, run in calls.items():
        try:
            run()
            print(call, "no error")
        except ValueError as exc:
            print(call, exc)
    print(hvd.grouped_allreduce(good, name="after")[1].tolist())
""")


def test_a_grouped_call_names_the_tensor_at_fault(tmp_path):
    done = run_alone(GROUPED_FAULT, tmp_path)
    lines = done.stdout.splitlines()
    assert lines[0].startswith("grouped_allreduce_ tensor 'g.2': invalid call on rank 0"), lines
    assert lines[1].startswith("grouped_reducescatter tensor 'r.2': invalid call on rank 0"), lines
    assert lines[2] == "[1.0, 1.0]", lines
