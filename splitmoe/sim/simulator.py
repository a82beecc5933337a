"""Predicts step times, TPOT and throughput per GPU of an AF-disaggregated deployment.

One decode step of an attention rank holding ``B`` sequences of mean context ``C`` (``T`` new
tokens; ``T = B`` in decode) is, with ``m`` micro-batches (primes: one micro-batch of ``T / m``)::

    attention  Ta' = o_attn + o_seq * B/m + roofline(2 T/m P_attn + T/m F_core(C),
                                                     P_attn w + B/m C kv)          [+ shared expert]
    experts    Te' = o_moe + o_exp * n_act + roofline(2 p_max P_exp, n_act P_exp w)  busiest rank
    comm       Tc' = n_coll * o_coll(W) [+ (E + A_busy) o_wake]
                     + CostModel(dispatch) + CostModel(combine)
    MoE layer  disaggregated: max(m Ta', m Te', m Tc', Ta' + Te' + Tc')   (ping-pong: the last
                                 term is one micro-batch's round trip; m = 1 gives Ta + Te + Tc;
                                 ranks that are host processes add their own collective calls,
                                 n_coll o_coll(W), to each micro-batch of m Ta' and m Te')
                 ranks sharing cores (more rank processes than cores: waits sleep):
                                 m Tc' + `shared_cores_compute`: at m = 1 one side after the
                                 other; at m >= 2 the slower side keeps its cores and the side
                                 an exchange wakes computes on what it leaves free
               colocated:     max(m (Ta' + Te'), m Tc') + min(Ta' + Te', Tc')   (Tc = 0 when each
                                 rank holds every expert)
    step       o_step + o_seqstep * B + o_coll(W) [+ (A + E) o_shared + (A - 1) o_shared_A]
                 + LM head + sum over layers
    TPOT = step;  tokens/s per GPU = A B / (step (A + E))

``p_max`` / ``n_act`` (pairs and distinct experts on the busiest expert rank) come from
`splitmoe.sim.imbalance.expert_load` with the deployment's balancer and redundant experts (a
rank's tokens split into micro-batches of ceil and floor of T / m, as the runtime splits them,
and ``Te'`` the mean of the two sizes' costs); the
link terms from the transport's own `CostModel` (``flat``, ``two_phase``, or ``auto``: the
cheaper, per layer) on the count matrix those loads imply. Host overheads ``o_*`` and the
roofline come from the `HardwareProfile`. Ranks sharing too few cores (bracketed terms) sleep
while they wait: each exchange pays ``o_wake`` per rank it wakes (every expert rank, every
attention rank with sequences, ``A_busy``), every step ``o_shared`` per rank process (the step
boundary wakes each) and ``o_shared_A`` per attention rank after the first, and the work that
grows with the tokens of a side whose several ranks compute at once runs ``oversubscribed``
times slower (their fixed per-layer cost does not; a lone rank of its side is not slowed). The
``global`` balancer adds its all-gather of counts among the A attention ranks, ``o_coll(A)`` (+
``(A - 1) o_wake`` where ranks sleep), to each micro-batch's exchange. A closed batch of fewer
requests than attention ranks leaves ranks empty: the experts and the driver see only the
requests there are.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from functools import lru_cache

import torch

from splitmoe.memory import ModelDims, rank_memory
from splitmoe.sim.hardware import HardwareProfile
from splitmoe.sim.imbalance import BALANCERS, expert_load
from splitmoe.sim.model import ModelShape


@lru_cache(maxsize=64)
def _memory_dims(model: ModelShape) -> ModelDims:
    return model.memory_dims()  # (the planner asks thousands of times)


# flat / two_phase: the runtime's transports (host-issued collectives, alpha per message);
# gpu_a2a: GPU-initiated all-to-all (DeepEP low-latency, StepMesh, MegaScale-Infer's M2N): a fixed
# cost per call and bytes over the links, every message in flight at once, one row per (token,
# expert) pair as DeepEP's low-latency kernels send them, FP8 dispatch where the GPU has FP8.
SIM_TRANSPORTS = ("flat", "two_phase", "auto", "gpu_a2a")
# collectives per MoE layer on the data group: count exchange + one all-to-all each way (flat);
# two-phase adds the node-local aggregation all-to-all each way.
COLLECTIVES_PER_LAYER = {"flat": 3, "two_phase": 5}
ACT_BYTES = 2  # activations travel in bf16 on GPUs (the CPU profile's weight_bytes overrides)
KV_BYTES = 2


@dataclass(frozen=True)
class Deployment:
    """One serving instance, and how many identical instances (``replicas``) run side by side.

    attention_ranks / expert_ranks: ``A`` and ``E`` (``E = 0``: colocated); expert_parallel:
    colocated only, the ranks each layer's experts are sharded over (1: every rank holds every
    expert, as the runtime's ``expert_ranks=0`` does; ``A``: DeepSeek-style EP over all ranks).
    """

    attention_ranks: int
    expert_ranks: int = 0
    micro_batches: int = 1
    transport: str = "flat"
    balancer: str = "static"
    redundant_experts: int = 0
    replicas: int = 1
    expert_parallel: int = 1
    attention_tp: int = 1

    def __post_init__(self) -> None:
        if self.attention_ranks < 1 or self.expert_ranks < 0 or self.replicas < 1:
            raise ValueError("need attention_ranks >= 1, expert_ranks >= 0, replicas >= 1")
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches={self.micro_batches} must be >= 1")
        if self.transport not in SIM_TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} must be one of {SIM_TRANSPORTS}")
        if self.balancer not in BALANCERS:
            raise ValueError(f"balancer={self.balancer!r} must be one of {BALANCERS}")
        if self.expert_ranks and self.expert_parallel != 1:
            raise ValueError("expert_parallel applies to colocated deployments (expert_ranks=0)")
        if not 1 <= self.expert_parallel <= self.attention_ranks:
            raise ValueError("expert_parallel must be between 1 and attention_ranks")
        if self.attention_tp > 1 and (
            self.expert_ranks or self.attention_ranks % self.attention_tp
        ):
            raise ValueError(
                "attention_tp (tensor parallelism, experts sharded over the same group) applies "
                "to colocated deployments whose attention_ranks it divides"
            )

    @property
    def colocated(self) -> bool:
        return self.expert_ranks == 0

    @property
    def ranks(self) -> int:
        return self.attention_ranks + self.expert_ranks

    @property
    def gpus(self) -> int:
        return self.ranks * self.replicas

    def label(self) -> str:
        if self.colocated:
            ep = f" EP{self.expert_parallel}" if self.expert_parallel > 1 else ""
            tp = f" TP{self.attention_tp}" if self.attention_tp > 1 else ""
            tr = " gpu_a2a" if self.transport == "gpu_a2a" else ""
            return f"colocated x{self.attention_ranks}{tp}{ep} m={self.micro_batches}{tr}"
        bal = "" if self.balancer == "static" else f" {self.balancer}+{self.redundant_experts}"
        return (
            f"{self.attention_ranks}A:{self.expert_ranks}E m={self.micro_batches} "
            f"{self.transport}{bal}"
        )


@dataclass(frozen=True)
class StepPrediction:
    """Seconds of one step of one instance, per MoE layer and in total."""

    t_attn: float  # attention part of one MoE layer, whole step (all micro-batches)
    t_expert: float  # busiest expert rank's work in one MoE layer, whole step
    t_comm: float  # communication of one MoE layer (dispatch + combine, all micro-batches)
    t_moe_layer: float  # one MoE layer with overlap
    t_dense_layer: float
    t_step: float
    tokens: int  # new tokens per attention rank in this step
    imbalance: float
    t_mtp: float = 0.0  # the multi-token-prediction module (draft layers), whole step

    @property
    def overlap_saved(self) -> float:
        """Fraction of a MoE layer's serial time (attention + experts + comm) hidden by overlap."""
        serial = self.t_attn + self.t_expert + self.t_comm
        return 1 - self.t_moe_layer / serial if serial else 0.0

    @property
    def comm_share(self) -> float:
        serial = self.t_attn + self.t_expert + self.t_comm
        return self.t_comm / serial if serial else 0.0


