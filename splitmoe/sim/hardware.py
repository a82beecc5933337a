"""Hardware profiles: what one rank's device can do, what a step costs the host, and the links.

A profile is a small JSON file (``splitmoe/sim/profiles/{h100,h200,cpu}.json``, or one written by
``scripts/calibrate_cpu.py``). Three groups of numbers:

* **roofline**: ``peak_flops`` (dense GEMM FLOP/s in the serving dtype) and ``mem_bytes_per_s``
  (HBM, or DRAM per core on a CPU), each with the fraction a real kernel reaches;
* **host overheads** (`Overheads`): seconds that do not scale with FLOPs or bytes — kernel
  launches and Python per layer, per sequence and per activated expert, the step's fixed cost,
  and the fixed latency of one collective call (gloo on a CPU, NCCL's launch on a GPU). On a GPU
  serving with CUDA graphs they are small; on this CPU they dominate;
* **links**: a `splitmoe.comm.cost_model.CostModel` (per-message alpha and bandwidth beta within
  and across nodes) — the same model the adaptive transport decides with, not a second one.

``cores`` models contention where ranks share a host's cores (this machine: more ranks than
cores); ``None`` means every rank owns its device (a GPU per rank).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from splitmoe.comm.cost_model import CostModel

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


# `Overheads`' measured curves: points (count, seconds), linear between them
CURVES = ("seqs_layer_s", "pairs_layer_s", "head_rows_s")


def _along(points: tuple[tuple[float, float], ...], x: float) -> float:
    """The curve through ``(0, 0)`` and ``points`` at ``x``: linear between the points, and
    along the last segment past the last one, never below 0 seconds (a falling last segment:
    the pairs' cost where a prefill's GEMMs run near the roofline)."""
    i = next((i for i, (n, _) in enumerate(points) if x <= n), len(points) - 1)
    (x0, y0), (x1, y1) = (((0.0, 0.0),) + points)[i : i + 2]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class Overheads:
    """Host-side seconds, independent of FLOPs and bytes.

    step_s: per step (scheduling, sampling, the per-step control all-gather, streaming out);
    seq_step_s: per sequence in a step (building inputs, sampling, bookkeeping);
    attn_layer_s: per layer on an attention rank (norms, projections, RoPE, router: op launches);
    seq_layer_s: per sequence and layer of attention (paged-KV gathers; zero for a batched kernel);
    seqs_layer_s: where measured (the CPU calibration), the per-layer attention cost of ``n``
        sequences beyond ``attn_layer_s`` as points ``(n, seconds)``, linear between them (from
        ``(0, 0)``) and along the last two beyond, in place of ``seq_layer_s * n``: on a CPU the
        cost is concave at small batches (each of the first few sequences adds several times what a
        later one adds) and steps where the kernels' size classes do (both ends of each class are
        measured); empty on the GPU profiles;
    prefill_seq_layer_s: extra per prefill chunk and layer (chunks are computed one by one);
    moe_layer_s: per MoE layer where experts run (sort, scatter, launches);
    expert_s: per activated expert and layer (one GEMM pair per expert on the reference path;
        ~0 for one grouped-GEMM kernel);
    pair_s: per (token, expert) pair an expert rank computes, per layer, beyond the roofline:
        gathering and scattering its rows, and GEMMs of a few rows running below the peak that
        a large square GEMM measures (0 where the roofline's efficiencies already hold);
    pairs_layer_s: where measured (the CPU calibration), the experts' per-layer cost of ``p``
        pairs beyond ``moe_layer_s`` and ``expert_s`` each, as points ``(p, seconds)`` read as
        ``seqs_layer_s`` is, in place of ``pair_s * p``: it steps where the kernels' classes of
        pairs do, and the per-pair cost of a decode step's few rows per expert is all but gone
        from a prefill's many (``pair_s`` fitted on decode-sized calls charges a prefill's
        pairs more than twice what they take); empty on the GPU profiles;
    head_rows_s: where measured (the CPU calibration), what the LM head and greedy sampling of
        one micro-batch of ``r`` rows cost, as points ``(r, seconds)`` read as ``seqs_layer_s``
        is, in place of the head's roofline GEMM: the runtime samples each micro-batch when it
        is done, and a head of 5 or 6 rows costs what one of 8 does (its GEMM's kernel class);
        empty on the GPU profiles;
    collective_s: one collective call between ``w`` ranks costs
        ``collective_s[min(w, len) - 1] + collective_slope_s * max(0, w - len)`` (index 0: w = 1);
    wake_s: where rank processes outnumber the cores (`contention` > 1), the latency of waking
        one rank that sleeps waiting for an exchange (the OS waking a process; the transport's
        waits spin instead while a rank has a core of its own; on a GPU, a kernel polls: 0);
    proc_step_s: per step when an instance runs more than one rank process (the driver
        scheduling, broadcasting the step and collecting the tokens from separate processes; a
        single rank runs in the driver's process; 0 on the GPU profiles, whose ranks are driven
        by their own processes anyway);
    busy_attention_step_s: there, per step and attention rank after the first with sequences:
        the step waits for the slowest of the ranks with work, whose step times each vary (an
        idle one is at the all-gather first). What two colocated ranks add beyond their
        components does not grow with the sequences, and the front end's own work per sequence
        is microseconds: a cost per step, not per sequence; 0 on the GPU profiles;
    proc_seq_step_s: per sequence and step where the experts are in other rank processes
        (attention-FFN disaggregation: each sequence's rows go through the expert ranks and
        back at every layer); 0 on the GPU profiles;
    empty_micro_batch_s: per layer and empty micro-batch (fewer sequences than micro-batches) on
        a colocated rank: the runtime still runs every op of its layer loop on zero rows, with no
        exchange to hide it behind (an AF attention rank runs it while it waits for the other
        micro-batch's experts: hidden); 0 on the GPU profiles;
    shared_step_s: per step and rank process where rank processes outnumber the cores
        (`HardwareProfile.contention` > 1): the step's boundary (the control all-gather, tokens
        out to the driver, the next step's start) wakes each sleeping rank; 0 on the GPU
        profiles;
    shared_attention_step_s: what each attention rank after the first adds to the step
        boundary there (it samples and trades tokens and requests with the driver, one more
        process on the cores, while the rest of the instance waits; an expert rank only joins
        the all-gather, and one attention rank's share is in ``shared_step_s``). What 2A+1E's
        decode steps take beyond 1A+2E's constants does not grow with the sequences, and is
        smaller with two micro-batches than with one: a cost per step, not per exchange; 0 on
        the GPU profiles;
    """

    step_s: float = 0.0
    seq_step_s: float = 0.0
    attn_layer_s: float = 0.0
    seq_layer_s: float = 0.0
    seqs_layer_s: tuple[tuple[float, float], ...] = ()
    prefill_seq_layer_s: float = 0.0
    moe_layer_s: float = 0.0
    expert_s: float = 0.0
    pair_s: float = 0.0
    pairs_layer_s: tuple[tuple[float, float], ...] = ()
    head_rows_s: tuple[tuple[float, float], ...] = ()
    collective_s: tuple[float, ...] = (0.0,)
    collective_slope_s: float = 0.0
    wake_s: float = 0.0
    proc_step_s: float = 0.0
    busy_attention_step_s: float = 0.0
    proc_seq_step_s: float = 0.0
    empty_micro_batch_s: float = 0.0
    shared_step_s: float = 0.0
    shared_attention_step_s: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "collective_s", tuple(float(x) for x in self.collective_s))
        for name in CURVES:
            points = tuple((float(n), float(t)) for n, t in getattr(self, name))
            object.__setattr__(self, name, points)
            if any(b[0] <= a[0] for a, b in zip(((0.0, 0.0),) + points, points)):
                raise ValueError(f"{name}={points!r}: the counts must rise from above 0")
            if any(not t >= 0 for _, t in points):
                raise ValueError(f"overhead {name}={points!r} must be >= 0 seconds")
        for f in fields(self):
            v = getattr(self, f.name)
            vals = v if isinstance(v, tuple) else (v,)
            if f.name not in CURVES and (not vals or any(not x >= 0 for x in vals)):
                raise ValueError(f"overhead {f.name}={v!r} must be >= 0 seconds")

    def seqs_layer(self, seqs: float) -> float:
        """Seconds a layer of attention costs for ``seqs`` sequences beyond ``attn_layer_s``:
        ``seqs_layer_s`` interpolated where measured, else ``seq_layer_s`` each."""
        if not self.seqs_layer_s:
            return self.seq_layer_s * seqs
        return _along(self.seqs_layer_s, seqs)

    def pairs_layer(self, pairs: float) -> float:
        """Seconds a layer's experts cost for ``pairs`` (token, expert) pairs beyond
        ``moe_layer_s`` and ``expert_s`` each: ``pairs_layer_s`` interpolated where measured,
        else ``pair_s`` each."""
        if not self.pairs_layer_s:
            return self.pair_s * pairs
        return _along(self.pairs_layer_s, pairs)

    def head(self, rows: float) -> float:
        """Seconds of one micro-batch's LM head and sampling over ``rows`` rows, along
        ``head_rows_s`` (0 rows: 0)."""
        return _along(self.head_rows_s, rows) if rows > 0 else 0.0

    def collective(self, world: int) -> float:
        """Fixed seconds of one collective call over ``world`` ranks (0 for a single rank)."""
        if world <= 1:
            return 0.0
        table = self.collective_s
        if world <= len(table):
            return table[world - 1]
        return table[-1] + self.collective_slope_s * (world - len(table))


@dataclass(frozen=True)
class HardwareProfile:
    """One rank's device, its host overheads, and the links between ranks (see the module doc).

    peak_flops: dense GEMM FLOP/s at ``weight_bytes`` per parameter (bf16 on GPUs, fp32 on CPU);
    fp8_flops: FP8 GEMM FLOP/s (0: no FP8; weights in FP8 then run at ``peak_flops``);
    mem_bytes_per_s: device memory bandwidth; memory_bytes: device memory capacity;
    flops_efficiency / mem_efficiency: fraction of peak that real kernels reach;
    gpus_per_node: ranks that share the fast (``intra``) link;
    cores: ranks that can compute at once on one host (None: a device per rank, no contention);
    oversubscribed: the slow-down of every rank's compute once more rank processes than
        ``cores`` share the host (each holds a core while it computes or polls a peer, so the
        OS time-slices them: one factor, the same however many processes exceed ``cores``);
    cache_bytes: the host's last-level cache (this machine: read from sysfs); a model whose
        weights all fit stays there between uses, and its kernels' weight reads are not bound by
        ``mem_bytes_per_s`` (0: not modelled, as on the GPU profiles, whose models are far
        larger than an L2);
    a2a_fixed_s: fixed seconds of one GPU-initiated dispatch or combine call (DeepEP low-latency,
        StepMesh, MegaScale-Infer's M2N: launch, signalling, one network round trip), the
        ``gpu_a2a`` transport's per-call cost beside its bytes over the links.
    """

    name: str
    peak_flops: float
    mem_bytes_per_s: float
    memory_bytes: float
    gpus_per_node: int
    flops_efficiency: float = 0.6
    mem_efficiency: float = 0.8
    fp8_flops: float = 0.0
    weight_bytes: int = 2
    cores: float | None = None
    oversubscribed: float = 1.0
    cache_bytes: float = 0.0
    a2a_fixed_s: float = 30e-6
    overheads: Overheads = field(default_factory=Overheads)
    links: CostModel = field(default_factory=CostModel)
    description: str = ""
    source: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("peak_flops", "mem_bytes_per_s", "memory_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{self.name}: {name}={getattr(self, name)!r} must be > 0")
        for name in ("flops_efficiency", "mem_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{self.name}: {name} must be in (0, 1]")
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"{self.name}: gpus_per_node must be an integer >= 1")
        if self.cores is not None and not self.cores > 0:
            raise ValueError(f"{self.name}: cores={self.cores!r} must be None or > 0")
        if not self.oversubscribed >= 1:
            raise ValueError(f"{self.name}: oversubscribed={self.oversubscribed!r} must be >= 1")

    def gemm_s(self, flops: float, nbytes: float, fp8: bool = False) -> float:
        """Roofline seconds of a kernel doing ``flops`` and moving ``nbytes``."""
        peak = self.fp8_flops if fp8 and self.fp8_flops else self.peak_flops
        return max(
            flops / (peak * self.flops_efficiency),
            nbytes / (self.mem_bytes_per_s * self.mem_efficiency),
        )

    def contention(self, busy_ranks: int) -> float:
        """Slow-down of each of ``busy_ranks`` rank processes on one host: 1 while they have a
        core each, ``oversubscribed`` beyond."""
        if self.cores is None or busy_ranks <= self.cores:
            return 1.0
        return self.oversubscribed

    # ---- files --------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["overheads"] = asdict(self.overheads)
        d["overheads"]["collective_s"] = list(self.overheads.collective_s)
        d["links"] = self.links.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> HardwareProfile:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)} in hardware profile {d.get('name')}")
        d = dict(d)
        oh = dict(d.get("overheads", {}))
        bad = set(oh) - {f.name for f in fields(Overheads)}
        if bad:
            raise ValueError(f"unknown overheads {sorted(bad)} in hardware profile {d.get('name')}")
        if "collective_s" in oh:
            oh["collective_s"] = tuple(oh["collective_s"])
        d["overheads"] = Overheads(**oh)
        d["links"] = CostModel.from_dict(d["links"]) if "links" in d else CostModel()
        return cls(**d)

    def to_file(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A profile by name (``"h100"``, ``"h200"``, ``"cpu"``) or from a JSON file's path."""
    path = Path(name_or_path)
    if not path.is_file():
        path = PROFILE_DIR / f"{str(name_or_path).lower()}.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"no hardware profile {str(name_or_path)!r}: use one of {available_profiles()} or "
            "the path of a JSON profile (scripts/calibrate_cpu.py writes one)"
        )
    return HardwareProfile.from_dict(json.loads(path.read_text()))
