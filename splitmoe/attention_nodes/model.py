"""The part of an MoE transformer that lives on an attention rank.

Embeddings, attention (RoPE, GQA, optional q/k norms, paged KV), norms, the router, shared experts
and dense MLP layers, and the LM head. The routed experts are reached through an `ExpertExecutor`
passed to `forward` explicitly: local experts in colocated mode, dispatch/combine otherwise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from splitmoe.attention_nodes.compiled import CompiledPieces
from splitmoe.attention_nodes.kv_cache import PagedKVCache
from splitmoe.attention_nodes.mla import MlaWeights
from splitmoe.kernels.attention_metadata import AttentionMetadata
from splitmoe.kernels.backends import AttentionBackend
from splitmoe.kernels.linear import linear
from splitmoe.kernels.quant import QuantizedWeight, cat_rows, held_bytes
from splitmoe.models import routing
from splitmoe.models.config import ModelConfig
from splitmoe.models.rope import rope_inv_freq, yarn_softmax_scale


class ExpertExecutor(Protocol):
    """The routed experts, seen from an attention rank, in two halves so that other work (the
    next micro-batch's attention, the shared expert) runs while the experts compute."""

    def start(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> object:
        """Hands ``x [T, H]`` and its top-k routing ``[T, k]`` to the experts; returns a handle."""

    def finish(self, handle: object) -> torch.Tensor:
        """The routed-expert output ``[T, H]`` of a started layer."""


@dataclass
class MicroBatch:
    """One micro-batch's packed tokens: ids and positions ``[T]``, and their KV metadata."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    # the sliding-window layers' own block tables and slots (`SlidingWindowBlocks`), if any
    window_meta: AttentionMetadata | None = None


@dataclass
class _MoeInFlight:
    handle: object
    shared: torch.Tensor | None  # shared-expert output, computed while the experts work


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 like the HF reference (one fused op for
    float32 inputs, where it is bit-identical to the spelled-out form)."""
    if x.dtype == torch.float32 and (weight is None or weight.shape == x.shape[-1:]):
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    xf = x.float()
    xf = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return xf if weight is None else weight * xf


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    w_qkv: torch.Tensor | QuantizedWeight | None  # [(nh + 2 nkv) d, H] (None under MLA)
    b_qkv: torch.Tensor | None
    o_proj: torch.Tensor | QuantizedWeight  # [H, nh d] (projections: FP8 as released)
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    router: torch.Tensor | None  # [E, H] on MoE layers
    router_bias: torch.Tensor | None  # [E] e_score_correction_bias (choice only)
    mlp_gate_up: torch.Tensor | QuantizedWeight | None  # [2I, H]: dense MLP or shared expert
    mlp_down: torch.Tensor | QuantizedWeight | None  # [H, I]
    shared_expert_gate: torch.Tensor | None  # [1, H]
    qk_head_norm: torch.Tensor | None = None  # [nh + nkv, d]: per-head q then k norm weights
    mla: MlaWeights | None = None  # multi-head latent attention's projections
    o_bias: torch.Tensor | None = None  # [H]
    sinks: torch.Tensor | None = None  # [nh] float32: GPT-OSS's per-head softmax sink logits
    router_logit_bias: torch.Tensor | None = None  # [E]: added to the router's logits (GPT-OSS)
    window: int | None = None  # sliding-window layer: keys it attends to (None: all)

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], cfg: ModelConfig) -> LayerWeights:
        b = None
        if "q_bias" in t:
            b = torch.cat([t["q_bias"], t["k_bias"], t["v_bias"]])
        if "router" in t:
            gate, up, down = t.get("shared_gate"), t.get("shared_up"), t.get("shared_down")
        else:
            gate, up, down = t["mlp_gate"], t["mlp_up"], t["mlp_down"]
        mla = MlaWeights.from_tensors(t, cfg) if cfg.is_mla else None
        dtype = t["input_norm"].dtype  # the run dtype (FP8 projections stay `QuantizedWeight`)
        return cls(
            input_norm=t["input_norm"],
            post_norm=t["post_norm"],
            w_qkv=None if mla else cat_rows([t["q_proj"], t["k_proj"], t["v_proj"]], dtype),
            b_qkv=b,
            o_proj=t["o_proj"],
            q_norm=t.get("q_norm"),
            k_norm=t.get("k_norm"),
            router=t.get("router"),
            router_bias=t.get("router_bias"),
            mlp_gate_up=None if gate is None else cat_rows([gate, up], dtype),
            mlp_down=down,
            shared_expert_gate=t.get("shared_expert_gate"),
            # per-head q and k norm weights stacked, so both are normed in one call
            qk_head_norm=torch.cat(
                [
                    t["q_norm"].expand(cfg.num_heads, cfg.head_dim),
                    t["k_norm"].expand(cfg.num_kv_heads, cfg.head_dim),
                ]
            )
            if cfg.qk_norm == "head"
            else None,
            mla=mla,
            o_bias=t.get("o_bias"),
            sinks=None if "sinks" not in t else t["sinks"].float(),
            router_logit_bias=t.get("router_logit_bias"),
        )