@dataclass(frozen=True)
class DecodePrediction:
    deployment: Deployment
    batch: int  # sequences per attention rank (per tensor-parallel group with attention_tp)
    context: float
    step: StepPrediction
    tpot: float
    tokens_per_s: float  # all replicas
    tokens_per_s_per_gpu: float
    attention_mem_gb: float
    expert_mem_gb: float
    fits: bool
    tokens_per_step: float = 1.0  # output tokens per sequence per step (> 1 with MTP)
    binding: str = ""  # what bounds the step: "attention", "experts" or "communication"

    @property
    def per_user_tok_s(self) -> float:
        """Output tokens per second a sequence sees (``tpot`` is per output token)."""
        return 1.0 / self.tpot

    def row(self) -> dict:
        d = asdict(self.deployment)
        d.update(
            label=self.deployment.label(),
            gpus=self.deployment.gpus,
            batch=self.batch,
            context=self.context,
            tpot_ms=self.tpot * 1e3,
            tokens_per_s=self.tokens_per_s,
            tokens_per_s_per_gpu=self.tokens_per_s_per_gpu,
            t_attn_ms=self.step.t_attn * 1e3,
            t_expert_ms=self.step.t_expert * 1e3,
            t_comm_ms=self.step.t_comm * 1e3,
            comm_share=self.step.comm_share,
            overlap_saved=self.step.overlap_saved,
            imbalance=self.step.imbalance,
            attention_mem_gb=self.attention_mem_gb,
            expert_mem_gb=self.expert_mem_gb,
            fits=self.fits,
            binding=self.binding,
        )
        return d


