"""The Python front end: `LLM` starts the attention and expert ranks as processes and feeds them.

```python
from splitmoe import LLM, SamplingParams
with LLM(path, attention_ranks=1, expert_ranks=2, dtype="float32", device="cpu") as llm:
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
```
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import multiprocessing as mp
import queue
import signal
import socket
import sys
import time
import traceback
import weakref

from tqdm import tqdm

from splitmoe.comm.topology import Topology
from splitmoe.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from splitmoe.inputs import broadcast_params, check_request, normalize_prompts
from splitmoe.outputs import RequestOutput
from splitmoe.sampling_params import SamplingParams
from splitmoe.scheduler.request import RequestSpec
from splitmoe.scheduler.router import LeastLoadRouter
from splitmoe.tokenizer import Tokenizer

logger = logging.getLogger("splitmoe")


class RankFailure(RuntimeError):
    """A rank process raised or died; the whole job was stopped."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _QueueChannel:
    """Channel of an `LLM`-spawned rank: requests in through a queue, tokens out through another."""

    def __init__(self, rank: int, in_q, out_q):
        self.rank = rank
        self.in_q = in_q
        self.out_q = out_q
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def poll(self, timeout: float) -> list[RequestSpec]:
        specs: list[RequestSpec] = []
        try:
            msg = self.in_q.get(timeout=timeout) if timeout > 0 else self.in_q.get_nowait()
            while True:
                if msg is None:
                    self._closed = True
                else:
                    specs.extend(msg)
                msg = self.in_q.get_nowait()
        except queue.Empty:
            pass
        return specs

    def emit(self, updates) -> None:
        self.out_q.put(("step", self.rank, updates))

    def ready(self, topo: Topology) -> None:
        self.out_q.put(("ready", self.rank, topo.role))


class _NoRequests:
    """Expert ranks' channel: they never receive requests."""

    closed = True

    def __init__(self, rank: int, out_q):
        self.rank, self.out_q = rank, out_q

    def poll(self, timeout):
        return []

    def emit(self, updates):
        raise AssertionError("expert ranks produce no tokens")

    def ready(self, topo):
        self.out_q.put(("ready", self.rank, topo.role))


def _die_with_parent() -> None:
    try:  # Linux: the kernel kills this rank if the front end dies (even by SIGKILL).
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _rank_main(cfg: EngineConfig, rank: int, init_method: str, in_q, out_q) -> None:
    from splitmoe.comm.distributed import shutdown_groups
    from splitmoe.runtime import run_rank

    _die_with_parent()
    # Ctrl-C reaches the whole terminal process group: the front end handles it and stops the
    # ranks, so a rank ignores it instead of dying mid-collective with a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    role = "attention" if rank < cfg.parallel.attention_ranks else "expert"
    channel = _QueueChannel(rank, in_q, out_q) if in_q is not None else _NoRequests(rank, out_q)
    try:
        run_rank(cfg, rank, init_method, channel)
        shutdown_groups()
    except BaseException as e:  # report every failure, Ctrl-C included, then exit non-zero
        detail = "".join(traceback.format_exception_only(type(e), e)).strip()
        out_q.put(("error", rank, role, detail, traceback.format_exc()))
        out_q.close()
        out_q.join_thread()
        sys.exit(1)
    out_q.put(("exit", rank, role))
    out_q.close()
    out_q.join_thread()


