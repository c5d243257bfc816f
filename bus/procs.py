"""Child processes that die with their parent, even when the parent is killed with SIGKILL.

A SIGKILLed parent runs no code, so no ``finally``, ``atexit`` or group kill of a test harness or
benchmark can stop its children, and a watchdog process would itself be one more child to outlive
it; only the kernel can. On Linux every child started here asks it to
(``prctl(PR_SET_PDEATHSIG, SIGKILL)``, between fork and exec, then a check that the parent did not
die before the request), and gets its own session, which the parent can stop group-wise.

The kernel sends that signal when the *thread* that forked the child ends, not the process. So
:func:`popen` forks on the main thread when called from it, and otherwise on one daemon thread of
its own that never returns (a thread pool's or ``asyncio.to_thread``'s worker may end long before
the child should): its child lives as long as the process that started it, from any thread. That
thread starts with this module, on the main thread if imported from there, so a caller's per-thread
state (a network namespace entered with ``setns``) does not carry to the child: run it through
``ip netns exec``. :func:`process_pool` is a :class:`~concurrent.futures.ProcessPoolExecutor` whose
workers are forked the same way and make the request in an initializer. :func:`run` forks on the
calling thread, which waits for the child; :func:`acreate_subprocess_exec` forks on the event loop's
thread (asyncio does), so its child lives no longer than that loop's thread.

Elsewhere than Linux there is no such request: the children get their own session only.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    for name in ("libc.so.6", None):
        with contextlib.suppress(OSError, AttributeError):
            return ctypes.CDLL(name, use_errno=True).prctl
    return None


# resolved once in the parent: a child between fork and exec should not dlopen (malloc's locks)
_prctl = _load_prctl()


def die_with_parent(parent: int | None = None) -> bool:
    """In a child: be SIGKILLed when the parent's forking thread ends. ``parent``: the pid that
    forked us; if it is already gone (it died before the request), die now. False where unsupported."""
    if _prctl is None:
        return False
    try:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except Exception:
        return False
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def _preexec(parent: int, then: Callable[[], Any] | None) -> Callable[[], None]:
    def run() -> None:  # pragma: no cover - runs in the child between fork and exec
        die_with_parent(parent)
        if then is not None:
            then()
    return run


# -- a thread that lives as long as the process ----------------------------------------------------

_jobs: queue.SimpleQueue = queue.SimpleQueue()
_spawner: threading.Thread | None = None
_spawner_lock = threading.Lock()


def _serve() -> None:
    while True:  # never returns: the children it forks are bound to its life, i.e. the process's
        fn, fut = _jobs.get()
        if not fut.set_running_or_notify_cancel():
            continue
        try:
            fut.set_result(fn())
        except BaseException as e:
            fut.set_exception(e)


def _ensure_spawner() -> None:
    global _spawner
    with _spawner_lock:
        if _spawner is None or not _spawner.is_alive():  # not yet, or we are a forked child
            _spawner = threading.Thread(target=_serve, name="diloco-spawner", daemon=True)
            _spawner.start()


def on_lasting_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a thread that ends only with the process: the main thread if we are on it, else
    this module's spawner thread."""
    if threading.current_thread() in (threading.main_thread(), _spawner):
        return fn()
    _ensure_spawner()
    fut: Future = Future()
    _jobs.put((fn, fut))
    return fut.result()


if threading.current_thread() is threading.main_thread():
    _ensure_spawner()  # now, so that it has the main thread's namespaces, not a caller's (e.g. setns'd)


# -- the helpers -----------------------------------------------------------------------------------


def popen(args, *, start_new_session: bool = True, preexec_fn: Callable[[], Any] | None = None,
          **kw: Any) -> subprocess.Popen:
    """:class:`subprocess.Popen` of a child that dies with this process (SIGKILL included), in its own
    session unless ``start_new_session=False``; ``preexec_fn`` runs after the request."""
    parent = os.getpid()
    return on_lasting_thread(lambda: subprocess.Popen(args, start_new_session=start_new_session,
                                                      preexec_fn=_preexec(parent, preexec_fn), **kw))


def run(args, *, start_new_session: bool = True, **kw: Any) -> subprocess.CompletedProcess:
    """:func:`subprocess.run` of a child that dies with this process, in its own session. It forks on
    the calling thread, which waits for the child, so lives at least as long."""
    return subprocess.run(args, start_new_session=start_new_session, preexec_fn=_preexec(os.getpid(), None), **kw)


async def acreate_subprocess_exec(program, *args, start_new_session: bool = True,
                                  **kw: Any) -> asyncio.subprocess.Process:
    """:func:`asyncio.create_subprocess_exec` of a child that dies with this process, or sooner with
    the event loop's thread if that is not the main thread; in its own session."""
    return await asyncio.create_subprocess_exec(program, *args, start_new_session=start_new_session,
                                                preexec_fn=_preexec(os.getpid(), None), **kw)


def _pool_init(parent: int, then: Callable[..., Any] | None, args: tuple) -> None:
    die_with_parent(parent)
    if then is not None:
        then(*args)


class _Pool(ProcessPoolExecutor):
    def _spawn_process(self) -> None:  # CPython 3.9+: forks a worker, from submit()'s thread
        on_lasting_thread(super()._spawn_process)  # type: ignore[misc]


def process_pool(max_workers: int | None = None, mp_context=None, initializer: Callable[..., Any] | None = None,
                 initargs: tuple = (), **kw: Any) -> ProcessPoolExecutor:
    """A :class:`ProcessPoolExecutor` (``spawn`` workers unless ``mp_context``) whose workers die with
    this process, SIGKILL included; ``initializer(*initargs)`` runs after the request."""
    return _Pool(max_workers, mp_context=mp_context or multiprocessing.get_context("spawn"),
                 initializer=_pool_init, initargs=(os.getpid(), initializer, tuple(initargs)), **kw)