@dataclass(frozen=True)
class RunPrediction:
    """A closed batch: ``num_requests`` prompts of ``prompt_len`` submitted at once, each
    generating ``output_len`` tokens (what the scaling study's batch runs do)."""

    duration_s: float
    output_tok_s: float
    ttft: float
    tbt: float
    prefill: StepPrediction
    decode: StepPrediction


@dataclass(frozen=True)
class Simulator:
    model: ModelShape
    hw: HardwareProfile
    skew: float = 0.0  # routing skew (see `splitmoe.sim.imbalance`)
    recorded_load: tuple[float, ...] | None = None
    expert_hw: HardwareProfile | None = None  # expert ranks' GPU when it differs (heterogeneous)
    kv_bytes: int = KV_BYTES  # bytes per KV-cache element (1: an FP8 cache)
    draft_tokens: int = 0  # multi-token prediction: tokens drafted per step (DeepSeek-V3's MTP: 1)
    draft_acceptance: float = 0.0  # probability each drafted token is accepted

    @property
    def ehw(self) -> HardwareProfile:
        return self.expert_hw or self.hw

    @property
    def tokens_per_step(self) -> float:
        """Output tokens per sequence per step: 1 + the accepted drafts (each drafted token
        needs the previous one accepted)."""
        return 1.0 + sum(self.draft_acceptance**i for i in range(1, self.draft_tokens + 1))

    # ---- per-part roofline --------------------------------------------------------------------
    @property
    def fp8(self) -> bool:
        """FP8 checkpoint (DeepSeek-V3: every linear layer) on hardware with FP8 GEMMs."""
        return self.model.fp8_weights and bool(self.hw.fp8_flops)

    @property
    def expert_fp8(self) -> bool:
        return self.model.fp8_weights and bool(self.ehw.fp8_flops)

    @property
    def wbytes(self) -> int:
        return 1 if self.fp8 else self.hw.weight_bytes

    @property
    def expert_wbytes(self) -> float:
        if self.model.mxfp4_experts and self.ehw.cores is None:  # (GPUs keep them packed)
            return 17 / 32  # 32 4-bit values + one 8-bit scale
        return 1 if self.expert_fp8 else self.ehw.weight_bytes

    @property
    def weight_reads(self) -> float:
        """1 where a kernel reads its weights from memory; 0 where the whole model's weights
        fit in the host's last-level cache (``cache_bytes``) and stay there between uses."""
        fits = self.model.total_params * self.hw.weight_bytes <= self.hw.cache_bytes
        return 0.0 if fits else 1.0

    @property
    def act_bytes(self) -> int:
        return self.hw.weight_bytes if self.hw.cores is not None else ACT_BYTES

    def kv_shard(self, tp: int) -> float:
        """Fraction of the KV cache one of ``tp`` tensor-parallel GPUs holds: KV heads split,
        replicated once there are fewer heads than GPUs (MLA's one latent: replicated)."""
        if tp <= 1:
            return 1.0
        heads = self.model.num_kv_heads if self.model.attention == "gqa" else 1
        return 1.0 / min(tp, heads)

    def _attn(
        self, tokens: float, decode_seqs: float, prefill_seqs: float, context: float, tp: int = 1
    ):
        """Attention (+ router, + shared expert on MoE layers) of one layer, one rank: the
        projections (weights, FP8 where the checkpoint and GPU have it) and the attention core
        over the KV cache (BF16 math, bounded by the cache's bytes or the FLOPs), each its own
        kernel. With ``tp`` GPUs per group, heads and weights are split ``tp`` ways."""
        m, oh = self.model, self.hw.overheads
        seqs = decode_seqs + prefill_seqs
        t = oh.attn_layer_s + oh.seqs_layer(seqs) + oh.prefill_seq_layer_s * prefill_seqs
        if not tokens:
            return t, t
        cached = m.kv_context(context)  # (sliding-window layers: at most their window)
        kv = seqs * cached * m.kv_bytes_per_token(self.kv_bytes) * self.kv_shard(tp)
        core = self.hw.gemm_s(tokens * m.attn_core_flops(cached) / tp, kv) if context else 0.0
        attn = t + self._linear(tokens, m.attn_params, tp) + core
        shared = self._linear(tokens, m.shared_params, tp)
        return attn + shared, attn + self._linear(tokens, m.dense_params, tp)

    def _linear(self, tokens: float, params: float, tp: int = 1, fp8: bool | None = None):
        """A GEMM of ``tokens`` rows through ``params`` weights split ``tp`` ways (FP8 where
        the checkpoint and GPU have it, unless ``fp8`` says otherwise); weights that stay in the
        host's cache (`weight_reads`) cost no memory traffic."""
        if not params:
            return 0.0
        nbytes = params * self.wbytes * self.weight_reads / tp
        return self.hw.gemm_s(2 * tokens * params / tp, nbytes, self.fp8 if fp8 is None else fp8)

    def _head(self, rows: float, tp: int) -> float:
        """One micro-batch's LM head and sampling over ``rows`` rows: the measured curve where
        the profile has one (`Overheads.head_rows_s`), else the head's GEMM."""
        oh = self.hw.overheads
        if oh.head_rows_s:
            return oh.head(rows)
        return self._linear(rows, self.model.hidden * self.model.vocab, tp, fp8=False)

    def _experts(self, pairs: float, active: float) -> float:
        m, oh = self.model, self.ehw.overheads
        if pairs <= 0:
            return oh.moe_layer_s
        flops = 2 * pairs * m.expert_params
        nbytes = active * m.expert_params * self.expert_wbytes * self.weight_reads
        return (
            oh.moe_layer_s
            + oh.expert_s * active
            + oh.pairs_layer(pairs)
            + self.ehw.gemm_s(flops, nbytes, self.expert_fp8)
        )

    def _comm(self, dep: Deployment, tokens_per_rank: float, load, wakes: float = 0.0) -> float:
        """Dispatch + combine of one micro-batch of one MoE layer. ``wakes``: the sleeping ranks
        it wakes, ``wake_s`` each (0 unless ranks share cores: see `step`)."""
        oh = self.hw.overheads
        if dep.attention_tp > 1:
            return self._allreduce(dep.attention_tp, tokens_per_rank)
        if dep.colocated and dep.expert_parallel == 1:
            return 0.0
        if dep.transport == "gpu_a2a":
            return self._gpu_a2a(dep, tokens_per_rank, load)
        if dep.colocated:
            senders, receivers, world = dep.expert_parallel, dep.expert_parallel, dep.ranks
        else:
            senders, receivers, world = dep.attention_ranks, dep.expert_ranks, dep.ranks
        row_bytes = self.model.hidden * self.act_bytes
        schemes = ("flat", "two_phase") if dep.transport == "auto" else (dep.transport,)
        links = _link_times(
            self.hw,
            senders,
            receivers,
            dep.colocated,
            round(tokens_per_rank * load.rows_per_token / receivers),
            round(load.rows_max / senders),  # busiest receiver, from each sender
            row_bytes + 8 * self.model.top_k,
            row_bytes,
        )
        # the global balancer's all-gather of per-expert counts among the attention ranks (where
        # ranks sleep, it wakes the A - 1 that arrive first)
        balance = 0.0
        if dep.balancer == "global" and not dep.colocated and dep.attention_ranks > 1:
            asleep = dep.attention_ranks - 1 if wakes else 0
            balance = oh.collective(dep.attention_ranks) + asleep * oh.wake_s
        best = math.inf
        for s in schemes:
            fixed = COLLECTIVES_PER_LAYER[s] * oh.collective(world) + wakes * oh.wake_s + balance
            best = min(best, fixed + links[s])
        return best

    def _allreduce(self, tp: int, tokens: float) -> float:
        """The two ring all-reduces of a tensor-parallel layer (after attention, after the MoE)
        over NVLink: 2 (tp - 1) messages and 2 (tp - 1) / tp of the activations each."""
        link = self.hw.links.intra
        nbytes = tokens * self.model.hidden * self.act_bytes
        one = 2 * (tp - 1) * link.alpha_s + 2 * (tp - 1) / tp * nbytes / link.bytes_per_s
        return 2 * one + 2 * self.hw.overheads.collective(tp)

    def _gpu_a2a(self, dep: Deployment, tokens: float, load) -> float:
        """Dispatch + combine of one micro-batch by GPU-initiated all-to-all (``gpu_a2a``): per
        call ``a2a_fixed_s``, then the busiest rank's bytes over its NVLink and its NIC at once
        (sender: every (token, expert) row it routes; receiver: every row the busiest expert rank
        gets). Colocated EP over ``W`` ranks keeps ``g / W`` of the rows in the node (``g`` GPUs
        per node, one of them itself); AF puts attention and expert ranks on different nodes
        once they do not fit one."""
        hw, m = self.hw, self.model
        per_node = hw.gpus_per_node
        if dep.colocated:
            w = dep.expert_parallel
            g = min(per_node, w)
            remote, local = 1 - g / w, (g - 1) / w
        else:
            one_node = dep.attention_ranks + dep.expert_ranks <= per_node
            remote, local = (0.0, 1.0) if one_node else (1.0, 0.0)
        return sum(self.gpu_a2a_times(tokens * m.top_k, load.pairs_max, remote, local))

    def gpu_a2a_times(
        self, rows_out: float, rows_in: float, remote: float, local: float
    ) -> tuple[float, float]:
        """(dispatch, combine) seconds of one GPU-initiated all-to-all call each: the busiest
        rank sends ``rows_out`` and receives ``rows_in`` rows, ``remote`` of them over the NIC
        and ``local`` over NVLink (the rest stay on the GPU). Dispatch rows are FP8 with one
        fp32 scale per 128 values where both GPUs have FP8 and the checkpoint is FP8, combine
        rows are BF16 (DeepEP's low-latency kernels)."""
        hw, m = self.hw, self.model
        fp8 = self.fp8 and self.expert_fp8
        dispatch_b = m.hidden + m.hidden // 128 * 4 if fp8 else m.hidden * self.act_bytes
        combine_b = m.hidden * self.act_bytes
        links = hw.links
        out = []
        for row_b in (dispatch_b, combine_b):
            worst = max(rows_out, rows_in) * row_b
            out.append(
                hw.a2a_fixed_s
                + max(
                    worst * remote / links.inter.bytes_per_s,
                    worst * local / links.intra.bytes_per_s,
                )
            )
        return out[0], out[1]

    # ---- one step -----------------------------------------------------------------------------
    def step(
        self,
        dep: Deployment,
        decode_seqs: float,
        context: float,
        prefill_tokens: float = 0.0,
        prefill_seqs: float = 0.0,
        load_share: float = 1.0,
    ) -> StepPrediction:
        """One step of the busiest attention rank: ``decode_seqs`` decode sequences over
        ``context`` cached tokens each (``1 + draft_tokens`` query tokens each with MTP), plus
        ``prefill_tokens`` prompt tokens in ``prefill_seqs`` chunks. With ``attention_tp`` the
        sequences are those of one tensor-parallel group, every GPU of which sees all of them.
        ``load_share``: the other ranks' load as a fraction of the busiest one's (1: every rank
        as busy; a closed batch of fewer requests than attention ranks leaves some empty), for
        what the experts receive and the driver handles."""
        if dep.colocated and self.expert_hw is not None:  # experts on the attention GPUs
            return replace(self, expert_hw=None).step(
                dep, decode_seqs, context, prefill_tokens, prefill_seqs, load_share
            )
        m, hw, oh = self.model, self.hw, self.hw.overheads
        tp = dep.attention_tp
        # every micro-batch runs, empty or not (the runtime's split: empty micro-batches still
        # take part in the collectives), so more micro-batches than sequences only cost
        mb = dep.micro_batches
        q_per_seq = 1 + self.draft_tokens
        tokens = decode_seqs * q_per_seq + prefill_tokens
        seqs = decode_seqs + prefill_seqs
        # micro-batches with sequences in them (the others skip the compute but still take part
        # in the exchange)
        full = min(mb, max(1, math.ceil(seqs))) if seqs else mb
        t_mb = tokens / full
        ctx = (
            context
            if not prefill_tokens
            else (
                (
                    decode_seqs * context
                    + prefill_tokens * (context + prefill_tokens / max(prefill_seqs, 1)) / 2
                )
                / max(tokens, 1)
            )
        )
        attn_moe, attn_dense = self._attn(t_mb, decode_seqs / full, prefill_seqs / full, ctx, tp)
        # expert load of one micro-batch: routed tokens of all attention ranks (or EP group)
        if tp > 1:
            group, senders = tp, 1  # every GPU of the group holds all tokens, 1/tp of experts
        elif dep.colocated:
            group, senders = dep.expert_parallel, dep.expert_parallel
        else:
            group, senders = dep.expert_ranks, dep.attention_ranks
        senders = 1 + (senders - 1) * load_share  # (the busiest one, and the others)
        busy_attention = 1 + (dep.attention_ranks - 1) * load_share  # attention ranks with work

        def load_of(tokens_mb: float):
            return expert_load(
                max(round(tokens_mb * senders), 0),
                m.num_experts,
                m.top_k,
                group,
                dep.balancer,
                dep.redundant_experts,
                self.skew,
                self.recorded_load,
            )

        def experts_at(tokens_mb: float) -> float:
            at = load_of(tokens_mb)
            return self._experts(at.pairs_max, at.active_max)

        load = load_of(t_mb)
        # the experts' cost is concave in the tokens (distinct experts saturate): the mean of
        # the micro-batches' two sizes' costs, not the cost of the mean
        te = _split_mean(t_mb, experts_at)
        # More rank processes than a host's cores (`HardwareProfile.contention`; 1 on GPUs): every
        # rank's work that grows with its tokens runs slower, the fixed per-layer host cost does not
        # (a step of few sequences is its fixed work and wake-ups, one of many its time-sliced
        # per-token work); and the transport's waits sleep (they spin only on a core of one's own),
        # so dispatch wakes each expert rank and combine each attention rank with sequences (an
        # empty one's answer is there first).
        slow = hw.contention(dep.ranks)
        sleeping = slow > 1 and not dep.colocated
        wakes = dep.expert_ranks + busy_attention if sleeping else 0.0
        tc = self._comm(dep, t_mb, load, wakes) if tokens else 0.0
        fa, fe = oh.attn_layer_s, self.ehw.overheads.moe_layer_s
        # ... where ranks sleep, the slow-down is of a side whose several ranks compute at once
        # (a lone rank of its side computes on a core and a cache of its own: 2A+1E's expert
        # rank computes a layer as fast as 1A+1E's, at one micro-batch and at two)
        slow_a = slow if not sleeping or dep.attention_ranks > 1 else 1.0
        slow_e = slow if not sleeping or dep.expert_ranks > 1 else 1.0
        ta, te = fa + (attn_moe - fa) * slow_a, fe + (te - fe) * slow_e
        if dep.colocated:
            comp = ta + te
            layer = max(full * comp, mb * tc) + min(comp, tc)
        elif sleeping:
            # ranks sharing cores sleep while they wait (the transport's waits spin only on a
            # core of one's own): the micro-batches' exchanges, each waking its peers, run one
            # after another; the compute takes turns on the cores (`shared_cores_compute`)
            compute = shared_cores_compute(
                ta, te, dep.attention_ranks, dep.expert_ranks, full, hw.cores
            )
            layer = mb * tc + compute
        else:
            # ranks that are host processes (``cores`` set) make their own collective calls on
            # their own core: that part of each micro-batch's exchange does not overlap their
            # compute (on GPUs the exchange runs beside the kernels)
            own = (
                COLLECTIVES_PER_LAYER.get(dep.transport, COLLECTIVES_PER_LAYER["flat"])
                * oh.collective(dep.ranks)
                if hw.cores is not None
                else 0.0
            )
            layer = max(full * ta + mb * own, full * te + mb * own, mb * tc, ta + te + tc)
        dense = full * (fa + (attn_dense - fa) * slow_a)
        if tp > 1:
            dense += mb * self._allreduce(tp, t_mb)
        # the LM head and sampling of each micro-batch with sequences, when it is done (the
        # runtime's `on_done`)
        head = full * _split_mean(seqs * q_per_seq / full, lambda r: self._head(r, tp))
        # MTP: each drafted token runs the draft module, one more MoE layer (DeepSeek-V3)
        mtp = self.draft_tokens * layer
        # several rank processes: the driver's step, the wait for the slowest attention rank
        # with work, and where the experts are elsewhere every sequence of the instance
        procs = (
            oh.proc_step_s
            + oh.busy_attention_step_s * (busy_attention - 1)
            + (0.0 if dep.colocated else oh.proc_seq_step_s * seqs * busy_attention)
            if dep.ranks > 1
            else 0.0
        )
        t_step = (
            oh.step_s
            + (oh.empty_micro_batch_s * (mb - full) * m.num_layers if dep.colocated else 0.0)
            + procs
            + oh.seq_step_s * seqs
            + oh.collective(dep.ranks)
            + (  # each woken at the boundary, a further attention rank for more
                oh.shared_step_s * dep.ranks
                + oh.shared_attention_step_s * (dep.attention_ranks - 1)
                if slow > 1
                else 0.0
            )
            + head * slow_a
            + m.num_moe_layers * layer
            + m.num_dense_layers * dense
            + mtp
        )
        return StepPrediction(
            t_attn=full * ta,
            t_expert=full * te,
            t_comm=mb * tc,
            t_moe_layer=layer,
            t_dense_layer=dense,
            t_step=t_step,
            tokens=round(tokens),
            imbalance=load.imbalance,
            t_mtp=mtp,
        )

    # ---- what users ask -----------------------------------------------------------------------
    def memory_gb(self, dep: Deployment, batch: int, max_context: float) -> tuple[float, float]:
        """Bytes an attention rank and an expert rank hold (GB): weights in the layout the
        runtime keeps them and the full-context KV cache, by the runtime's memory model
        (`splitmoe.memory.rank_memory`; no step buffers: `decode`'s ``fits`` leaves 10 % of the
        device for them)."""
        if dep.colocated and self.expert_hw is not None:
            return replace(self, expert_hw=None).memory_gb(dep, batch, max_context)
        m, tp = self.model, dep.attention_tp

        def table(dtype_bytes: int):
            return rank_memory(
                _memory_dims(m),
                1,  # (attention ranks are alike: one stands for them)
                dep.expert_ranks,
                dtype_bytes=dtype_bytes,
                kv_tokens=batch * max_context,
                window_tokens=batch * min(max_context, m.sliding_window),
                kv_bytes=self.kv_bytes,
                redundant_experts=dep.redundant_experts,
                expert_shards=max(dep.expert_parallel, tp),
                attention_tp=tp,
                kv_shard=self.kv_shard(tp),
            )

        t = table(self.hw.weight_bytes)
        attn = t.ranks[0].total
        if dep.colocated:
            return attn / 1e9, 0.0
        if self.ehw.weight_bytes != self.hw.weight_bytes:
            t = table(self.ehw.weight_bytes)
        return attn / 1e9, max(r.total for r in t.role("expert")) / 1e9

    def max_batch(self, dep: Deployment, max_context: float) -> int:
        """The most sequences per attention rank whose KV cache fits beside the weights (90 % of
        device memory): the attention side's memory bound."""
        cap = self.hw.memory_bytes / 1e9 * 0.9
        w, _ = self.memory_gb(dep, 0, max_context)
        per_seq = self.memory_gb(dep, 1, max_context)[0] - w
        return max(0, int((cap - w) / per_seq)) if per_seq > 0 else 10**9

    def decode(
        self, dep: Deployment, batch: int, context: float, max_context: float | None = None
    ) -> DecodePrediction:
        """Steady decode with ``batch`` sequences per attention rank (per tensor-parallel group
        with ``attention_tp``) at mean ``context``."""
        st = self.step(dep, batch, context)
        groups = dep.attention_ranks // dep.attention_tp
        per_step = self.tokens_per_step
        tok = groups * batch * per_step / st.t_step * dep.replicas
        attn_gb, exp_gb = self.memory_gb(dep, batch, max_context or context)
        cap = self.hw.memory_bytes / 1e9 * 0.9
        ecap = self.ehw.memory_bytes / 1e9 * 0.9
        parts = {"attention": st.t_attn, "experts": st.t_expert, "communication": st.t_comm}
        return DecodePrediction(
            deployment=dep,
            batch=batch,
            context=context,
            step=st,
            tpot=st.t_step / per_step,
            tokens_per_s=tok,
            tokens_per_s_per_gpu=tok / dep.gpus,
            attention_mem_gb=attn_gb,
            expert_mem_gb=exp_gb,
            fits=attn_gb <= cap and exp_gb <= ecap,
            tokens_per_step=per_step,
            binding=max(parts, key=parts.get),
        )

    def run(
        self,
        dep: Deployment,
        num_requests: int,
        prompt_len: int,
        output_len: int,
        max_num_batched_tokens: int = 2048,
    ) -> RunPrediction:
        """A closed batch (see `RunPrediction`) on one instance: requests spread evenly over the
        attention ranks, which step in lockstep, so the busiest rank sets the pace."""
        per_rank = math.ceil(num_requests / dep.attention_ranks)
        # what the other ranks hold, relative to the busiest (1 request on 2 ranks: nothing)
        share = (
            (num_requests - per_rank) / (per_rank * (dep.attention_ranks - 1))
            if dep.attention_ranks > 1
            else 1.0
        )
        prompt_tokens = per_rank * prompt_len
        prefill_steps = max(1, math.ceil(prompt_tokens / max_num_batched_tokens))
        chunk = prompt_tokens / prefill_steps
        prefill = self.step(
            dep, 0, 0.0, chunk, min(per_rank, math.ceil(per_rank / prefill_steps)), share
        )
        ttft = prefill_steps * prefill.t_step
        decode = self.step(dep, per_rank, prompt_len + output_len / 2, load_share=share)
        duration = ttft + (output_len - 1) * decode.t_step
        return RunPrediction(
            duration_s=duration,
            output_tok_s=num_requests * output_len / duration,
            ttft=ttft,
            tbt=decode.t_step,
            prefill=prefill,
            decode=decode,
        )


