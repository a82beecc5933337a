"""Kernel choice on CPU by measurement: the first calls of a shape class time the candidates.

Where the CPU path has several kernels for one op (`fused_moe_cpu`'s GEMM layouts, oneDNN or
MKL in `linear`), which one is fastest depends on the CPU's vendor, vector width, matrix units,
caches and thread count: a rule tuned on one machine picked the slowest of three MoE layouts on
another. So nothing here is a constant. A `KernelChoice` is one op's decision per *shape class*
(a tuple the caller buckets, e.g. rows rounded up to a power of two and the weight's shape, plus
the dtype and torch's thread count). The first call of a class runs every candidate on the real
tensors (a warm-up, and a check that they agree); the next calls each run one candidate in turn
in place of the kernel, timed where it runs in the model step; once each has a few timings the
one of the lowest median is kept, and every later call of the class runs it alone.

A call during which the process lost a core is not judged by its time: a thread descheduled
for a scheduler tick (4 ms at 250 Hz) makes a 0.3 ms GEMM look 30 ms, and a choice made of such
timings once kept a 90x slower GEMM in the file for good. Such a call is one during which the
process's count of involuntary context switches moved (`getrusage`) *and* its threads ran for
less than all but half a thread's share of the call (CPU time against ``threads x wall``): a
preemption of a few microseconds, which most multi-millisecond calls see, does not count. The
call runs (its output is used), but only calls that kept their cores count as timings. A
candidate that got none in `KernelChoice.max_rounds` calls (cores that stay contended: ranks
sharing them) is judged on the others, and that decision is kept in memory only.

Decisions are kept in memory and in a JSON file shared by all ops and processes,
``$SPLITMOE_CACHE_DIR/cpu_kernels-4.json`` (default ``~/.cache/splitmoe/``; the variable moves the
file and switches nothing else), keyed by the CPU model, torch version, the native kernels'
sources, thread count, dtype, op and shape class (`choice_key`): a later process on the same
machine measures nothing; a new version of a kernel is measured again. Each rank
decides on its own. The file is written atomically (a temporary file renamed over it); a
corrupt or unwritable file is ignored with one warning. Delete it to measure again.

The candidates must compute the same math. In float32 they agree to rounding, not bit for bit
(a GEMM's summation order differs between MKL's and oneDNN's kernels and between operand
layouts: ~1e-6 relative); a candidate whose output differs from the first candidate's by more
than a rounding tolerance (1e-4 of the output's scale in float32, 5e-2 in 16 bits) is dropped
with a warning, and so is one that raises (a library without a kernel for the dtype on this
CPU). While a class is on trial (its first few calls in the first process on a
machine) its calls run different candidates; once it is decided the choice is stable, so a
machine's outputs do not change from one call (or process) to the next.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import resource
import statistics
import tempfile
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

# (version 4: the MoE layouts' classes are half an octave wide (`half_octave_bucket`); version
# 3's octaves kept, for 129-256 pairs, a layout timed near 256 that took 1.3-1.5x the best one
# at 132-192. Version 3: version 2 compared each candidate's fastest call, and on a fresh
# AVX-512 host kept a MoE layout 1.5x slower in a step than the one later timings prefer;
# version 1 counted the times of preempted calls)
CACHE_FILE_NAME = "cpu_kernels-4.json"


def involuntary_switches() -> int:
    """Times this process's threads were preempted so far (``ru_nivcsw``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw


