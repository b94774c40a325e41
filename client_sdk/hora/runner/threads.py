"""Small thread helpers with Horovod's names (``horovod.runner.util.threads``)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["execute_function_multithreaded", "in_thread", "on_event"]


def execute_function_multithreaded(fn: Callable[..., Any], args_list: Sequence[Sequence[Any]],
                                   block_until_all_done: bool = True,
                                   max_concurrent_executions: int = 1000) -> dict[int, Any] | None:
    """Calls ``fn(*args)`` for every ``args`` of ``args_list`` on a pool of threads.

    Args:
        fn: the function.
        args_list: one argument list per call.
        block_until_all_done: wait for every call and return the results;
            False starts the calls and returns None at once.
        max_concurrent_executions: most calls running at a time.

    Returns:
        ``{index in args_list: fn's return value}`` when blocking, else None.

    Raises:
        Exception: the first exception a call raised (when blocking), after
            every call has ended.
    """
    if max_concurrent_executions < 1:
        raise ValueError(f"max_concurrent_executions must be >= 1, "
                         f"got {max_concurrent_executions}")
    work: queue.Queue[tuple[int, Sequence[Any]]] = queue.Queue()
    for index, args in enumerate(args_list):
        work.put((index, args))
    results: dict[int, Any] = {}
    errors: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def worker() -> None:
        while True:
            try:
                index, args = work.get_nowait()
            except queue.Empty:
                return
            try:
                value = fn(*args)
            except BaseException as exc:  # handed to the caller below
                with lock:
                    errors.append((index, exc))
            else:
                with lock:
                    results[index] = value

    count = min(max_concurrent_executions, len(args_list))
    threads = [in_thread(worker, daemon=not block_until_all_done) for _ in range(count)]
    if not block_until_all_done:
        return None
    for thread in threads:
        thread.join()
    if errors:
        raise min(errors, key=lambda item: item[0])[1]
    return results


def in_thread(target: Callable[..., Any], args: Sequence[Any] = (), name: str | None = None,
              daemon: bool = True, silent: bool = False) -> threading.Thread:
    """Starts ``target(*args)`` on a new thread and returns the thread.

    Args:
        silent: swallow an exception ``target`` raises instead of letting
            the thread report it.
    """
    def run() -> None:
        try:
            target(*args)
        except Exception:
            if not silent:
                raise

    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    return thread


def on_event(event: threading.Event, func: Callable[..., Any], args: Sequence[Any] = (),
             stop: threading.Event | None = None, check_interval_seconds: float = 1.0,
             silent: bool = False) -> threading.Thread:
    """Calls ``func(*args)`` on a thread once ``event`` is set, unless ``stop`` is set first.

    Returns:
        The (daemon) thread that waits.
    """
    if check_interval_seconds <= 0:
        raise ValueError(f"check_interval_seconds must be > 0, got {check_interval_seconds}")

    def wait_then_call() -> None:
        while not event.wait(check_interval_seconds):
            if stop is not None and stop.is_set():
                return
        if stop is not None and stop.is_set():
            return
        func(*args)

    return in_thread(wait_then_call, name="on_event", silent=silent)
