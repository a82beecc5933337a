"""Kernel choice on CPU by measurement, settled before the first request.

Where the CPU path has several kernels for one op (`fused_moe_cpu`'s GEMM layouts, oneDNN or
MKL in `linear`), which one is fastest depends on the CPU's vendor, vector width, matrix units,
caches and thread count: a rule tuned on one machine picked the slowest of three MoE layouts on
another. So nothing here is a constant. A `KernelChoice` is one op's decision per *shape class*
(a tuple the caller buckets, e.g. rows rounded up to a power of two and the weight's shape, plus
the dtype and torch's thread count).

Classes are decided before serving, never on a request: `settle` takes `Trial`s (one shape
class each, with a builder of the op's candidates on synthetic inputs of the class's real
shapes: the rank's own weights, made-up activations) and `KernelChoice.measure` times them
there. Each candidate runs once (a warm-up, and a check that they agree), then they run in turn,
timed, each call on the next of the trial's variants (another layer's weights: a model step
reads other weights between two calls of an op, so a kernel whose weights stream from memory is
timed streaming them); once each has `KernelChoice.rounds` timings, and more up to
`KernelChoice.budget_s` or `KernelChoice.max_rounds`, the one of the lowest median is kept.
While serving, `KernelChoice.run` runs the kept candidate, or, for a class no one decided (not
met by the settle step, or left over when its time budget ran out), the *default*: the first
candidate the caller offers, which is each op's reference (MKL's ``F.linear``, the per-expert
MoE GEMMs, SDPA), the one every other candidate is checked against and the one that runs
everywhere. It never times anything, so a class's outputs are the same from its first call on.

A call during which the process lost a core is not judged by its time: a thread descheduled
for a scheduler tick (4 ms at 250 Hz) makes a sub-millisecond GEMM look ten times slower or
more, and a choice made of such timings would keep a much slower GEMM in the file for good.
Such a call is one during which the process's count of involuntary context switches moved
(`getrusage`) *and* its threads ran for less than all but half a thread's share of the call (CPU
time against ``threads x wall``): a preemption of a few microseconds, which most multi-millisecond
calls see, does not count. Only calls that kept their cores count as timings. A candidate that got
none in `KernelChoice.max_rounds` calls (cores that stay contended: ranks sharing them) is judged on
the others, and that decision is kept in memory only.

Decisions are kept in memory and in a JSON file shared by all ops and processes,
``$SPLITMOE_CACHE_DIR/cpu_kernels-4.json`` (default ``~/.cache/splitmoe/``; the variable moves the
file and switches nothing else), keyed by the CPU model, torch version, the native kernels'
sources, thread count, dtype, op and shape class (`choice_key`): a later process on the same
machine measures nothing; a new version of a kernel is measured again. Each rank
decides on its own. The file is written atomically (a temporary file renamed over it); a
corrupt or unwritable file is ignored with one warning. Delete it to measure again, or run
``splitmoe tune-cpu`` (`splitmoe.tune_cpu`), which measures every class again, longer.

The candidates must compute the same math. In float32 they agree to rounding, not bit for bit
(a GEMM's summation order differs between MKL's and oneDNN's kernels and between operand
layouts: ~1e-6 relative); a candidate whose output differs from the first candidate's by more
than a rounding tolerance (1e-4 of the output's scale in float32, 5e-2 in 16 bits) is dropped
with a warning, and so is one that raises (a library without a kernel for the dtype on this
CPU).

The public API: `KernelChoice` (``run`` for the kernels, ``measure`` and ``decision`` for
`settle` and the tools), `Trial`, `settle` and its `SettleReport`, `Decision`, the buckets of
the shape classes (`pow2_bucket`, `half_octave_bucket`, `class_middles`) and the file
(`ChoiceFile`, `choice_key`). Code outside `splitmoe.kernels` settles through
`splitmoe.kernels.settle` and reads decisions through the ops' own helpers
(`fused_moe.cpu_moe_decision`, `linear.linear_decision`).
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

# (the number changes with what a decision means, so that a file of older decisions is not
# read: here the MoE layouts' classes are half an octave wide (`half_octave_bucket`), and a
# decision is the lowest median over calls that kept their cores)
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

    def covers(self, names) -> bool:
        """Whether this decision chose among ``names``: its choice is one of them and each was
        timed or dropped (a kernel added since, e.g. a native layout, is measured again)."""
        return self.choice in names and all(n in self.ms or n in self.dropped for n in names)


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

    def refresh(self) -> None:
        """Forgets what was read: the next lookup reads the file again (another process may
        have added decisions since)."""
        self._entries = None

    @contextlib.contextmanager
    def turn(
        self, deadline: float | None = None, timer: Callable[[], float] = time.perf_counter
    ) -> Iterator[bool]:
        """This machine's turn to measure: an exclusive ``flock`` on a file beside this one,
        so that processes sharing the file (the ranks of one host) measure one after another,
        not slowing each other's timings down, and each finds what those before it decided
        (`refresh`). Waits until ``deadline`` (on ``timer``'s clock; None: as long as it
        takes); yields whether it got the turn (False: the deadline came first, or no lock can
        be made here). Closing the file, or the process ending, gives the turn back."""
        try:
            import fcntl

            lock = self.path.with_name(self.path.name + ".lock")
            lock.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except (ImportError, OSError):
            yield False
            return
        try:
            got = False
            while not got:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    got = True
                except OSError:
                    if deadline is not None and timer() >= deadline:
                        break
                    time.sleep(0.01)
            yield got
        finally:
            os.close(fd)


# The file every `KernelChoice` shares unless given another.
DEFAULT_FILE = ChoiceFile()
# every `KernelChoice` of this process (`defaulted_classes`)
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


# A candidate's calls: name -> a call with no arguments (the first is the reference).
Candidates = Mapping[str, Callable[[], Any]]


@dataclass(eq=False)  # (one chooser is one identity: hashable, for `_CHOICES`)
class KernelChoice:
    """One op's measured choice among interchangeable kernels, per shape class.

    op: the op's name in the cache file's keys;
    rounds: timings of each candidate at least, after its untimed first call (`measure`);
    budget_s: more timings, up to `max_rounds` of each, while they add up to less than this.
        On a shared machine a thread that loses its core stalls a multi-threaded GEMM for a
        scheduler tick (4 ms at 250 Hz), longer than a decode-sized kernel: calls that lost
        a core are left out, and the median of the rest is robust to the few that a stall or
        a lucky cache state moved, where a best of a few taken under load can pick a much
        slower MoE layout;
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
        # classes met by `run` that no one decided: (shape, dtype, threads), each runs its default
        self._defaulted: set[tuple] = set()
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
        """The kept candidate's name if this process has a decision for the class in memory,
        else None (a dict lookup, for callers that build only the candidate they will run)."""
        got = self._memory.get((shape, dtype, torch.get_num_threads()))
        return None if got is None else got.choice

    def run(self, shape: tuple, dtype: torch.dtype, candidates: Candidates) -> Any:
        """Runs one candidate for ``shape`` (in ``dtype``) and returns its output: the kept one
        (memory, else the file: a decision of an earlier start or of ``splitmoe tune-cpu``),
        else the first of ``candidates``, the reference, for good (the class's default: it is
        remembered as such until a `measure`). Never times anything and never runs another
        candidate: what runs for a class is the same at every call. A kept choice that is not
        among ``candidates`` (a kernel that does not take these inputs) runs the default."""
        mem_key = (shape, dtype, torch.get_num_threads())
        got = self._memory.get(mem_key)
        if got is None and mem_key not in self._defaulted:
            got = self.file.get(self.key(shape, dtype))
            if got is not None:
                self._memory[mem_key] = got
            else:
                self._defaulted.add(mem_key)
                log.info("%s %s %s: not settled; runs the default %r", self.op, shape, dtype,
                         next(iter(candidates)))  # fmt: skip
        if got is not None and got.choice in candidates:
            return candidates[got.choice]()
        return next(iter(candidates.values()))()

    def defaulted(self) -> list[tuple]:
        """The classes ``(shape, dtype, threads)`` `run` met undecided (each ran its default)."""
        return sorted(self._defaulted, key=repr)

    def measure(
        self,
        shape: tuple,
        dtype: torch.dtype,
        variants: Candidates | list[Candidates],
        *,
        deadline: float | None = None,
        fresh: bool = False,
        budget_s: float | None = None,
        max_rounds: int | None = None,
    ) -> Decision | None:
        """Decides ``shape`` (in ``dtype``) by timing its candidates now, and keeps the decision
        (in memory; in the file too unless the cores were contended). ``variants``: the
        candidates (name -> a call with no arguments, the first the reference the others must
        agree with), or a list of such mappings, the same class on other inputs (another
        layer's weights), whose timed calls go round them. A decision already kept that
        `Decision.covers` the candidates is returned as it is, unless ``fresh``.

        Each candidate runs once (untimed: oneDNN builds its kernel, the threads wake up);
        those that raise (a library without a kernel for the dtype on this CPU: oneDNN's
        bfloat16 inner product needs AVX512) or disagree with the first that ran are dropped
        (where every candidate raises, the first's error is raised). Then the candidate with
        the fewest timings runs, timed, call after call, until each has `rounds` timings and
        they add up to ``budget_s`` (default `budget_s`), or each had ``max_rounds`` calls
        (default `max_rounds`); the lowest median time wins. Only calls that kept their cores
        count as timings (see the module doc). ``deadline`` (on `timer`'s clock): past it
        the class is decided on what it has if each candidate has `rounds` timings, else it
        is left undecided (None: its calls run the default); so it is as soon as the calls so
        far tell that those timings would end past it, leaving the time to cheaper classes."""
        variants = [variants] if isinstance(variants, Mapping) else list(variants)
        names = list(variants[0])
        mem_key = (shape, dtype, torch.get_num_threads())
        if not fresh:
            got = self.decision(shape, dtype)
            if got is not None and got.covers(names):
                return got
        budget_s = self.budget_s if budget_s is None else budget_s
        max_rounds = self.max_rounds if max_rounds is None else max_rounds

        def late() -> bool:
            return deadline is not None and self.timer() >= deadline

        tried = self._try_each(shape, variants[0], late)
        if tried is None:
            return None
        alive, first = tried
        dropped = tuple(n for n in names if n not in alive)
        times: dict[str, list[tuple[float, bool]]] = {name: [] for name in alive}

        def clean(n: str) -> list[float]:  # a candidate's times of calls that kept their cores
            return [s for s, ok in times[n] if ok]

        def hopeless() -> bool:  # `rounds` timings of each cannot be had before the deadline
            need = 0.0
            for n in times:
                short = self.rounds - len(clean(n))
                if short > 0:
                    need += short * statistics.median([s for s, _ in times[n]] or [first[n]])
            return self.timer() + need > deadline

        calls = 0
        while True:
            rounds = min(len(clean(n)) for n in times)
            spent = sum(s for ts in times.values() for s, _ in ts)
            if all(len(ts) >= max_rounds for ts in times.values()) or (
                rounds >= self.rounds and spent >= budget_s
            ):
                break
            if late():
                if rounds >= self.rounds:
                    break  # (decided on the timings it has)
                return None
            if deadline is not None and rounds < self.rounds and hopeless():
                return None  # (its time goes to the next classes: a later start decides it)
            # the candidate with the fewest clean timings (and that has not used up its calls)
            open_ = [n for n in times if len(times[n]) < max_rounds] or list(times)
            name = min(open_, key=lambda n: (len(clean(n)), len(times[n])))
            call = variants[calls % len(variants)][name]
            calls += 1
            switched, cpu = self.switches(), self.cpu_timer()
            t = self.timer()
            call()
            elapsed = self.timer() - t
            # preempted, and the process's threads ran for less than all but half a thread's time
            lost = self.switches() != switched and (
                self.cpu_timer() - cpu < (mem_key[2] - 0.5) * elapsed
            )
            times[name].append((elapsed, not lost))
        typical = {n: statistics.median(clean(n) or [s for s, _ in times[n]]) for n in times}
        return self._decide(mem_key, typical, dropped, contended=any(not clean(n) for n in times))

    def _try_each(
        self, shape: tuple, candidates: Candidates, late: Callable[[], bool]
    ) -> tuple[list[str], dict[str, float]] | None:
        """Calls each candidate once, untimed; returns those that ran and agree with the first
        that ran, with each call's time (None when ``late`` turned true on the way)."""
        outputs, errors, first = {}, {}, {}
        for name in candidates:
            if late():
                return None
            t = self.timer()
            try:
                outputs[name] = candidates[name]()
            except Exception as e:  # (e.g. oneDNN without a kernel for the dtype on this CPU)
                errors[name] = e
            first[name] = self.timer() - t
        if not outputs:  # (every kernel refuses the call: the caller's problem, not theirs)
            raise next(iter(errors.values()))
        for name, e in errors.items():
            log.warning("%s %s: kernel %r failed (%s: %s); not used", self.op, shape, name,
                        type(e).__name__, e)  # fmt: skip
        alive = list(outputs)
        for name in alive[1:]:
            if not outputs_agree(outputs[alive[0]], outputs[name]):
                log.warning("%s %s: kernel %r disagrees with %r; not used", self.op, shape,
                            name, alive[0])  # fmt: skip
                alive.remove(name)
        return alive, first

    def _decide(
        self, mem_key: tuple, typical: dict[str, float], dropped: tuple, contended: bool
    ) -> Decision:
        shape, dtype, _ = mem_key
        choice = min(typical, key=lambda name: typical[name])
        ms = {n: round(s * 1e3, 4) for n, s in typical.items()}
        source = "timed on contended cores" if contended else "timed"
        decision = Decision(choice, ms, source, dropped)
        self._memory[mem_key] = decision
        self._defaulted.discard(mem_key)
        if not contended:  # (a choice made of stalled timings is not kept for later)
            self.file.put(self.key(shape, dtype), decision)
        log.info("%s %s %s: %s -> %s (%s)", self.op, shape, dtype, ms, choice, source)
        return decision


