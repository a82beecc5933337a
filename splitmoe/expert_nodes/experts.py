"""A set of routed experts held by one rank, for every MoE layer."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import torch

from splitmoe.comm.transport import ExpertBatch
from splitmoe.expert_nodes.graphs import ExpertGraphs
from splitmoe.kernels.backends import MoeBackend
from splitmoe.kernels.quant import QuantizedWeight, held_bytes
from splitmoe.models.config import ModelConfig
from splitmoe.models.loader import load_expert_weights


def _lower_priority() -> None:
    """This thread yields the CPU to the serving threads (Linux: a thread is a task with its
    own nice value): a rebalance's read then slows the steps it overlaps less."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux
        pass


class StagedExperts:
    """The weights of the next placement's changed slots, read in a background thread:
    ``changed[layer]``: local slots whose expert changes; ``expert_ids[layer]``: the experts of
    every local slot after the switch. `ready` polls; `weights` raises what the reader raised."""

    def __init__(self, changed: dict[int, list[int]], expert_ids: dict[int, list[int]]):
        self.changed = changed
        self.expert_ids = expert_ids
        self._weights: dict | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.read_s = 0.0  # how long the read took

    def start(self, read: Callable[[], dict]) -> None:
        def run():
            t = time.perf_counter()
            try:
                _lower_priority()
                self._weights = read()
            except BaseException as e:  # handed to the rank's thread by `weights`
                self._error = e
            self.read_s = time.perf_counter() - t

        self._thread = threading.Thread(target=run, name="stage-experts", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        """Reading finished (or failed: `weights` raises it at the switch)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def weights(self) -> dict[int, tuple[torch.Tensor, ...]]:
        self.wait()
        if self._error is not None:
            raise RuntimeError(
                f"reading the rebalanced experts' weights failed: {self._error}"
            ) from self._error
        return self._weights or {}


class LocalExperts:
    """The experts of every MoE layer held by one rank, indexed by local slot id.

    ``expert_ids``: global expert ids in local-slot order, one list for every layer or one per
    layer (expert ranks with replicas: `Placement.experts_on`). Loads only their tensors. Used by
    expert ranks, and by attention ranks in colocated mode (all experts, so local ids equal
    global ids).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        expert_ids: list[int] | dict[int, list[int]],
        dtype: torch.dtype,
        device: torch.device,
        backend: MoeBackend,
    ):
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        if not isinstance(expert_ids, dict):
            expert_ids = {layer: list(expert_ids) for layer in cfg.moe_layers}
        self.layer_experts = {layer: list(ids) for layer, ids in expert_ids.items()}
        self.backend = backend
        # per MoE layer: w13 [n, 2I, H], w2 [n, H, I] (and with expert biases b13 [n, 2I],
        # b2 [n, H]); w13 / w2 as `QuantizedWeight` from FP8 and MXFP4 checkpoints
        self.weights = load_expert_weights(cfg, self.layer_experts, dtype, str(device))
        # the clamped SwiGLU (GPT-OSS), passed with the biases to the backend
        self.act = (
            {}
            if cfg.swiglu_limit is None
            else dict(swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha)
        )
        self.weights_reloaded = 0  # (layer, slot) weights replaced by rebalances
        self.graphs: ExpertGraphs | None = None  # (`capture_graphs`)

    def capture_graphs(self, enabled: bool, max_rows: int, top_k: int) -> None:
        """Captures CUDA graphs of every layer's `compute_eager` for calls of up to
        ``max_rows`` rows of ``top_k`` slots (`ExpertGraphs`), on CUDA where ``enabled``
        (``enforce_eager=False``); a no-op elsewhere."""
        self.graphs = ExpertGraphs.create(
            self.compute_eager,
            self.weights,
            {layer: len(ids) for layer, ids in self.layer_experts.items()},
            self.cfg.hidden_size,
            self.dtype,
            self.device,
            max_rows,
            top_k,
            enabled=enabled,
        )

    @property
    def weight_bytes(self) -> int:
        """Resident bytes of the experts held: data and scales of quantized ones (the released
        size), biases included."""
        return held_bytes(self.weights)

    @property
    def expert_ids(self) -> list[int]:
        """Distinct experts held in any layer."""
        return sorted({e for ids in self.layer_experts.values() for e in ids})

    def stage(self, expert_ids: dict[int, list[int]]) -> StagedExperts:
        """Rebalance, first half: starts reading, in a background thread, the weights of the
        (layer, local slot) pairs whose expert differs in ``expert_ids`` from the checkpoint,
        while this rank keeps serving its current experts. `apply` then installs one layer at
        a time. ``expert_ids`` has as many slots per layer as held, or more (a fault-tolerant
        survivor growing its slots: `Placement.without`), whose new slots all count as
        changed."""
        changed = {}
        for layer, ids in expert_ids.items():
            held = self.layer_experts[layer]
            if len(ids) < len(held):
                raise ValueError(
                    f"layer {layer}: {len(ids)} slots where this rank holds {len(held)}: "
                    "slots are never taken away"
                )
            slots = [s for s, e in enumerate(ids) if s >= len(held) or held[s] != e]
            if slots:
                changed[layer] = slots
        staged = StagedExperts(changed, {layer: list(ids) for layer, ids in expert_ids.items()})
        wanted = {layer: [expert_ids[layer][s] for s in slots] for layer, slots in changed.items()}
        staged.start(lambda: self._read(wanted))
        return staged

    def _read(self, wanted: dict[int, list[int]]) -> dict[int, tuple[torch.Tensor, ...]]:
        """`load_expert_weights` for `stage`'s thread. On a GPU it reads into host memory and
        copies on a stream of its own, finished before it returns: the serving stream never
        waits for it."""
        if self.device.type != "cuda":
            return load_expert_weights(self.cfg, wanted, self.dtype, str(self.device))
        host = load_expert_weights(self.cfg, wanted, self.dtype, "cpu")
        stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            out = {k: tuple(t.to(self.device) for t in ts) for k, ts in host.items()}
        stream.synchronize()
        return out

    def apply(self, staged: StagedExperts, layer: int) -> int:
        """Rebalance, second half, between two steps: copies ``layer``'s staged weights into
        their local slots (only the changed slots: a memory copy, no checkpoint read); returns
        how many slots changed. New slots (a survivor growing) are appended: the layer's
        tensors are then new ones, which its captured CUDA graphs no longer read (they run it
        eagerly until captured again, see `ExpertGraphs.replay`)."""
        slots = staged.changed.get(layer, [])
        if slots:
            held = self.weights[layer]
            device = held[0].device
            new = staged.weights()[layer]  # w13, w2 (and with expert biases b13, b2)
            # (slots ascend, and every new slot changed: the new ones are the tail)
            inside = sum(s < len(self.layer_experts[layer]) for s in slots)
            if inside:
                idx = torch.tensor(slots[:inside], device=device)
                head = torch.arange(inside, device=device)
                part = new if inside == len(slots) else [_rows(src, head) for src in new]
                for w, src in zip(held, part):
                    w.index_copy_(0, idx, src)
            if inside < len(slots):
                tail = torch.arange(inside, len(slots), device=device)
                self.weights[layer] = tuple(
                    _appended(w, _rows(src, tail)) for w, src in zip(held, new)
                )
        self.layer_experts[layer] = list(staged.expert_ids[layer])
        self.weights_reloaded += len(slots)
        return len(slots)

    def compute(
        self, layer: int, x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """``x [N, H]``, ``local_ids / weights [N, k]`` (-1: not here) -> sums ``[N, H]``:
        replayed from the captured CUDA graphs where there are some for the call
        (`capture_graphs`), else `compute_eager`."""
        if self.graphs is not None:
            y = self.graphs.replay(layer, x, local_ids, weights)
            if y is not None:
                return y
        return self.compute_eager(layer, x, local_ids, weights)

    def compute_eager(
        self, layer: int, x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """`compute` by the MoE backend's kernels, launched now."""
        w13, w2, *bias = self.weights[layer]
        b13, b2 = bias or (None, None)
        return self.backend.experts(x, w13, w2, local_ids, weights, b13=b13, b2=b2, **self.act)

    def compute_batch(self, layer: int, batch: ExpertBatch) -> torch.Tensor:
        """`compute` on a received batch."""
        return self.compute(layer, batch.x, batch.expert_ids, batch.weights)

    def measure_cost(self, pairs: int = 64, repeats: int = 15) -> tuple[float, float]:
        """Seconds this rank's expert compute costs per distinct expert it runs and per (token,
        expert) pair, measured on its own first MoE layer: ``pairs`` pairs on one expert, and one
        pair on each of ``min(pairs, experts)`` experts (fastest of ``repeats``: other work on
        the machine only ever adds time). This is the calibration behind the balancer's
        `ExpertCost`."""
        layer = next(iter(self.layer_experts))
        w13 = self.weights[layer][0]
        n_exp = min(pairs, w13.shape[0])
        H = self.cfg.hidden_size
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(pairs, H, generator=gen).to(self.device, self.dtype)
        w = torch.full((pairs, 1), 1.0, device=self.device)
        one = torch.zeros(pairs, 1, dtype=torch.int32, device=self.device)
        spread = (torch.arange(pairs, device=self.device) % n_exp).to(torch.int32)[:, None]

        def timed(ids: torch.Tensor, rows: int) -> float:
            self.compute(layer, x[:rows], ids[:rows], w[:rows])  # warm-up
            times = []
            for _ in range(repeats):
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                t = time.perf_counter()
                self.compute(layer, x[:rows], ids[:rows], w[:rows])
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                times.append(time.perf_counter() - t)
            return min(times)

        t_one = timed(one, 1)  # 1 expert, 1 pair
        t_many_pairs = timed(one, pairs)  # 1 expert, `pairs` pairs
        t_many_experts = timed(spread, n_exp)  # `n_exp` experts, 1 pair each
        per_pair = max(0.0, (t_many_pairs - t_one) / max(1, pairs - 1))
        per_expert = max(0.0, (t_many_experts - t_one) / max(1, n_exp - 1) - per_pair)
        return per_expert, per_pair

    # Colocated mode: an ExpertExecutor whose local ids are the global ids; nothing to overlap,
    # so `start` computes and `finish` hands the result back.
    def start(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        return self.compute(layer, x, topk_ids, topk_weights)

    def finish(self, handle: torch.Tensor) -> torch.Tensor:
        return handle


def _rows(w, idx: torch.Tensor):
    """Leading rows ``idx`` of a stacked weight (a tensor or a `QuantizedWeight`)."""
    return w.select(idx) if isinstance(w, QuantizedWeight) else w.index_select(0, idx)


def _appended(w, more):
    """A stacked weight with ``more``'s rows after its own (a new tensor)."""
    if isinstance(w, QuantizedWeight):
        data = torch.cat([w.data, more.data])
        return QuantizedWeight(data, torch.cat([w.scale, more.scale]), w.fmt, w.block)
    return torch.cat([w, more])
