"""Processes forked from one warm interpreter: test ranks, the command line, the docs' examples.

Importing torch and Lightning costs seconds of CPU in every new process, more than most of the
tests' processes then spend working. One fork server imports them once, when a test first needs a
process, and forks every later process from it: the same interpreter state a fresh process reaches
after its first imports, without an OpenMP pool (the server never computes).

A fork runs under the caller's environment, as a spawned process would. The modules the server
imported read the environment it started with; when the caller's differs from it in a variable an
import may read (anything but the run-time variables below), ``context()`` answers ``None`` and the
caller starts a fresh process instead.

A forked command that starts Python the way a launcher starts its ranks (Lightning's starts
``python script ARGS`` or ``python -m module ARGS`` once per further rank, with the command's own
output and an environment differing only in run-time variables) gets those processes forked from
the server too; any other process it starts is the real thing.

Only the standard library is imported here: a forked command line or example must not find pytest
(or anything else the test process loaded) imported.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.popen_forkserver
import multiprocessing.reduction
import multiprocessing.spawn
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Optional, Sequence

# what most of the tests' processes import, and what their first torch.compile would import
PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "lightning_perf", "lightning_perf.strategies",
           "lightning_perf.callbacks", "lightning_perf.data", "lightning_perf.models.gpt", "lightning_perf.cli",
           "torch._dynamo", "torch._functorch.aot_autograd", "torch._inductor.compile_fx"]
# read at run time, never at import: set per test (pytest), by ``seed_everything`` or by a launcher,
# or written into the test process by what a test ran there: Inductor's first compile (its cache
# folder, a pointer its C++ wrappers read when they load), ``Trainer(deterministic=True)`` (cuBLAS's
# workspace, read when a handle is made). Without them in this list, one compiling test would start
# every later process of the run fresh.
_RUN_TIME = {"PYTEST_CURRENT_TEST", "PL_GLOBAL_SEED", "PL_SEED_WORKERS", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
             "NODE_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHINDUCTOR_CACHE_DIR",
             "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "CUBLAS_WORKSPACE_CONFIG"}

HANG_SIGNAL = signal.SIGUSR1

_server_env: Optional[dict[str, str]] = None
# variable name -> processes started fresh because the caller's value differed from the server's
# (the test session's summary lists them: each such process pays the imports the server saves)
FRESH_STARTS: dict[str, int] = {}


def _import_env(env) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in _RUN_TIME}


def _served(env) -> bool:
    """Whether a process under ``env`` can be forked from the server; records why not."""
    mine = _import_env(env)
    if mine == _server_env:
        return True
    server = _server_env or {}
    for name in sorted({k for k in set(mine) | set(server) if mine.get(k) != server.get(k)}):
        FRESH_STARTS[name] = FRESH_STARTS.get(name, 0) + 1
    return False


def context():
    """The fork server's multiprocessing context, started on first use; ``None`` when the environment
    differs from the one the server started with."""
    global _server_env
    ctx = multiprocessing.get_context("forkserver")
    if _server_env is None:
        ctx.set_forkserver_preload(PRELOAD)
        multiprocessing.forkserver.ensure_running()
        _server_env = _import_env(os.environ)
    return ctx if _served(os.environ) else None


def enter(env: dict[str, str]) -> None:
    """In a forked process: the caller's environment, random generators seeded afresh as in a new
    interpreter (forks would otherwise all continue the server's streams), ``HANG_SIGNAL`` set to
    dump every thread's stack to stderr (``stop`` sends it before it kills), and the tests' CPU kernel
    of ``torch._scaled_mm`` (``_cpu_fp8``; the server cannot preload it: Python 3.11's fork server
    ignores the test process's ``sys.path``, which holds this folder)."""
    import _cpu_fp8  # noqa: F401

    os.environ.clear()
    os.environ.update(env)
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # (``random`` reseeds itself after a fork)
    faulthandler.register(HANG_SIGNAL, all_threads=True)


def stop(pids: Sequence[int], grace: float = 2.0, *, group: bool = False) -> None:
    """Kill processes that ran past their time: first ``HANG_SIGNAL`` (each dumps its threads' stacks
    to its stderr), then, after ``grace`` seconds, SIGKILL (to each one's process group with ``group``)."""
    alive = []
    for pid in pids:
        try:
            os.kill(pid, HANG_SIGNAL)
            alive.append(pid)
        except ProcessLookupError:
            pass
    if alive:
        time.sleep(grace)
    for pid in alive:
        try:
            os.killpg(pid, signal.SIGKILL) if group else os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Timeout(subprocess.TimeoutExpired):
    """``subprocess.TimeoutExpired`` whose message ends with the stacks the command dumped."""

    def __str__(self) -> str:
        return f"{super().__str__()}\n{(self.stderr or '')[-6000:]}"


_PATHS: dict[tuple, list[str]] = {}


def _startup_path(env: dict[str, str]) -> list[str]:
    """``sys.path`` of a fresh interpreter under ``env``, less its first entry (the script's folder or
    the working directory): site-packages, ``PYTHONPATH`` and ``.pth`` entries."""
    key = tuple(sorted(_import_env(env).items()))
    if key not in _PATHS:
        out = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                             env=env, capture_output=True, text=True, check=True)
        _PATHS[key] = json.loads(out.stdout)
    return _PATHS[key]


def _main(args: list[str], cwd: str, env: dict[str, str], path: list[str], out, err, launched: str) -> None:
    """``python ARGS`` in ``cwd``: a module (``-m NAME ...``) or a script, stdout/stderr to files (paths)
    or to descriptors inherited from the command that launched this one (``_Inherited``); the pids of
    the ranks it launches are appended to the file ``launched``."""
    os.setsid()  # a timeout kills the group (the command and what it started) and each launched rank's
    for fd, target in ((1, out), (2, err)):
        f = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if isinstance(target, str) else target
        if f != fd:
            os.dup2(f, fd)
            os.close(f)
    os.chdir(cwd)
    enter(env)
    this = sys.modules.pop(__name__)  # imported to unpickle this function; the command never imported it
    ranks = _serve_launches(this, env, path, launched)
    code = 0
    try:
        if args[0] == "-m":
            sys.path[:] = [cwd, *path]
            sys.argv = ["-m", *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(args[0])
            sys.path[:] = [os.path.dirname(script), *path]
            sys.argv = list(args)
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        # what an interpreter does at exit: join its threads, run the atexit functions, flush
        threading._shutdown()
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        # launched ranks write to this command's output: the caller reads it once they are done too,
        # as a pipe read to its end waits for every process holding it
        for rank in ranks:
            rank.wait()
        os._exit(code)


# ---- a forked command's launches, forked from the server ----------------------------------------

_PLAIN_POPEN = subprocess.Popen
_HERE = os.path.dirname(os.path.abspath(__file__))


def _rank_preparation(data: dict) -> dict:
    """The launching command's preparation data as a rank takes it: ``sys.path`` with this module's
    folder (the rank imports it to run ``_main``), without the main module (a rank runs the script as
    ``__main__`` itself, not first as ``__mp_main__``)."""
    data = {k: v for k, v in data.items() if k not in ("init_main_from_path", "init_main_from_name")}
    data["sys_path"] = [_HERE, *data.get("sys_path", sys.path)]
    return data


class _RankPopen(multiprocessing.popen_forkserver.Popen):
    """Asks the server that forked this command (its address and liveness pipe are inherited) for one
    more process; ``ensure_running`` would start a server of its own, with nothing imported."""

    def _launch(self, process_obj):
        server, full = multiprocessing.forkserver._forkserver, multiprocessing.spawn.get_preparation_data
        server.ensure_running = lambda: None
        multiprocessing.spawn.get_preparation_data = lambda name: _rank_preparation(full(name))
        try:
            super()._launch(process_obj)
        finally:
            multiprocessing.spawn.get_preparation_data = full
            del server.ensure_running


class _RankProcess(multiprocessing.context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        return _RankPopen(process_obj)


class _Inherited:
    """One of the launching command's descriptors, passed to the rank (as ``subprocess.Popen`` passes its
    stdout and stderr: the same open file, one offset)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _detach, (multiprocessing.reduction.DupFd(self.fd),)


def _detach(dup) -> int:
    return dup.detach()


class _LaunchedRank(_PLAIN_POPEN):
    """The ``subprocess.Popen`` face of a rank forked from the server: ``pid``, ``poll``, ``wait``,
    ``returncode``, signals; no pipes (a launcher's ranks write to the command's own output)."""

    stdin = stdout = stderr = None

    def __init__(self, proc, args) -> None:  # (Popen.__init__ would start a process)
        self._proc, self.args, self.pid, self.returncode = proc, args, proc.pid, None

    def poll(self):
        if self.returncode is None:
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout=None):
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, input=None, timeout=None):
        self.wait(timeout)
        return None, None

    def send_signal(self, sig) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _rank_args(args, rest, kwargs, env: dict[str, str]) -> Optional[list[str]]:
    """``args`` less the interpreter when ``subprocess.Popen(args, *rest, **kwargs)`` starts this
    interpreter on a script or module (``-m``) with the command's own stdio and an environment that
    differs from ``env`` in run-time variables only; else ``None``."""
    if rest or set(kwargs) - {"env", "cwd"} or not isinstance(args, (list, tuple)) or len(args) < 2 \
            or not all(isinstance(a, (str, os.PathLike)) for a in args):
        return None
    args = [os.fspath(a) for a in args]
    if args[0] != sys.executable:
        return None
    if args[1] == "-m":
        if len(args) < 3:
            return None
    elif args[1].startswith("-") or not os.path.isfile(os.path.join(kwargs.get("cwd") or "", args[1])):
        return None
    child = kwargs.get("env")
    return args[1:] if _import_env(os.environ if child is None else child) == _import_env(env) else None


def _serve_launches(this, env: dict[str, str], path: list[str], launched: str) -> list[_LaunchedRank]:
    """In a forked command: make ``subprocess.Popen`` fork the command's launches (``_rank_args``) from
    the server; their pids go to the file ``launched`` (the caller kills them after a timeout)."""
    ranks: list[_LaunchedRank] = []

    class Popen(_PLAIN_POPEN):
        def __new__(cls, args=None, *rest, **kwargs):
            rank = _rank_args(args, rest, kwargs, env)
            if rank is None:
                return super().__new__(cls)
            child = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
            proc = _RankProcess(target=_main, args=(rank, kwargs.get("cwd") or os.getcwd(), child, path,
                                                    _Inherited(1), _Inherited(2), launched))
            sys.modules[this.__name__] = this  # (pickled by reference)
            try:
                proc.start()
            finally:
                del sys.modules[this.__name__]
            with open(launched, "a") as f:
                f.write(f"{proc.pid}\n")
            ranks.append(_LaunchedRank(proc, list(args)))
            return ranks[-1]

    subprocess.Popen = Popen
    return ranks


class Command:
    """``python ARGS`` started by ``start``: forked from the warm interpreter or a fresh process, its
    output captured; ``finish`` waits for it."""

    def __init__(self, args: list[str], cwd: str, env: dict[str, str], ctx) -> None:
        self.args = [sys.executable, *args]
        if ctx is None:
            self._tmp = None
            self._proc = subprocess.Popen(self.args, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, start_new_session=True)
            return
        self._tmp = tempfile.TemporaryDirectory()
        tmp = Path(self._tmp.name)
        self._out, self._err, self._launched = tmp / "stdout", tmp / "stderr", tmp / "launched"
        self._out.touch()
        self._err.touch()
        self._proc = ctx.Process(target=_main, args=(args, cwd, env, _startup_path(env), str(self._out),
                                                     str(self._err), str(self._launched)))
        self._proc.start()

    def finish(self, timeout: float) -> subprocess.CompletedProcess:
        """Its exit code and output; after ``timeout`` seconds it is killed, with the processes it
        started (its stacks first, when forked), and ``Timeout`` raised."""
        if self._tmp is None:
            try:
                out, err = self._proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)  # the command and any ranks it launched
                out, err = self._proc.communicate()
                raise Timeout(self.args, timeout, out, err) from None
            return subprocess.CompletedProcess(self.args, self._proc.returncode, out, err)
        try:
            self._proc.join(timeout)
            timed_out = self._proc.exitcode is None
            if timed_out:
                ranks = [int(p) for p in self._launched.read_text().split()] if self._launched.exists() else []
                stop([self._proc.pid, *ranks], group=True)  # the command, what it started, the ranks it launched
                self._proc.join()
            out, err = self._out.read_text(errors="replace"), self._err.read_text(errors="replace")
        finally:
            self._tmp.cleanup()
        if timed_out:
            raise Timeout(self.args, timeout, out, err)
        return subprocess.CompletedProcess(self.args, self._proc.exitcode, out, err)


def start(args: Sequence[str], *, cwd=None, env: Optional[dict[str, str]] = None, fresh: bool = False,
          fresh_env: Optional[dict[str, str]] = None) -> Command:
    """``python ARGS`` (``args`` = ``("-m", module, ...)`` or ``(script, ...)``) in ``cwd`` under ``env``,
    forked from the warm interpreter; a fresh process when it cannot be, or with ``fresh`` (a script
    that sets environment variables for its own imports), under ``fresh_env`` where given (what a new
    interpreter needs to find what a fork inherits)."""
    args = [str(a) for a in args]
    cwd = str(os.getcwd() if cwd is None else cwd)
    env = dict(os.environ if env is None else env)
    ctx = None if fresh else context()
    if ctx is None or not _served(env):
        return Command(args, cwd, env if fresh_env is None else dict(fresh_env), None)
    return Command(args, cwd, env, ctx)


def python(args: Sequence[str], *, timeout: float, cwd=None, env: Optional[dict[str, str]] = None,
           fresh: bool = False) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout)`` for ``args`` = ``("-m", module, ...)`` or ``(script, ...)``, forked from the
    warm interpreter; a fresh process when it cannot be, or with ``fresh`` (a script that sets
    environment variables for its own imports). Raises ``subprocess.TimeoutExpired`` (its message
    ending with the stacks of the forked command's threads) after killing the process and
    everything it started."""
    return start(args, cwd=cwd, env=env, fresh=fresh).finish(timeout)
