"""Latency-bandwidth cost model of the attention <-> expert exchange, per link class.

A message of ``b`` bytes over a link of class ``c`` (``"intra"``: same node, NVLink;
``"inter"``: across nodes, the network) costs ``alpha_c + b / beta_c`` seconds. A rank's messages
of one class go one after another through that class's link (its NVLink port or its NIC), the two
classes in parallel, and receiving costs as much as sending. A *phase* (one all-to-all, all
messages in flight together) lasts as long as its busiest link:

    phase = max over ranks r, classes c, directions (send, recv) of
            alpha_c * messages(r, c) + bytes(r, c) / beta_c

plus ``phase_s``, a fixed cost per all-to-all call that moves anything (launch, synchronisation),
and a scheme costs the sum of its phases, dispatch (packed rows) and combine (partial sums) both.
Inputs are integer row counts that every rank holds, so every rank computes the same number: the
arithmetic is integer sums, then elementwise IEEE float64 and max, which round identically
everywhere.

Defaults are round figures for an 8-GPU H100 server: NVLink 4 (450 GB/s per direction and GPU,
~80 % of it reached by NCCL all-to-all; ~3 us per message) and one 400 Gb/s InfiniBand NIC per
GPU (50 GB/s, ~90 % reached; ~10 us per message through NCCL's network proxy), and
``phase_s = 0`` (the pure alpha-beta model). `scripts/calibrate_comm.py` measures all three on the
machines at hand and writes a profile that `CostModel.from_file` loads.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

import torch

LINK_CLASSES = ("intra", "inter")  # same node (NVLink) / different nodes (network)


@dataclass(frozen=True)
class LinkProfile:
    """``alpha_s``: seconds per message; ``bytes_per_s``: sustained bandwidth of one rank's link."""

    alpha_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        if not self.alpha_s >= 0:
            raise ValueError(f"alpha_s={self.alpha_s!r} must be >= 0 seconds")
        if not self.bytes_per_s > 0:
            raise ValueError(f"bytes_per_s={self.bytes_per_s!r} must be > 0")

    def time(self, messages: int, nbytes: int) -> float:
        return self.alpha_s * messages + nbytes / self.bytes_per_s


NVLINK4 = LinkProfile(alpha_s=3e-6, bytes_per_s=360e9)
IB_400G = LinkProfile(alpha_s=10e-6, bytes_per_s=45e9)


@dataclass(frozen=True)
class Phase:
    """One all-to-all: ``rows[i, j]`` rows from source rank ``i`` to destination rank ``j``.

    rows: ``[S, D]`` int64 (entries of a rank to itself must be zero: self-copies are free);
    same_node: ``[S, D]`` bool, source and destination share a node (the intra link class).
    """

    rows: torch.Tensor
    same_node: torch.Tensor

    def load(self) -> torch.Tensor:
        """``[4, S + D]`` int64 per rank (senders, then receivers): intra rows, inter rows, intra
        messages, inter messages."""
        intra = self.rows * self.same_node
        sent = self.rows > 0
        intra_msgs = sent & self.same_node
        per_pair = torch.stack([intra, self.rows - intra, intra_msgs, sent ^ intra_msgs])
        return torch.cat([per_pair.sum(2), per_pair.sum(1)], dim=1)


@dataclass(frozen=True)
class CostModel:
    """``intra`` / ``inter``: link profiles within a node and between nodes; ``phase_s``: fixed
    seconds per all-to-all call."""

    intra: LinkProfile = NVLINK4
    inter: LinkProfile = IB_400G
    name: str = "nvlink4+ib400"
    phase_s: float = 0.0
    source: dict = field(default_factory=dict, compare=False)  # how a profile was measured

    # ---- files --------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "intra": asdict(self.intra),
            "inter": asdict(self.inter),
            "phase_s": self.phase_s,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        unknown = set(d) - {"name", "intra", "inter", "phase_s", "source"}
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)} in a link profile")
        return cls(
            intra=LinkProfile(**d["intra"]) if "intra" in d else NVLINK4,
            inter=LinkProfile(**d["inter"]) if "inter" in d else IB_400G,
            name=d.get("name", "custom"),
            phase_s=float(d.get("phase_s", 0.0)),
            source=d.get("source", {}),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> CostModel:
        """Loads a profile written by `to_file` / `scripts/calibrate_comm.py`."""
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_file(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    # ---- evaluation ---------------------------------------------------------------------------
    def link(self, cls: str) -> LinkProfile:
        return self.intra if cls == "intra" else self.inter

    def phase_time(self, phase: Phase, row_bytes: int) -> float:
        return self.phase_times(phase, (row_bytes,))[0]

    def phase_times(self, phase: Phase, row_bytes: tuple[int, ...]) -> list[float]:
        """Seconds of ``phase`` with rows of each size in ``row_bytes`` (one evaluation)."""
        if phase.rows.numel() == 0:
            return [0.0] * len(row_bytes)
        load = phase.load()  # [4, ranks]
        sizes = torch.tensor(row_bytes, dtype=torch.int64)
        nbytes = (load[:2, None, :] * sizes[None, :, None]).to(torch.float64)  # [2, sizes, ranks]
        alpha, beta = self._links
        t = load[2:, None, :] * alpha + nbytes / beta  # [2 classes, sizes, ranks]
        fixed = self.phase_s if self.phase_s and bool(load[2:].any()) else 0.0
        return [v + fixed for v in t.amax(dim=(0, 2)).tolist()]

    @cached_property
    def _links(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``alpha``, ``beta``: ``[2, 1, 1]`` float64 for (intra, inter)."""
        alpha = torch.tensor([self.intra.alpha_s, self.inter.alpha_s], dtype=torch.float64)
        beta = torch.tensor([self.intra.bytes_per_s, self.inter.bytes_per_s], dtype=torch.float64)
        return alpha.view(2, 1, 1), beta.view(2, 1, 1)

    def scheme_time(self, phases: list[Phase], dispatch_bytes: int, combine_bytes: int) -> float:
        """Dispatch runs ``phases`` in order with rows of ``dispatch_bytes``; combine runs them
        backwards with ``combine_bytes`` (the same messages, reversed: same busiest link)."""
        times = [self.phase_times(p, (dispatch_bytes, combine_bytes)) for p in phases]
        total = 0.0
        for d, _ in times:
            total += d
        for _, c in reversed(times):
            total += c
        return total


DEFAULT_COST_MODEL = CostModel()