def _split_mean(x: float, cost) -> float:
    """The mean ``cost`` of the micro-batches that ``x`` per micro-batch comes in: the runtime
    splits a rank's tokens into micro-batches of the ceil and the floor of ``x`` (5 in two:
    3 + 2), and the costs step and bend with the size, so the cost of the mean is not it."""
    lo, hi = math.floor(x), math.ceil(x)
    if lo == hi or lo == 0:
        return cost(x)
    return (hi - x) * cost(lo) + (x - lo) * cost(hi)


def shared_cores_compute(
    ta: float, te: float, attention: int, experts: int, micro_batches: int, cores: float
) -> float:
    """Seconds of one MoE layer's compute where ``attention + experts`` rank processes share
    ``cores`` and sleep while they wait (the exchanges are counted apart). ``ta`` / ``te``: one
    micro-batch's work on one attention / expert rank.

    A side's micro-batch alone takes ``t * max(1, ranks / cores)`` (more ranks than cores take
    turns). One micro-batch: the two sides one after the other. With two or more, each
    micro-batch of the slower side (the bottleneck, which keeps computing) runs beside one of
    the faster side, woken by an exchange. The bottleneck's ranks keep their cores (a running
    task is not moved) and the woken ranks compute on the cores left free, sharing them; where
    none is left, their work takes turns with the bottleneck's. On 2 cores with 2 attention
    ranks + 1 expert rank and two micro-batches (`scripts/trace_step.py` shows it), the expert
    rank computes nearly the whole step at its own speed and the two attention ranks share the
    one core left, each at half speed: ``max(te, 2 ta)``. 1 + 2 (no core left):
    ``te + ta / 2``; 2 + 2: ``te + ta``.
    """
    phase_a = ta * max(1.0, attention / cores)
    phase_e = te * max(1.0, experts / cores)
    if micro_batches <= 1:
        return phase_a + phase_e
    if phase_e >= phase_a:  # (the side that keeps computing, and the side it wakes)
        bottleneck, n_b, t_w, n_w = phase_e, experts, ta, attention
    else:
        bottleneck, n_b, t_w, n_w = phase_a, attention, te, experts
    free = cores - n_b  # cores the bottleneck side leaves
    if free > 0:
        slot = max(bottleneck, t_w * max(1.0, n_w / free))
    else:
        slot = bottleneck + t_w * n_w / cores
    return micro_batches * slot


