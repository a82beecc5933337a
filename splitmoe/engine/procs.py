"""The rank processes a front end starts: spawning, watching, ending.

A front end starts every rank of its job as a child process (or, under a launcher, attention
rank 0 alone: the launcher started the others): CPU ranks fork from a server process that
imported torch and the runtime once (`start_context`), other ranks are spawned. Each runs
`rank_main`: it dies with the process that started it (Linux; the fork server ends with the
front end), ignores Ctrl-C (the front end handles it and stops them all), talks to the front
end over its own `RankChannel`, and reports how it ended: `protocol.Exited`, or
`protocol.RankError` / `protocol.Evicted` before a non-zero exit.
"""

from __future__ import annotations

import atexit
import ctypes
import multiprocessing as mp
import multiprocessing.forkserver as forkserver
import os
import signal
import sys
import time
import traceback
import weakref
from dataclasses import dataclass

from splitmoe.comm.control import RankEvicted
from splitmoe.comm.distributed import shutdown_groups
from splitmoe.config import EngineConfig
from splitmoe.engine.channel import RankChannel
from splitmoe.host import rank_openmp_env


@dataclass(frozen=True)
class LaunchedJob:
    """A job whose ranks a launcher (torchrun, mpirun) started, this process being rank 0's: an
    `LLM` built with it spawns only attention rank 0 (as a child that joins the launcher's
    rendezvous), and the other ranks run `splitmoe.runtime.run_rank` in their own processes,
    each connected to this front end directly."""

    init_method: str
    local_rank: int
    local_world_size: int


_MAIN_GUARD = 'if __name__ == "__main__":'


def check_not_bootstrapping() -> None:
    """Refuses to build an `LLM` in a process that multiprocessing is still starting.

    `LLM` starts its ranks with the "forkserver" or "spawn" method, whose new process first runs
    the parent's main script again (as module ``__mp_main__``): a script that builds its LLM at
    its top level, outside the main guard, builds one in every rank, which multiprocessing then
    stops with a message naming neither splitmoe nor the fix. ``_inheriting`` is the flag that
    multiprocessing's own check reads (``multiprocessing.spawn._check_not_importing_main``)."""
    if getattr(mp.current_process(), "_inheriting", False):
        raise RuntimeError(
            "LLM(...) was called while multiprocessing was starting this process with the "
            "'forkserver' or 'spawn' method, the way LLM starts its rank processes: a new "
            "process first runs the main script again, and this script creates an LLM at its top "
            f"level. Put the code that creates and uses the LLM under `{_MAIN_GUARD}`:\n\n"
            "    from splitmoe import LLM\n\n"
            f"    {_MAIN_GUARD}\n"
            "        llm = LLM(...)\n"
            "        outputs = llm.generate(...)\n"
        )


def _die_with_parent() -> None:
    # A rank forked from the fork server holds its copy of the front end's end of the server's
    # liveness pipe (so that it could ask the server for processes of its own): the server ends
    # only when every holder is gone. Let go of it, so the server ends with the front end.
    server = forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    try:  # Linux: the kernel kills this rank if its parent (front end, fork server) dies.
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def rank_main(
    cfg: EngineConfig,
    rank: int,
    init_method: str,
    address: str,
    token: str,
    launched: LaunchedJob | None = None,
    env: dict[str, str] | None = None,
) -> None:
    """A rank process, start to end (``env``: the front end's environment when it started the
    rank, which a rank forked from the preloaded server takes over)."""
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    from splitmoe.runtime import run_rank  # (the rank's own imports: torch, the model...)

    _die_with_parent()
    # Ctrl-C reaches the whole terminal process group: the front end handles it and stops the
    # ranks, so a rank ignores it instead of dying mid-collective with a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    role = "attention" if rank < cfg.parallel.attention_ranks else "expert"
    channel = RankChannel(rank, role == "attention", address, token, announce=bool(launched))
    where = (launched.local_rank, launched.local_world_size) if launched else (None, None)
    try:
        run_rank(cfg, rank, init_method, channel, *where)
        shutdown_groups()
    except RankEvicted as e:  # (the others went on without this rank: not the job's failure)
        channel.evicted(role, str(e))
        sys.exit(1)
    except BaseException as e:  # report every failure, Ctrl-C included, then exit non-zero
        detail = "".join(traceback.format_exception_only(type(e), e)).strip()
        channel.failed(role, detail, traceback.format_exc())
        sys.exit(1)
    channel.close(role)


# What a rank process reads from its environment as it starts, before `rank_main` runs: the
# interpreter's (PYTHONPATH: sitecustomize), OpenMP's, the allocator's and Triton's (read as
# torch and triton load).
_LOAD_VARS = ("PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "LD_", "MALLOC_", "TRITON_")
_PRELOAD = ["splitmoe.runtime"]


def _load_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_LOAD_VARS)}