class LLM:
    """Starts ``attention_ranks + expert_ranks`` rank processes and serves `generate` calls.

    Args:
        model: HF-format checkpoint directory (config.json + *.safetensors [+ tokenizer.json]).
        attention_ranks: data-parallel attention ranks (each with its own KV cache and scheduler).
        expert_ranks: ranks holding the routed experts; 0 runs them inside the attention rank.
        transport: attention<->expert communication scheme (``"flat"``).
        ranks_per_node: ranks that share a fast link; set it to emulate several nodes.
        dtype: ``"auto"`` (float32 on CPU, the checkpoint's dtype on CUDA), ``"float32"``,
            ``"bfloat16"`` or ``"float16"``.
        device: ``"auto"``, ``"cpu"`` or ``"cuda"``.
        block_size, num_kv_blocks, kv_cache_memory_gb: paged KV cache (see `CacheConfig`).
        max_num_seqs, max_num_batched_tokens, max_model_len: scheduler limits per attention rank.
        threads_per_rank: CPU threads per rank (default: cores / ranks).
        timeout_s: how long a collective or start-up may wait before the job is failed.
        attention_backend, moe_backend: ``"auto"`` (Triton on CUDA, PyTorch on CPU), ``"torch"``
            or ``"triton"`` (on CPU only under ``TRITON_INTERPRET=1``).
        seed: seeds the random streams of sampled requests that carry no seed of their own, so
            a `generate` call is reproducible.
    """

    def __init__(
        self,
        model: str,
        *,
        attention_ranks: int = 1,
        expert_ranks: int = 0,
        transport: str = "flat",
        ranks_per_node: int | None = None,
        dtype: str = "auto",
        device: str = "auto",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory_gb: float = 1.0,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        threads_per_rank: int | None = None,
        timeout_s: float = 120.0,
        seed: int = 0,
        attention_backend: str = "auto",
        moe_backend: str = "auto",
    ):
        self._procs: list[mp.Process] = []
        self.config = EngineConfig(
            model=ModelConfig.from_hf(model),
            parallel=ParallelConfig(
                attention_ranks=attention_ranks,
                expert_ranks=expert_ranks,
                transport=transport,
                ranks_per_node=ranks_per_node,
                timeout_s=timeout_s,
            ),
            cache=CacheConfig(
                block_size=block_size,
                num_kv_blocks=num_kv_blocks,
                kv_cache_memory_gb=kv_cache_memory_gb,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
            ),
            dtype=dtype,
            device=device,
            seed=seed,
            threads_per_rank=threads_per_rank,
            attention_backend=attention_backend,
            moe_backend=moe_backend,
        )
        # Reads and checks every tensor header before any rank starts.
        from splitmoe.models.loader import CheckpointReader

        CheckpointReader(model)
        self.tokenizer = Tokenizer.from_checkpoint(model)
        self._next_id = 0
        self._start()

    # ---- process management -------------------------------------------------------------------
    def _start(self) -> None:
        cfg = self.config
        ctx = mp.get_context("spawn")
        self._out_q = ctx.Queue()
        A, W = cfg.parallel.attention_ranks, cfg.parallel.world_size
        self._in_qs = [ctx.Queue() for _ in range(A)]
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        for rank in range(W):
            in_q = self._in_qs[rank] if rank < A else None
            p = ctx.Process(
                target=_rank_main,
                args=(cfg, rank, init_method, in_q, self._out_q),
                name=f"splitmoe-rank{rank}",
                daemon=True,
            )
            p.start()
            self._procs.append(p)
        self._finalizer = weakref.finalize(self, _kill_all, list(self._procs))
        atexit.register(self._finalizer)
        self._router = LeastLoadRouter(A)
        ready = 0
        deadline = time.monotonic() + cfg.parallel.timeout_s + 60
        while ready < W:
            msg = self._next_message(deadline, "start-up")
            if msg[0] == "ready":
                ready += 1

    def _role(self, rank: int) -> str:
        return "attention" if rank < self.config.parallel.attention_ranks else "expert"

    def _next_message(self, deadline: float, what: str):
        """Next message from the ranks; a failed or dead rank stops the whole job."""
        while True:
            try:
                msg = self._out_q.get(timeout=0.1)
            except queue.Empty:
                died = self._dead_ranks(exclude=-1, grace_s=0)
                if died or any(p.exitcode is not None for p in self._procs):
                    self._fail(f"{died or 'a rank exited early'} during {what}")
                if time.monotonic() > deadline:
                    self._fail(f"no progress from the ranks for too long during {what}")
                continue
            if msg[0] == "error":
                _, rank, role, detail, tb = msg
                died = self._dead_ranks(exclude=rank)
                cause = f"{died}; then " if died else ""
                self._fail(
                    f"{cause}rank {rank} ({role}) failed: {detail}\n"
                    f"--- rank {rank} traceback ---\n{tb}"
                )
            return msg

    def _dead_ranks(self, exclude: int, grace_s: float = 0.5) -> str:
        """Ranks that died without reporting (killed, out of memory): usually the root cause when
        a peer reports a broken connection."""
        deadline = time.monotonic() + grace_s
        while True:
            dead = [
                (r, p.exitcode)
                for r, p in enumerate(self._procs)
                if r != exclude and p.exitcode is not None and p.exitcode != 0
            ]
            if dead or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        return "; ".join(
            f"rank {r} ({self._role(r)}) died "
            + (f"(killed by {signal.Signals(-c).name})" if c < 0 else f"(exit code {c})")
            for r, c in dead
        )

    def _fail(self, message: str):
        self._shutdown(graceful=False)
        raise RankFailure(message)

    def _shutdown(self, graceful: bool) -> None:
        if not self._procs:
            return
        if graceful:
            for q in self._in_qs:
                q.put(None)
            deadline = time.monotonic() + 30
            for p in self._procs:
                p.join(timeout=max(0.1, deadline - time.monotonic()))
        _kill_all(self._procs)
        self._procs = []
        self._finalizer.detach()

    def close(self) -> None:
        """Stops every rank; safe to call twice."""
        self._shutdown(graceful=True)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._shutdown(graceful=exc_type is None)

    # ---- generation ---------------------------------------------------------------------------
    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; returns outputs in prompt order.

        prompts: a string, a list of strings (needs tokenizer.json), or a list of token-id lists.
        sampling_params: one for all prompts, or one per prompt.
        """
        if not self._procs:
            raise RuntimeError("this LLM is closed; create a new one")
        ids = normalize_prompts(prompts, self.tokenizer)
        params = broadcast_params(sampling_params, len(ids))
        for i, (p, sp) in enumerate(zip(ids, params)):
            check_request(i, p, sp, self.config)
        now = time.time()
        outputs: dict[int, RequestOutput] = {}
        order = []
        routed: dict[int, tuple[int, int]] = {}
        batches: list[list[RequestSpec]] = [[] for _ in self._in_qs]
        for p, sp in zip(ids, params):
            rid = self._next_id
            self._next_id += 1
            cost = len(p) + sp.max_tokens
            rank = self._router.pick(cost)
            routed[rid] = (rank, cost)
            batches[rank].append(RequestSpec(rid, list(p), sp, now))
            outputs[rid] = RequestOutput(request_id=rid, prompt_token_ids=list(p))
            order.append(rid)
        for q, batch in zip(self._in_qs, batches):
            if batch:
                q.put(batch)
        show = sys.stderr.isatty() if use_tqdm is None else use_tqdm
        bar = tqdm(total=len(order), desc="generate", unit="req", disable=not show)
        pending = set(order)
        try:
            while pending:
                msg = self._next_message(
                    time.monotonic() + self.config.parallel.timeout_s, "generate"
                )
                if msg[0] != "step":
                    continue
                for u in msg[2]:
                    out = outputs[u.request_id]
                    out.token_ids.extend(u.new_token_ids)
                    if u.finish_reason is not None:
                        out.finish_reason = u.finish_reason
                        out.metrics = u.metrics
                        pending.discard(u.request_id)
                        rank, cost = routed[u.request_id]
                        self._router.release(rank, cost)
                        bar.update(1)
        except KeyboardInterrupt:
            self._shutdown(graceful=False)
            raise
        finally:
            bar.close()
        if self.tokenizer is not None:
            for out in outputs.values():
                out.text = self.tokenizer.decode(out.token_ids)
        return [outputs[r] for r in order]


def _kill_all(procs: list[mp.Process]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
