"""A CPU rank's kernel choices, settled after its weights load and before it reports ready.

`settle_cpu_kernels` is the rank's one call: it lists every shape class the rank's calls can
meet (`model_trials`: the dense projections of its layers and LM head at every row class up to
the step's token budget, the routed experts at every class of (token, expert) pairs, the decode
attention at every class of rows and keys) and settles them (`cpu_choice.settle`) on made-up
activations and the rank's own weights, within a time budget: the engine option
``kernel_settle_s`` (None: no limit), and half the job's ``timeout_s`` at most (the ranks
done first wait for the others in a collective). Classes already in the cache file cost a
lookup, so each start measures what the last ones left,
smallest calls first (the decode steps most of serving is made of); the ranks of a host
measure one after another (`ChoiceFile.turn`), so that their timings do not slow each other
down and identical ranks measure once. A class left over runs its op's default kernel, the
reference (`KernelChoice.run`), for the life of the process, and is named in the rank's log
line. ``splitmoe tune-cpu`` (`splitmoe.tune_cpu`) measures them all, longer, ahead of time.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from splitmoe.kernels.cpu_choice import (
    DEFAULT_FILE,
    SettleReport,
    Trial,
    last_level_cache_bytes,
    settle,
    unsettled,
)
from splitmoe.kernels.fused_moe import moe_trials, per_expert_linear_trials
from splitmoe.kernels.linear import linear_trials
from splitmoe.kernels.paged_attention import decode_attention_trials

logger = logging.getLogger("splitmoe")


@dataclass(frozen=True)
class Shapes:
    """The sizes a rank's calls can have.

    seqs: decode rows of a step (and rows of the LM head) on an attention rank;
    tokens: rows of a step on an attention rank (prompt chunks and decode tokens);
    context: tokens of a sequence (keys a decode row reads);
    block_size: tokens of a KV cache block;
    expert_tokens: tokens of one MoE call (an expert rank's: every attention rank's tokens);
    all_slots_local: every routed slot of a token is computed here (colocated), so a call's
        pairs are its tokens times top-k;
    compiled: the attention layers run under ``torch.compile``, where their projections are
        ``F.linear`` (Inductor picks the GEMM: nothing to choose).
    """

    seqs: int
    tokens: int
    context: int
    block_size: int
    expert_tokens: int
    all_slots_local: bool = True
    compiled: bool = False

    @classmethod
    def of(cls, cfg, expert_rank: bool = False) -> Shapes:
        """The shapes of an attention rank (colocated experts included) or of an expert rank
        (``expert_rank``) of the `EngineConfig` ``cfg``."""
        sched = cfg.scheduler
        tokens = sched.max_num_batched_tokens
        return cls(
            seqs=min(sched.max_num_seqs, tokens),
            tokens=tokens,
            context=cfg.max_model_len,
            block_size=cfg.cache.block_size,
            expert_tokens=tokens * (cfg.parallel.attention_ranks if expert_rank else 1),
            all_slots_local=not expert_rank,
            compiled=cfg.compile_model,
        )


def model_trials(shapes: Shapes, dtype: torch.dtype, model=None, experts=None) -> list[Trial]:
    """Every CPU kernel class a rank holding ``model`` (an `AttentionModel`: its projections,
    LM head and paged attention) and ``experts`` (`LocalExperts`) meets at ``shapes``."""
    trials: list[Trial] = []
    if model is not None:
        trials += linear_trials(_projections(model, shapes.compiled), range(1, shapes.tokens + 1),
                                dtype)  # fmt: skip
        trials += linear_trials([(model.lm_head, None)], range(1, shapes.seqs + 1), dtype)
        if model.attention_backend.name == "torch" and not model.cfg.is_mla:
            trials += _decode_trials(model, shapes, dtype)
    if experts is not None and experts.backend.name == "torch" and experts.device.type == "cpu":
        cfg, k = experts.cfg, experts.cfg.top_k
        layers = list(experts.weights.values())
        held = max(len(ids) for ids in experts.layer_experts.values())
        if shapes.all_slots_local:
            here = k
            pairs = [t * k for t in range(1, shapes.expert_tokens + 1)]
        else:  # (a token's slots here: about its share of the experts, any count of pairs)
            here = min(k, held, max(1, round(k * held / cfg.num_experts)))
            pairs = range(1, shapes.expert_tokens * min(k, held) + 1)
        trials += moe_trials(layers, experts.act, pairs, here, k, dtype)
        trials += per_expert_linear_trials(layers, shapes.expert_tokens, dtype)
    return trials


def _projections(model, compiled: bool) -> list:
    """``(weight, bias)`` of every projection `AttentionModel` runs through `linear`."""
    out = []
    for layer in model.layers:
        if not compiled:  # (`layer_in` / `layer_out`: compiled, they call F.linear)
            if layer.mla is not None:
                m = layer.mla
                out += [(m.q_a, m.q_a_bias), (m.w_q, None), (m.kv_a, m.kv_a_bias)]
                out.append((layer.o_proj, m.o_bias))
            else:
                out += [(layer.w_qkv, layer.b_qkv), (layer.o_proj, layer.o_bias)]
            out.append((layer.router, None))  # (through `linear` for softmax-greedy routers)
            if layer.router is None:  # a dense layer's MLP
                out += [(layer.mlp_gate_up, None), (layer.mlp_down, None)]
        if layer.router is not None and layer.mlp_gate_up is not None:  # shared experts
            out += [(layer.mlp_gate_up, None), (layer.mlp_down, None)]
    return out


def _decode_trials(model, shapes: Shapes, dtype: torch.dtype) -> list[Trial]:
    cfg = model.cfg
    nkv, d = cfg.num_kv_heads, cfg.head_dim
    # K of a class's made-up cache: twice the last-level cache, so that keys stream from memory
    pool_bytes = 2 * last_level_cache_bytes() or 64 << 20
    trials = []
    kinds = {(layer.window, layer.sinks is not None) for layer in model.layers}
    for window, sinks in sorted(kinds, key=repr):
        trials += decode_attention_trials(
            nkv, cfg.num_heads // nkv, d, dtype, shapes.block_size,
            range(1, shapes.seqs + 1), range(1, shapes.context + 1), pool_bytes,
            window=window, sinks=sinks,
        )  # fmt: skip
    return trials


def settle_cpu_kernels(cfg, worker, topo) -> SettleReport | None:
    """Settles the kernel choices of a CPU rank whose ``worker`` has loaded its weights
    (`model_trials` at `Shapes.of` ``cfg``: an attention rank's ``worker.model``, and its
    ``worker.experts`` where ``topo`` is colocated; an expert rank's ``worker.experts``), done
    within ``cfg.kernel_settle_s`` of its call and half the job's ``timeout_s`` (the ranks done
    before it wait for it in a collective), and logs what it did. Where some class is not in
    the cache file, the rank measures in its turn (`ChoiceFile.turn`: the ranks of a host one
    after another, each finding what those before it decided; the wait counts in the budget).
    Nothing on other devices (None). ``cfg``: the `EngineConfig`; ``topo``: the `Topology`."""
    if cfg.device_type != "cpu":
        return None
    t0 = time.perf_counter()
    asked = cfg.kernel_settle_s
    # (ranks done first wait for this one in a collective: half its timeout at most)
    budget = min(math.inf if asked is None else asked, cfg.parallel.timeout_s / 2)
    deadline = t0 + budget
    attention = topo.is_attention
    model = worker.model if attention else None
    experts = worker.experts if topo.colocated or not attention else None
    shapes = Shapes.of(cfg, expert_rank=not attention)
    trials = model_trials(shapes, cfg.torch_dtype, model, experts)
    if unsettled(trials):
        with DEFAULT_FILE.turn(deadline):
            DEFAULT_FILE.refresh()  # (what the ranks before this one decided)
            report = settle(trials, max(0.0, deadline - time.perf_counter()))
    else:
        report = settle(trials, budget)  # (every class in the file: lookups)
    seconds = time.perf_counter() - t0
    prefix = f"{topo.describe()}: "
    if report.left:
        logger.warning(
            "%skernel choices: %s; %.2f s in all. The %d left run their op's default kernel "
            "until a later start measures them (or run `splitmoe tune-cpu`): %s",
            prefix, report.summary(), seconds, len(report.left),
            ", ".join(f"{c.op} {c.shape}" for c in report.left[:8])
            + (", ..." if len(report.left) > 8 else ""),
        )  # fmt: skip
    else:
        logger.info("%skernel choices: %s; %.2f s in all", prefix, report.summary(), seconds)
    return report