def defaulted_classes() -> list[tuple[str, tuple, torch.dtype]]:
    """``(op, shape, dtype)`` of every class some `KernelChoice` of this process met undecided
    (its calls ran the default): what a settle step missed or left over."""
    return sorted(
        ((c.op, shape, dtype) for c in list(_CHOICES) for shape, dtype, _ in c.defaulted()),
        key=repr,
    )


@dataclass(frozen=True)
class Trial:
    """One shape class of one op to settle before serving: ``choice`` decides ``shape`` in
    ``dtype`` among ``names`` (the candidates a call of the class offers); ``build()`` makes
    the inputs (the rank's weights, made-up activations of the class's sizes) and returns the
    candidates' calls on them, one mapping per variant (`KernelChoice.measure`); it runs only
    if the class is measured. ``rows``: the tokens (or rows) of the class's calls, the order
    `settle` takes classes in."""

    choice: KernelChoice
    shape: tuple
    dtype: torch.dtype
    names: tuple[str, ...]
    build: Callable[[], list[Candidates]]
    rows: int = 0

    @property
    def label(self) -> str:
        return f"{self.choice.op} {self.shape} {str(self.dtype).removeprefix('torch.')}"


@dataclass(frozen=True)
class Settled:
    """One class `settle` went through: its op, shape class and dtype, and the decision (None:
    left undecided, its calls run the default)."""

    op: str
    shape: tuple
    dtype: torch.dtype
    decision: Decision | None