def cpuinfo(field: str) -> str:
    """The first ``field`` of ``/proc/cpuinfo`` ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_model() -> str:
    """The CPU's model name: ``/proc/cpuinfo``'s "model name", else ``platform.processor()``."""
    return cpuinfo("model name") or platform.processor() or platform.machine() or "unknown cpu"


def cache_dir() -> Path:
    """``$SPLITMOE_CACHE_DIR``, else ``~/.cache/splitmoe``."""
    env = os.environ.get("SPLITMOE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "splitmoe"


def choice_key(
    op: str,
    shape: tuple,
    dtype: torch.dtype,
    threads: int,
    cpu: str,
    torch_version: str,
    kernels: str,
) -> str:
    """The cache file's key of one decision: everything a kernel's speed depends on here
    (``kernels``: `native_sources_digest`)."""
    dt = str(dtype).removeprefix("torch.")
    shape_s = ",".join(str(s) for s in shape)
    return (
        f"cpu={cpu}|torch={torch_version}|kernels={kernels}|threads={threads}|dtype={dt}|"
        f"op={op}|shape={shape_s}"
    )


@functools.cache
def native_sources_digest() -> str:
    """A digest of splitmoe's native kernels' sources (``kernels/*.c``, ``*.h``): a decision
    made against one version of a kernel says nothing about the next."""
    here = Path(__file__).parent
    h = hashlib.sha256()
    for p in sorted([*here.glob("*.c"), *here.glob("*.h")]):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:12]


@dataclass(frozen=True)
class Decision:
    """The kernel kept for one shape class, and why: ``ms`` is each candidate's median time
    in milliseconds (over its calls that kept their cores); ``dropped`` the candidates dropped
    for failing or disagreeing; ``source`` is ``"timed"`` (measured by this process), ``"timed
    on contended cores"`` (the same, a candidate judged on calls that lost a core: kept in
    memory only) or ``"cache file"``."""

    choice: str
    ms: dict[str, float]
    source: str
    dropped: tuple[str, ...] = ()


class ChoiceFile:
    """The JSON file of decisions, ``{choice_key: {"choice": name, "ms": {name: ms}}}``.

    Read once, at the first lookup; each new decision re-reads it (another rank may have
    added some), adds its own and writes it back atomically. Any failure to read or write
    leaves the in-memory decisions in charge and warns once."""

    def __init__(self, path: Path | None = None):
        self._path = path
        self._entries: dict[str, Any] | None = None
        self._warned = False

    @property
    def path(self) -> Path:
        return self._path if self._path is not None else cache_dir() / CACHE_FILE_NAME

    def _warn(self, what: str, err: Exception) -> None:
        if not self._warned:
            self._warned = True
            log.warning("kernel choice cache %s %s (%s); choices are kept in memory", self.path,
                        what, err)  # fmt: skip

    def _read(self) -> dict[str, Any]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        except OSError as e:
            self._warn("is unreadable", e)
            return {}
        try:
            entries = json.loads(text)
            if not isinstance(entries, dict):
                raise ValueError(f"a JSON {type(entries).__name__}, not an object")
        except ValueError as e:
            self._warn("is corrupt and ignored", e)
            return {}
        return entries

    def get(self, key: str) -> Decision | None:
        if self._entries is None:
            self._entries = self._read()
        entry = self._entries.get(key)
        try:
            ms = {str(k): float(v) for k, v in entry["ms"].items()}
            dropped = tuple(str(n) for n in entry.get("dropped", ()))
            return Decision(str(entry["choice"]), ms, "cache file", dropped)
        except (TypeError, KeyError, AttributeError, ValueError):
            return None  # absent, or an entry of another shape: measured again

    def put(self, key: str, decision: Decision) -> None:
        entries = self._read()
        entries[key] = {"choice": decision.choice, "ms": decision.ms}
        if decision.dropped:
            entries[key]["dropped"] = list(decision.dropped)
        self._entries = entries
        path = self.path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(entries, f, indent=1, sort_keys=True)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            self._warn("is unwritable", e)


# The file every `KernelChoice` shares unless given another.
DEFAULT_FILE = ChoiceFile()
# every `KernelChoice` of this process (`classes_on_trial`)
_CHOICES: weakref.WeakSet[KernelChoice] = weakref.WeakSet()


def outputs_agree(a: Any, b: Any) -> bool:
    """Whether two candidates' tensors are equal to rounding: within 1e-4 (float32) or 5e-2
    (16-bit) of the output's scale (an element-wise rtol trips on outputs near zero)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    tol = 1e-4 if a.dtype in (torch.float32, torch.float64) else 5e-2
    scale = a.float().abs().max().clamp(min=1.0)
    return bool((a.float() - b.float()).abs().max() <= tol * scale)


@dataclass(eq=False)  # (one chooser is one identity: hashable, for `_CHOICES`)
class KernelChoice:
    """One op's measured choice among interchangeable kernels, per shape class.

    op: the op's name in the cache file's keys;
    rounds: timings of each candidate at least, after the untimed first call of a class;
    budget_s: more timings, up to `max_rounds` of each, while they add up to less than this.
        On a shared machine a thread that loses its core stalls a multi-threaded GEMM for a
        scheduler tick (4 ms at 250 Hz), longer than a decode-sized kernel: calls that lost
        a core are left out, and the median of the rest is robust to the few that a stall or
        a lucky cache state moved, where a best of 3 taken under load on the 2-core dev host
        picked a 2.6x slower MoE layout, and the fastest calls on a fresh AVX-512 host kept
        one 1.5x slower in a step than the layout every later measurement there preferred;
    timer: seconds, ``time.perf_counter`` (tests pass a fake clock);
    switches: the process's involuntary context switches so far (`involuntary_switches`),
    cpu_timer: the process's CPU seconds so far (``time.process_time``, all threads): with
        ``switches``, which calls lost a core (see the module doc; tests pass fakes);
    file: where decisions persist (`DEFAULT_FILE`).
    """

    op: str
    rounds: int = 3
    budget_s: float = 0.05
    max_rounds: int = 20
    timer: Callable[[], float] = time.perf_counter
    switches: Callable[[], int] = involuntary_switches
    cpu_timer: Callable[[], float] = time.process_time
    file: ChoiceFile = field(default_factory=lambda: DEFAULT_FILE)

    def __post_init__(self):
        if self.rounds < 1:
            raise ValueError(f"KernelChoice {self.op!r}: rounds must be >= 1, got {self.rounds}")
        self._memory: dict[tuple, Decision] = {}
        # classes on trial: (shape, dtype, threads) -> {candidate: [(seconds, kept its cores)]}
        self._trials: dict[tuple, dict[str, list[tuple[float, bool]]]] = {}
        self._dropped: dict[tuple, tuple[str, ...]] = {}  # on trial: who failed or disagreed
        self._cpu = cpu_model()
        self._kernels = native_sources_digest()  # (read once: `key` runs inside compiled code)
        _CHOICES.add(self)

    def key(self, shape: tuple, dtype: torch.dtype, threads: int | None = None) -> str:
        """The cache file's key of ``shape`` in ``dtype`` at ``threads`` (torch's now)."""
        threads = torch.get_num_threads() if threads is None else threads
        return choice_key(
            self.op, shape, dtype, threads, self._cpu, torch.__version__, self._kernels
        )

    def decision(self, shape: tuple, dtype: torch.dtype) -> Decision | None:
        """The kept decision of this shape class (memory, then the file), or None."""
        mem_key = (shape, dtype, torch.get_num_threads())
        got = self._memory.get(mem_key)
        if got is None:
            got = self.file.get(self.key(shape, dtype))
            if got is not None:
                self._memory[mem_key] = got
        return got

    def kept(self, shape: tuple, dtype: torch.dtype) -> str | None:
        """The kept candidate's name if this process has decided the class, else None (a
        dict lookup, for callers that build only the candidate they will run)."""
        got = self._memory.get((shape, dtype, torch.get_num_threads()))
        return None if got is None else got.choice

    def run(
        self, shape: tuple, dtype: torch.dtype, candidates: Mapping[str, Callable[[], Any]]
    ) -> Any:
        """Runs one candidate for ``shape`` (in ``dtype``) and returns its output: the kept
        one once the class is decided, else the next one of its trial (`_explore`).
        ``candidates``: name -> a call with no arguments, the first the reference the others
        must agree with. A kept decision naming a kernel not among ``candidates``, or made
        without one of them (a kernel added since), is measured again."""
        mem_key = (shape, dtype, torch.get_num_threads())
        got = self._memory.get(mem_key)
        if got is None:
            got = self.decision(shape, dtype)
        if got is not None:
            if got.choice in candidates and all(
                n in got.ms or n in got.dropped for n in candidates
            ):
                return candidates[got.choice]()
            self._memory.pop(mem_key, None)  # (stale: `kept` offers no choice while on trial)
        if len(candidates) == 1:
            return next(iter(candidates.values()))()
        return self._explore(mem_key, candidates)

    def _explore(self, mem_key: tuple, candidates: Mapping[str, Callable[[], Any]]) -> Any:
        """A call of a class still on trial. The first runs every candidate (a warm-up:
        oneDNN builds its kernel, the threads wake up), drops those that raise (a library
        without a kernel for the dtype on this CPU: oneDNN's bfloat16 inner product needs
        AVX512) or disagree with the first that ran, and returns that one's output (where every
        candidate raises, the first's error is raised). Each later call runs the candidate with
        the fewest timings so far, in place of the kernel the caller would run, and times it:
        in place, because a model step reads other weights between two calls of an op, so a
        kernel whose weights stream from memory is timed streaming them (back-to-back
        repetitions keep a few experts' weights in cache and favour another layout). After
        `rounds` timings of each, and until they add up to `budget_s` or `max_rounds`, the
        fastest median time is kept. Only calls that kept their cores count as timings (see
        the module doc); a candidate that had none in `max_rounds` calls is judged on the
        others, and that decision is kept in memory only."""
        shape = mem_key[0]
        times = self._trials.get(mem_key)
        if times is None:
            outputs, errors = {}, {}
            for name, call in candidates.items():
                try:
                    outputs[name] = call()
                except Exception as e:  # (e.g. oneDNN without a kernel for the dtype on this CPU)
                    errors[name] = e
            if not outputs:  # (every kernel refuses the call: the caller's problem, not theirs)
                raise next(iter(errors.values()))
            for name, e in errors.items():
                log.warning("%s %s: kernel %r failed (%s: %s); not used", self.op, shape, name,
                            type(e).__name__, e)  # fmt: skip
            names = list(outputs)
            for name in names[1:]:
                if not outputs_agree(outputs[names[0]], outputs[name]):
                    log.warning("%s %s: kernel %r disagrees with %r; not used", self.op, shape,
                                name, names[0])  # fmt: skip
                    names.remove(name)
            self._trials[mem_key] = {name: [] for name in names}
            self._dropped[mem_key] = tuple(n for n in candidates if n not in names)
            return outputs[names[0]]

        def clean(n: str) -> list[float]:  # a candidate's times of calls that kept their cores
            return [s for s, ok in times[n] if ok]

        # the candidate with the fewest clean timings (and that has not used up its calls)
        open_ = [n for n in times if len(times[n]) < self.max_rounds] or list(times)
        name = min(open_, key=lambda n: (len(clean(n)), len(times[n])))
        switched, cpu = self.switches(), self.cpu_timer()
        t = self.timer()
        out = candidates[name]()
        elapsed = self.timer() - t
        # preempted, and the process's threads ran for less than all but half a thread's time
        lost = self.switches() != switched and (
            self.cpu_timer() - cpu < (mem_key[2] - 0.5) * elapsed
        )
        times[name].append((elapsed, not lost))
        rounds = min(len(clean(n)) for n in times)
        spent = sum(s for ts in times.values() for s, _ in ts)
        spent_calls = all(len(ts) >= self.max_rounds for ts in times.values())
        if spent_calls or (rounds >= self.rounds and spent >= self.budget_s):
            typical = {n: statistics.median(clean(n) or [s for s, _ in times[n]]) for n in times}
            self._decide(mem_key, typical, contended=any(not clean(n) for n in times))
        return out

    def _decide(self, mem_key: tuple, typical: dict[str, float], contended: bool) -> None:
        shape, dtype, _ = mem_key
        choice = min(typical, key=lambda name: typical[name])
        ms = {n: round(s * 1e3, 4) for n, s in typical.items()}
        source = "timed on contended cores" if contended else "timed"
        decision = Decision(choice, ms, source, self._dropped.pop(mem_key, ()))
        self._memory[mem_key] = decision
        del self._trials[mem_key]
        if not contended:  # (a choice made of stalled timings is not kept for later)
            self.file.put(self.key(shape, dtype), decision)
        log.info("%s %s %s: %s -> %s (%s)", self.op, shape, dtype, ms, choice, source)


def classes_on_trial() -> int:
    """Shape classes that some `KernelChoice` of this process is still timing: while one is,
    its calls run other candidates than the kept one (what a caller that times its own code,
    such as the simulator's calibration, must let settle first)."""
    return sum(len(c._trials) for c in list(_CHOICES))


def pow2_bucket(n: int) -> int:
    """``n`` rounded up to a power of two (0 stays 0): the size part of a shape class."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def half_octave_bucket(n: int) -> int:
    """``n`` rounded up to a power of two or to three quarters of one (1, 2, 3, 4, 6, 8, 12,
    16, ...; 0 stays 0): the size part of a shape class whose candidates' costs cross within an
    octave (the MoE layouts on the AVX-512 EPYC, realistic preset: at 256 pairs a layer the
    three within 8 % of each other, at 132 the weights-on-the-left GEMM 1.5x faster than the
    tokens-on-the-left one, which a class of 129-256 pairs timed near its top had kept)."""
    top = pow2_bucket(n)
    return top * 3 // 4 if n > 2 and n <= top * 3 // 4 else top
