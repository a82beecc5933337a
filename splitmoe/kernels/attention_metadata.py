"""Where a step's packed tokens sit in the paged KV cache (`AttentionMetadata`), shared by the
attention kernels of every backend, and the input checks the Triton kernels rely on."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splitmoe.kernels.triton_utils import SUPPORTED_DTYPES


@dataclass
class AttentionMetadata:
    """Where a step's packed tokens sit in the paged KV cache.

    query_start_loc: ``[B+1]`` int64, cumulative query lengths (sequence ``i`` owns rows
        ``query_start_loc[i]:query_start_loc[i+1]`` of ``q``).
    seq_lens: ``[B]`` int64, context length of each sequence *including* this step's tokens.
    block_tables: ``[B, max_blocks]`` int32, KV block ids per sequence (padding beyond a sequence's
        blocks is never read).
    slot_mapping: ``[T]`` int64, flat cache slot (``block * block_size + offset``) per new token.
    query_lens: the same lengths as Python ints, for host-side decisions.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    query_lens: list[int]
    seq_lens_list: list[int]
    # Derived index tensors, built by the first layer that needs them and reused by the others.
    derived: dict = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @classmethod
    def from_lists(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int] | torch.Tensor,
        device: torch.device | str | None = None,
    ) -> AttentionMetadata:
        """The metadata of a step given as Python lists (block table rows of any lengths,
        padded with block 0, which is never read)."""
        width = max(map(len, block_tables), default=0)
        loc = [0]
        for n in query_lens:
            loc.append(loc[-1] + n)
        tables = [t + [0] * (width - len(t)) for t in block_tables]
        return cls(
            query_start_loc=torch.tensor(loc, dtype=torch.int64, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device).view(
                len(tables), width
            ),
            slot_mapping=torch.as_tensor(slot_mapping, dtype=torch.int64, device=device),
            query_lens=list(query_lens),
            seq_lens_list=list(seq_lens),
        )


def check_paged_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    out: torch.Tensor | None = None,
) -> None:
    """What the Triton kernels assume beyond the shapes: dtypes, devices and strides."""
    if out is not None and (
        out.shape != q.shape
        or out.dtype != q.dtype
        or out.device != q.device
        or out.stride(-1) != 1
    ):
        raise ValueError(
            f"paged_attention: out must be like q {tuple(q.shape)} {q.dtype} with contiguous "
            f"head_dim; got {tuple(out.shape)} {out.dtype} strides {out.stride()}"
        )

    if q.dtype not in SUPPORTED_DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"paged_attention: q and the caches must share one of float16/bfloat16/float32; got "
            f"q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}"
        )
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError(
            "paged_attention: head_dim must be contiguous in q and the caches, and both caches "
            f"must share strides; got q {q.stride()}, k_cache {k_cache.stride()}, "
            f"v_cache {v_cache.stride()}"
        )
    B = meta.num_seqs
    bt = meta.block_tables
    if (
        bt.dtype != torch.int32
        or bt.dim() != 2
        or bt.shape[0] != B
        or (bt.numel() and bt.stride(1) != 1)
    ):
        raise ValueError(
            f"paged_attention: block_tables must be int32 [{B}, max_blocks] with contiguous rows; "
            f"got {bt.dtype} {tuple(bt.shape)} strides {bt.stride()}"
        )
    for name, t, n in (
        ("query_start_loc", meta.query_start_loc, B + 1),
        ("seq_lens", meta.seq_lens, B),
    ):
        if t.dtype not in (torch.int32, torch.int64) or t.shape != (n,) or t.stride(0) != 1:
            raise ValueError(
                f"paged_attention: {name} must be a contiguous int32/int64 [{n}] tensor; "
                f"got {t.dtype} {tuple(t.shape)}"
            )
    for name, t in (
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("block_tables", bt),
        ("query_start_loc", meta.query_start_loc),
        ("seq_lens", meta.seq_lens),
    ):
        if t.device != q.device:
            raise ValueError(f"paged_attention: {name} is on {t.device}, q on {q.device}")