@dataclass(frozen=True)
class SettleReport:
    """What `settle` did: every class in the order taken, the seconds it took, its budget."""

    classes: tuple[Settled, ...]
    seconds: float
    budget_s: float | None

    @property
    def left(self) -> list[Settled]:
        """The classes left undecided (the budget ran out): they run the default."""
        return [c for c in self.classes if c.decision is None]

    def count(self, source: str) -> int:
        """Classes decided from ``source`` (`Decision.source`: "cache file", "timed", ...)."""
        return sum(c.decision is not None and c.decision.source == source for c in self.classes)

    def summary(self) -> str:
        timed = sum(
            c.decision is not None and c.decision.source.startswith("timed") for c in self.classes
        )
        budget = "no budget" if self.budget_s is None else f"budget {self.budget_s:g} s"
        return (
            f"{len(self.classes)} kernel classes in {self.seconds:.2f} s ({budget}): "
            f"{self.count('cache file')} from the cache file, {timed} timed, "
            f"{len(self.left)} left to the default kernel"
        )

    def table(self) -> str:
        """One line per class: op, shape class, dtype, the choice and each candidate's ms."""
        lines = [f"{'op':<18}{'dtype':<10}{'shape class':<40}{'choice':<12}ms per call (source)"]
        for c in self.classes:
            dt = str(c.dtype).removeprefix("torch.")
            shape = ",".join(str(s) for s in c.shape)
            d = c.decision
            if d is None:
                chosen, why = "default", "not measured within the budget"
            else:
                ms = " ".join(f"{n}={t:g}" for n, t in sorted(d.ms.items(), key=lambda i: i[1]))
                gone = f"; dropped {','.join(d.dropped)}" if d.dropped else ""
                chosen, why = d.choice, f"{ms} ({d.source}{gone})"
            lines.append(f"{c.op:<18}{dt:<10}{shape:<40}{chosen:<12}{why}")
        return "\n".join(lines)