def _link_times(
    hw: HardwareProfile,
    senders: int,
    receivers: int,
    colocated: bool,
    rows: int,
    rows_busiest: int,
    dispatch_bytes: int,
    combine_bytes: int,
) -> dict[str, float]:
    """Seconds on the links of one layer's dispatch + combine under each scheme, from the
    transport's cost model. ``rows`` per (sender, receiver); the first receiver is the busiest
    with ``rows_busiest`` from every sender."""
    return dict(
        _link_times_cached(
            hw.links,
            hw.gpus_per_node,
            senders,
            receivers,
            colocated,
            rows,
            max(rows_busiest, rows),
            dispatch_bytes,
            combine_bytes,
        )
    )


@lru_cache(maxsize=8192)
def _link_times_cached(
    links, per_node, senders, receivers, colocated, rows, rows_busiest, dispatch_b, combine_b
):
    from splitmoe.comm.topology import Topology
    from splitmoe.comm.two_phase import NodeLayout, scheme_times
    from splitmoe.config import ParallelConfig

    if colocated:
        # EP among the same ranks: an all-to-all of ``senders`` ranks with themselves; each rank
        # keeps its own share. Modelled as A attention -> A expert ranks on separate nodes of the
        # same size, with the same-node share of the traffic.
        rows_busiest = round(rows_busiest * (1 - 1 / senders))
        t = _flat_only(links, per_node, senders, rows_busiest, dispatch_b, combine_b)
        return (("flat", t), ("two_phase", t))
    experts = max(receivers, 1)
    topo = Topology.build(0, ParallelConfig(senders, receivers, ranks_per_node=per_node), experts)
    layout = NodeLayout.build(topo)
    counts = torch.full((senders, receivers), rows, dtype=torch.int64)
    counts[:, 0] = rows_busiest
    times = scheme_times(layout, counts, dispatch_b, combine_b, links)
    return tuple(sorted(times.items()))


def _flat_only(links, per_node, ranks, rows_busiest, dispatch_b, combine_b):
    """Busiest receiver of an EP all-to-all among ``ranks`` ranks (colocated deployments)."""
    msgs = ranks - 1
    intra_msgs = min(per_node, ranks) - 1
    inter_msgs = msgs - intra_msgs
    total = rows_busiest * msgs
    intra_rows = total * intra_msgs / max(msgs, 1)
    inter_rows = total - intra_rows
    out = 0.0
    for b in (dispatch_b, combine_b):
        out += max(
            links.intra.time(intra_msgs, intra_rows * b),
            links.inter.time(inter_msgs, inter_rows * b),
        )
    return out