@functools.cache
def _linear_outside_graph() -> Callable[..., torch.Tensor]:
    # built on first use: ``torch.compiler.disable`` imports torch._dynamo (and with it Triton),
    # which an eager rank never needs
    return torch.compiler.disable(linear)


def _proj(
    x: torch.Tensor, w: torch.Tensor | QuantizedWeight, b: torch.Tensor | None = None
) -> torch.Tensor:
    """`linear` (inside a compiled piece, `splitmoe.attention_nodes.compiled`, that is
    ``F.linear``: Inductor sees the GEMM and picks its kernel); for a `QuantizedWeight` there,
    `linear` outside the graph (a graph break: its dequantizing buffer is reused state)."""
    if isinstance(w, QuantizedWeight) and torch.compiler.is_compiling():
        return _linear_outside_graph()(x, w, b)
    return linear(x, w, b)


def gated_mlp(
    x: torch.Tensor, gate_up: torch.Tensor | QuantizedWeight, down: torch.Tensor | QuantizedWeight
) -> torch.Tensor:
    h = _proj(x, gate_up)  # [T, 2I]
    inter = down.shape[1]
    return _proj(F.silu(h[:, :inter]) * h[:, inter:], down)


def rope_rows(
    inv_freq: torch.Tensor, positions: torch.Tensor, factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [T, rd]`` float32 of ``positions`` (``inv_freq [rd/2]``; rd is the head dim,
    or fewer with partial rotary), ``sin``'s first half negated (`AttentionModel.rope`), both
    times ``factor`` (the rope type's attention factor)."""
    freqs = positions[:, None].float() * inv_freq[None, :]  # [T, rd/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, rd]
    cos, sin = emb.cos(), emb.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    sin[:, : sin.shape[-1] // 2].neg_()
    return cos, sin


class AttentionModel:
    def __init__(
        self,
        cfg: ModelConfig,
        global_weights: dict[str, torch.Tensor],
        layer_weights: list[dict[str, torch.Tensor]],
        device: torch.device,
        attention: AttentionBackend,
        compile: bool = False,
    ):
        """``compile``: run `layer_in` and `layer_out` through ``torch.compile``
        (`splitmoe.attention_nodes.compiled`); the attention kernel and the experts stay
        outside."""
        self.cfg = cfg
        self.embed = global_weights["embed"]  # [V, H]
        self.final_norm = global_weights["final_norm"]
        self.lm_head = global_weights["lm_head"]  # [V, H]
        self.layers = [LayerWeights.from_tensors(t, cfg) for t in layer_weights]
        for i, layer in enumerate(self.layers):
            layer.window = cfg.layer_window(i)
        self.attention_backend = attention
        d = cfg.head_dim
        rd = cfg.rotary_dim or d  # partial rotary (GLM-4.5, MiniMax-M2): the first rd dims
        self.inv_freq, self.rope_factor = rope_inv_freq(cfg, rd, device)  # [rd/2]
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # [L, 1, rd] (rope)
        self.scale = d**-0.5
        if cfg.is_mla:  # a head's q.k spans its nope and rotary parts
            self.scale = yarn_softmax_scale(cfg, (cfg.qk_nope_head_dim + d) ** -0.5)
        self.q_size = cfg.num_heads * d
        self.kv_size = cfg.num_kv_heads * d
        # the per-layer pieces `layer_segment` calls: these methods, or them compiled
        self.pieces: AttentionModel | CompiledPieces = CompiledPieces(self) if compile else self

    @property
    def weight_bytes(self) -> int:
        """Resident bytes of the weights held (FP8 projections at their released size, scales
        included; a tied LM head once)."""
        return held_bytes([self.embed, self.final_norm, self.lm_head, self.layers])

    def rope(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [T, 1, rd]`` for `apply_rope`; ``sin``'s first half is negated, so that
        rotating by half a head (a roll) gives HF's ``rotate_half(x) * sin`` exactly.

        On CPU, rows of a table of every position so far (grown by doubling), gathered: the
        same values (elementwise ops; sin and cos do not depend on where a value sits in the
        tensor) and cheaper than computing them: a gather of rows instead of a sine and a
        cosine per element."""
        if positions.is_cpu and positions.numel():
            cos, sin = self.rope_table(int(positions.max()), dtype)
            if cos.dtype == dtype:
                return cos.index_select(0, positions), sin.index_select(0, positions)
        cos, sin = rope_rows(self.inv_freq, positions, self.rope_factor)
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def rope_table(self, top: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope`'s CPU table ``cos, sin [n, 1, rd]``, grown (by doubling) to hold position
        ``top``: row p holds position p's values (the first table's dtype stays)."""
        if self._rope_table is None or top >= self._rope_table[0].shape[0]:
            n = max(2 * (top + 1), 1024)
            cos, sin = rope_rows(self.inv_freq, torch.arange(n), self.rope_factor)
            self._rope_table = (cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :])
        return self._rope_table

    @staticmethod
    def apply_rope(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``x [T, heads, d]`` rotated (HF's ``x * cos + rotate_half(x) * sin``). With partial
        rotary (``cos, sin [.., rd]``, rd < d) only the first rd dims of each head rotate, as
        one half-split rotation of their own; the rest pass through (HF's ``q_rot, q_pass``)."""
        cos, sin = cos_sin
        rd = cos.shape[-1]
        if rd < x.shape[-1]:
            rot, keep = x[..., :rd], x[..., rd:]
            return torch.cat([rot * cos + rot.roll(rd // 2, -1) * sin, keep], dim=-1)
        return x * cos + x.roll(x.shape[-1] // 2, -1) * sin

    def route(self, layer: LayerWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids and weights ``[T, k]`` (`splitmoe.models.routing`)."""
        return routing.route(self.cfg, layer.router, layer.router_bias, x, layer.router_logit_bias)

    def attention_inputs(
        self, layer: LayerWeights, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        """What the paged-attention kernel reads of ``x [T, H]``: ``q, k, v [T, heads, d]``
        (projected, normed, rotated), or under MLA the absorbed queries ``[T, nh, Lr + R]`` and
        the new latent rows ``[T, Lr + R]`` (`mla_inputs`)."""
        if layer.mla is not None:
            return self.mla_inputs(layer, x, cos_sin)
        cfg = self.cfg
        T = x.shape[0]
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = _proj(x, layer.w_qkv, layer.b_qkv)  # [T, (nh + 2 nkv) d]
        if cfg.qk_norm == "full" or cfg.clip_qkv is not None:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            if cfg.qk_norm == "full":
                q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
                k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
            if cfg.clip_qkv is not None:
                q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
            qkv = torch.cat([q, k, v], dim=-1)
        qkv = qkv.view(T, nh + 2 * nkv, d)
        qk = qkv[:, : nh + nkv]  # q and k heads, normed and rotated together
        if cfg.qk_norm == "head":
            qk = rms_norm(qk, None, cfg.rms_norm_eps) * layer.qk_head_norm
        qk = self.apply_rope(qk, cos_sin)
        return qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv :]

    def attention_kernel(
        self,
        layer: LayerWeights,
        inputs: tuple[torch.Tensor, ...],
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The attention backend's part: the new tokens' keys and values (or latent rows) into
        the paged cache, attention over it: ``[T, heads, d]`` (under MLA ``[T, nh, Lr]``).
        Never compiled: its metadata (per-sequence lengths, block tables) changes every step."""
        if layer.mla is not None:
            q_abs, latent = inputs
            self.attention_backend.store_latent(latent, kv[0], meta.slot_mapping)
            return self.attention_backend.attend_mla(
                q_abs, kv[0], meta, self.scale, self.cfg.kv_lora_rank
            )
        q, k, v = inputs
        k_cache, v_cache = kv
        self.attention_backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attention_backend.attend(
            q, k_cache, v_cache, meta, self.scale, sinks=layer.sinks, window=layer.window
        )

    def attention_output(self, layer: LayerWeights, o: torch.Tensor) -> torch.Tensor:
        """``[T, H]``: the attention's output ``o`` projected (under MLA, each head's value
        up-projection first)."""
        T = o.shape[0]
        if layer.mla is not None:
            o = torch.bmm(o.transpose(0, 1), layer.mla.w_uv_t)  # [nh, T, v]
            o = o.transpose(0, 1).reshape(T, self.cfg.num_heads * self.cfg.v_head_dim)
            return _proj(o, layer.o_proj, layer.mla.o_bias)
        return _proj(o.reshape(T, self.q_size), layer.o_proj, layer.o_bias)

    def attention(
        self,
        layer: LayerWeights,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``[T, H]``: the attention block of ``x [T, H]`` (normed), its new keys and values
        stored in ``kv``."""
        o = self.attention_kernel(layer, self.attention_inputs(layer, x, cos_sin), kv, meta)
        return self.attention_output(layer, o)

    def mla_inputs(
        self, layer: LayerWeights, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Multi-head latent attention in the absorbed form (`splitmoe.attention_nodes.mla`):
        the absorbed queries ``[T, nh, Lr + R]`` and the new tokens' latent rows
        ``[T, Lr + R]`` that `attention_kernel` stores into the cache ``[blocks, block_size, 1,
        Lr + R]`` and attends over."""
        cfg, w = self.cfg, layer.mla
        T = x.shape[0]
        nh, nope, R, Lr = cfg.num_heads, cfg.qk_nope_head_dim, cfg.head_dim, cfg.kv_lora_rank
        eps = cfg.rms_norm_eps
        if w.q_a is not None:
            x_q = rms_norm(_proj(x, w.q_a, w.q_a_bias), w.q_a_norm, eps)
        else:
            x_q = x
        q = _proj(x_q, w.w_q).view(T, nh, nope + R)
        ckv = _proj(x, w.kv_a, w.kv_a_bias)  # [T, Lr + R]
        latent = torch.cat(
            [
                rms_norm(ckv[:, :Lr], w.kv_a_norm, eps),
                self.apply_rope(ckv[:, None, Lr:], cos_sin)[:, 0],
            ],
            dim=-1,
        )  # [T, Lr + R]
        q_lat = torch.bmm(q[:, :, :nope].transpose(0, 1), w.w_uk)  # [nh, T, Lr]
        q_abs = torch.cat(
            [q_lat.transpose(0, 1), self.apply_rope(q[:, :, nope:], cos_sin)], dim=-1
        )  # [T, nh, Lr + R]
        return q_abs, latent

    def start_moe(
        self,
        i: int,
        x: torch.Tensor,
        experts: ExpertExecutor,
        routing: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> _MoeInFlight:
        """Starts layer ``i``'s MoE on ``x`` (``routing``: its top-k ids and weights, when
        already computed)."""
        layer = self.layers[i]
        ids, weights = routing or self.route(layer, x)
        handle = experts.start(i, x, ids, weights)
        shared = None
        if layer.mlp_gate_up is not None:  # the shared expert(s), here while the experts work
            shared = gated_mlp(x, layer.mlp_gate_up, layer.mlp_down)
            if layer.shared_expert_gate is not None:
                shared = torch.sigmoid(F.linear(x, layer.shared_expert_gate)) * shared
        return _MoeInFlight(handle, shared)

    @staticmethod
    def finish_moe(moe: _MoeInFlight, experts: ExpertExecutor) -> torch.Tensor:
        y = experts.finish(moe.handle)
        return y if moe.shared is None else y + moe.shared

    def layer_in(
        self,
        layer: LayerWeights,
        h: torch.Tensor,
        moe_out: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """A layer's compute before the paged attention: the residual stream ``h [T, H]`` with
        the previous layer's MoE output added, and `attention_inputs` of it normed."""
        if moe_out is not None:
            h = h + moe_out
        x = rms_norm(h, layer.input_norm, self.cfg.rms_norm_eps)
        return h, self.attention_inputs(layer, x, cos_sin)

    def layer_out(
        self, layer: LayerWeights, h: torch.Tensor, o: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """A layer's compute after the paged attention (``o``: its output): ``h [T, H]`` with
        the attention (and a dense layer's MLP) added; on MoE layers also the normed input of
        the experts ``x [T, H]`` and its routing (top-k ids and weights ``[T, k]``)."""
        h = h + self.attention_output(layer, o)
        x = rms_norm(h, layer.post_norm, self.cfg.rms_norm_eps)
        if layer.router is None:
            return h + gated_mlp(x, layer.mlp_gate_up, layer.mlp_down), None, None
        return h, x, self.route(layer, x)

    def layer_segment(
        self,
        i: int,
        h: torch.Tensor,
        moe_out: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """Layer ``i`` from its input ``h`` (and the previous layer's MoE output) to where its
        experts start: all of a layer that involves no other rank, the unit a CUDA graph
        captures (`splitmoe.attention_nodes.graphs`). Returns `layer_out`'s triple."""
        layer = self.layers[i]
        h, inputs = self.pieces.layer_in(layer, h, moe_out, cos_sin)
        o = self.attention_kernel(layer, inputs, kv, meta)
        return self.pieces.layer_out(layer, h, o)

    def forward(
        self,
        mbs: Sequence[MicroBatch],
        kv_cache: PagedKVCache,
        experts: ExpertExecutor,
        on_done: Callable[[int, torch.Tensor], None] | None = None,
        segment: Callable[..., tuple] | None = None,
    ) -> list[torch.Tensor]:
        """Final hidden states ``[T_j, H]`` (normed) of each micro-batch.

        Layer by layer, micro-batch by micro-batch (ping-pong): micro-batch j's MoE is started
        after its attention and finished only when its next layer needs it, so the attention of
        micro-batch j+1 runs while the experts work on j. With one micro-batch this is the plain
        sequential forward. ``on_done(j, h_j)`` is called as soon as micro-batch j's output is
        final, so its tokens can be sampled while the experts still work on later micro-batches.
        ``mbs`` is read in order, micro-batch j first when layer 0 reaches it (`execute` builds
        each one's inputs then, the later ones while the experts work on the first).
        ``segment``: what runs each layer's `layer_segment` (a step replayed from CUDA graphs,
        `splitmoe.attention_nodes.graphs.DecodeGraphs.segment`); default `layer_segment`.
        """
        eps = self.cfg.rms_norm_eps
        segment = segment or self.layer_segment
        n = len(mbs)
        hs: list[torch.Tensor] = [None] * n  # [T_j, H]
        rope: list[tuple[torch.Tensor, torch.Tensor]] = [None] * n
        in_flight: list[_MoeInFlight | None] = [None] * n
        for i, layer in enumerate(self.layers):
            kv = kv_cache.layer(i)
            for j, mb in enumerate(mbs):  # (a lazy `mbs` builds micro-batch j only now)
                if i == 0:
                    hs[j] = F.embedding(mb.input_ids, self.embed)
                    rope[j] = self.rope(mb.positions, hs[j].dtype)
                moe_out = None
                if in_flight[j] is not None:
                    moe_out = self.finish_moe(in_flight[j], experts)
                    in_flight[j] = None
                meta = mb.meta if layer.window is None or mb.window_meta is None else mb.window_meta
                hs[j], x, routing = segment(i, hs[j], moe_out, rope[j], kv, meta)
                if routing is not None:
                    in_flight[j] = self.start_moe(i, x, experts, routing)
        for j, moe in enumerate(in_flight):
            if moe is not None:
                hs[j] = hs[j] + self.finish_moe(moe, experts)
            hs[j] = rms_norm(hs[j], self.final_norm, eps)
            if on_done is not None:
                on_done(j, hs[j])
        return hs

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[B, V]`` float32."""
        return linear(h.contiguous(), self.lm_head).float()