def unsettled(trials: list[Trial]) -> list[Trial]:
    """The ``trials`` with something to choose whose class has no kept decision that covers
    their candidates (memory, then the file): what `settle` would measure."""
    out = []
    for trial in trials:
        if len(trial.names) > 1:
            got = trial.choice.decision(trial.shape, trial.dtype)
            if got is None or not got.covers(trial.names):
                out.append(trial)
    return out


def settle(
    trials: list[Trial],
    budget_s: float | None = None,
    *,
    fresh: bool = False,
    per_class_s: float | None = None,
    max_rounds: int | None = None,
    timer: Callable[[], float] = time.perf_counter,
) -> SettleReport:
    """Decides ``trials`` now, in the order of their ``rows`` (the smallest calls first: the
    decode steps that most of serving is made of), each class once (the first trial of a
    class stands for the others). A class whose decision is kept already (the cache file)
    costs a lookup, unless ``fresh``. ``budget_s``: seconds for all (None: no limit); past it
    the classes not decided stay undecided, and run their default (the first candidate, the
    reference: `KernelChoice.run`); it is checked before every timed call, so it is overrun
    by one call at most. ``per_class_s`` / ``max_rounds``: each class's own timing budget and
    calls (default: the chooser's, `KernelChoice.budget_s`, `KernelChoice.max_rounds`);
    ``splitmoe tune-cpu`` raises them. ``timer``: the clock of ``budget_s`` (the choosers'
    own, in tests)."""
    start = timer()
    deadline = None if budget_s is None else start + budget_s
    done: list[Settled] = []
    seen: set[tuple] = set()
    with torch.no_grad():
        for trial in sorted(trials, key=lambda t: t.rows):
            key = (id(trial.choice), trial.shape, trial.dtype)
            if key in seen or len(trial.names) < 2:
                continue
            seen.add(key)
            got = None if fresh else trial.choice.decision(trial.shape, trial.dtype)
            if got is None or not got.covers(trial.names):
                got = None
                if deadline is None or timer() < deadline:
                    got = trial.choice.measure(
                        trial.shape,
                        trial.dtype,
                        trial.build(),
                        deadline=deadline,
                        fresh=fresh,
                        budget_s=per_class_s,
                        max_rounds=max_rounds,
                    )
            done.append(Settled(trial.choice.op, trial.shape, trial.dtype, got))
    return SettleReport(tuple(done), timer() - start, budget_s)