_BASE_ENV = _load_env()  # this process's, as it imported splitmoe: the fork server's
_forkserver_started = False


def start_context(cfg: EngineConfig, omp: dict[str, str]):
    """How this front end starts CPU ranks: forked from a server process that imported torch
    and the runtime once (multiprocessing's "forkserver"; started here the first time), so a
    rank starts in milliseconds instead of importing them again. That is where a fresh process
    would load alike: the ranks need no OpenMP settings of their own (``omp``:
    `rank_openmp_env`) and the load variables (`_LOAD_VARS`) are as this process had them when
    it imported splitmoe (the fork server's). Otherwise, and for GPU ranks, they are spawned."""
    global _forkserver_started
    if (
        cfg.device_type != "cpu"
        or omp
        or _load_env() != _BASE_ENV
        or "forkserver" not in mp.get_all_start_methods()
    ):
        return mp.get_context("spawn")
    if not _forkserver_started:
        mp.set_forkserver_preload(_PRELOAD)
        forkserver.ensure_running()
        _forkserver_started = True
    return mp.get_context("forkserver")


class RankProcesses:
    """The rank processes this front end started, in rank order (rank ``r`` is ``procs[r]``)."""

    def __init__(
        self,
        cfg: EngineConfig,
        init_method: str,
        address: str,
        token: str,
        launched: LaunchedJob | None,
    ):
        self.cfg = cfg
        local = 1 if launched is not None else cfg.parallel.world_size
        self.procs: list[mp.Process] = []
        # (a spawned process takes this process's environment as it is when it starts; the
        # variables are set only where the user has not set them)
        omp = rank_openmp_env(cfg, launched.local_world_size if launched else local)
        ctx = start_context(cfg, omp)
        os.environ.update(omp)
        try:
            for rank in range(local):
                p = ctx.Process(
                    target=rank_main,
                    args=(cfg, rank, init_method, address, token, launched, dict(os.environ)),
                    name=f"splitmoe-rank{rank}",
                    daemon=True,
                )
                p.start()
                self.procs.append(p)
        finally:
            for k in omp:
                os.environ.pop(k, None)
        self._finalizer = weakref.finalize(self, kill_all, list(self.procs))
        atexit.register(self._finalizer)

    def role(self, rank: int) -> str:
        return "attention" if rank < self.cfg.parallel.attention_ranks else "expert"

    def exited(self) -> list[int]:
        """Ranks of this host whose process has ended."""
        return [r for r, p in enumerate(self.procs) if p.exitcode is not None]

    def died(self, exclude: set[int], grace_s: float = 0.5) -> str:
        """Ranks that died without reporting (killed, out of memory), but ``exclude``: usually
        the root cause when a peer reports a broken connection; "" when none."""
        deadline = time.monotonic() + grace_s
        while True:
            dead = [
                (r, p.exitcode)
                for r, p in enumerate(self.procs)
                if r not in exclude and p.exitcode is not None and p.exitcode != 0
            ]
            if dead or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        return "; ".join(
            f"rank {r} ({self.role(r)}) died "
            + (f"(killed by {signal.Signals(-c).name})" if c < 0 else f"(exit code {c})")
            for r, c in dead
        )

    def end(self, rank: int) -> bool:
        """Ends rank ``rank`` if this process started it and it still runs (stopped, hung, or
        woken after its peers went on: a SIGSTOPped process takes SIGKILL too) and reaps it;
        whether it was still running."""
        if rank >= len(self.procs):
            return False
        p = self.procs[rank]
        running = p.exitcode is None
        if running:
            p.kill()
        p.join(timeout=5)
        return running

    def spawn_failure_hint(self) -> str:
        """The start-up failure's hint when ranks exited with an error code without reporting
        it: `rank_main` reports every failure, so they failed before it ran, while
        multiprocessing was starting them, which runs the main script again."""
        script = getattr(sys.modules.get("__main__"), "__file__", None)
        if script is None or not any(p.exitcode and p.exitcode > 0 for p in self.procs):
            return ""
        return (
            f", before reporting in. A rank process first runs the main script {script} again "
            "(multiprocessing's 'forkserver' and 'spawn' start methods); a failure there ends "
            "it (see the rank's traceback on stderr). If the script creates the LLM at its top "
            f"level, put that code under `{_MAIN_GUARD}`."
        )

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))

    def kill(self) -> None:
        kill_all(self.procs)
        self._finalizer.detach()


def kill_all(procs: list[mp.Process]) -> None:
    """Stops the ranks (SIGTERM, then SIGKILL for one that does not go) and reaps them."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