def pow2_bucket(n: int) -> int:
    """``n`` rounded up to a power of two (0 stays 0): the size part of a shape class."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def half_octave_bucket(n: int) -> int:
    """``n`` rounded up to a power of two or to three quarters of one (1, 2, 3, 4, 6, 8, 12,
    16, ...; 0 stays 0): the size part of a shape class whose candidates' costs cross within an
    octave (the MoE layouts: at a few hundred pairs a layer, which layout is faster can change
    within an octave)."""
    top = pow2_bucket(n)
    return top * 3 // 4 if n > 2 and n <= top * 3 // 4 else top


def class_middles(counts, bucket: Callable[[int], int] = pow2_bucket) -> dict[int, int]:
    """Each class ``bucket(n)`` of the positive ``counts`` -> the middle count of those in it:
    the size a settle step times the class at (its top is the worst case of the class, not its
    typical one, and a kernel chosen there need not be the faster for the rest of it)."""
    members: dict[int, list[int]] = {}
    for n in sorted(set(counts)):
        if n > 0:
            members.setdefault(bucket(n), []).append(n)
    return {top: ns[len(ns) // 2] for top, ns in members.items()}


def last_level_cache_bytes(cpu: int = 0) -> int:
    """Size of the largest data or unified cache of ``cpu`` (Linux sysfs; 0 where unknown)."""
    best = 0
    for index in Path(f"/sys/devices/system/cpu/cpu{cpu}/cache").glob("index*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        try:
            n = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        except (ValueError, IndexError):
            continue
        best = max(best, n)
    return best
