"""The micro-batch count of each step, chosen from the times the ranks measure (``"auto"``).

Two micro-batches let an attention rank compute one while the other is in flight or at the
experts, but every micro-batch pays once more for what does not shrink with its tokens: the
expert GEMMs read every local expert's weights again (at decode sizes they are bound by that
read), one more message per layer, one more pass of per-layer Python. Whether the overlap wins
depends on the model, the batch and the machine, so the count is predicted from measurements:

* every rank sums its compute, comm and wait time over each step (`Timeline.take_times`) and
  shares the three numbers in the next control exchange (`StepSync.exchange`): each rank then
  holds the same numbers, whatever its own clock read, and computes the same choice from them;
* a small cost model per step, fitted to the last `WINDOW` steps by least squares (non-negative):
  attention busy time ``A = a_tok * T + a_mb * m`` (T: tokens on the busiest attention rank; the
  slowest attention rank holds everyone up), expert busy time ``E = e_tok * N + e_mb * m`` (N: the
  step's tokens; the busiest expert rank), and the exposed round trip ``X = x_tok * N + x_mb * m``
  (what an m=1 step's forward took beyond ``A + E``: transfers, stragglers);
* with ``m`` micro-batches circulating between the attention ranks and the experts, a layer takes
  the longest of each side's total and one micro-batch's round trip (a closed loop of two
  servers), so a step's forward takes ``max(A, E, (A + E + X) / m)``; times that prediction
  the lower quartile of measured over predicted of the last steps run at that count with about
  as many tokens (up to `RATIO_SAMPLES`, the same power-of-two bucket of T: a prefill chunk and
  a decode step differ in what the model leaves out, such as context length or ranks that share
  cores and cannot overlap at all); a low quantile, because on a shared host a step is slowed by
  tens of percent now and then, and not the lowest, as now and then one is fast for a reason
  the bucket hides. A count never run in the bucket takes the median of the others' ratios, and
  is predicted at all only while the window holds steps of every explored count;
* each count in `EXPLORE` first runs `MIN_SAMPLES` steps of a bucket (in turn), then the
  model's count runs: the one it chose last in the bucket (at first the fewest) until another
  is predicted more than `MARGIN` faster; a bucket next to one so measured (half or twice the
  tokens: a batch whose requests finish one by one) starts from that bucket's steps instead,
  its ratios, last runs and choice, until each count has `MIN_SAMPLES` steps of its own (the
  cost model already scales with the tokens; exploring again would run the slower count
  `MIN_SAMPLES` more times at every halving of the batch). Where the neighbour's choice is
  wrong for the bucket, it holds until the other count's re-runs have given the bucket its
  own steps (~20 steps in the tests' job that flips between 16 and 12 tokens); the counts'
  times change with the tokens continuously, so next to a crossover, where a neighbour can be
  wrong, the two counts are close;
* a count in `EXPLORE` not run in a bucket for `EXPLORE_EVERY` steps is run once, so a wrong
  early estimate (or a workload that changed) is corrected; one predicted ``n * EXPLORE_GAP``
  slower than the fastest, ``n`` times less often (re-running a count twice as slow costs a
  whole step); while a count has only `MIN_SAMPLES` steps in the bucket, 4 times as often and
  with 4 times the gap, twice with one step more, unless each of its own steps in the bucket
  took longer than each of the fastest count's (`_dominated`: the order is then plain, and
  re-running it often would only cost time). Over a decode of 32 steps, measuring costs 3-4 % of
  the best fixed count's time (`tests/test_micro_batch_choice.py`'s noisy synthetic jobs).

The chooser is deterministic given the shared numbers: plain Python floats in a fixed order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median

from splitmoe.config import ParallelConfig
from splitmoe.timeline import StepTimes

CANDIDATES = (1, 2, 3, 4)  # counts the model predicts; more split decode batches too thin
EXPLORE = (1, 2)  # counts kept measured, so that the model always has both
EXPLORE_EVERY = 32  # steps between re-runs of a count predicted within EXPLORE_GAP of the best
EXPLORE_GAP = 0.1  # a count predicted n times this much slower is re-run n times less often
MIN_SAMPLES = 2  # steps of each explored count in a bucket before the model chooses
WINDOW = 32  # steps the model is fitted to: long enough to see both counts, short to adapt
RATIO_SAMPLES = 8  # a count's last steps in a bucket: their measured / predicted corrects it
# A count beats a smaller one only when predicted this much faster: within it the two are a tie
# (the measurements are noisy), and fewer micro-batches pay less per-micro-batch overhead.
MARGIN = 0.03


@dataclass(frozen=True)
class StepSample:
    """One step as every rank saw it in the exchange: its count and token counts, the busiest
    attention rank's busy time ``attention`` and forward time ``forward`` (busy + wait), the
    busiest expert rank's busy time ``experts`` (seconds)."""

    micro_batches: int
    max_tokens: int
    tokens: int
    attention: float
    experts: float
    forward: float

    @classmethod
    def from_exchange(
        cls, m: int, tokens: Sequence[int], times: Sequence[StepTimes], num_attention: int
    ) -> StepSample:
        """``tokens``: every attention rank's tokens in the step; ``times``: every rank's
        (attention ranks first)."""
        att, exp = times[:num_attention], times[num_attention:]
        return cls(
            micro_batches=m,
            max_tokens=max(tokens),
            tokens=sum(tokens),
            attention=max(t.busy for t in att),
            experts=max((t.busy for t in exp), default=0.0),
            forward=max(t.total for t in att),
        )


@dataclass(frozen=True)
class Prediction:
    """A count's predicted forward time (seconds): the model's, and corrected by the ratio of
    measured to predicted seen at that count."""

    micro_batches: int
    model: float
    corrected: float


class MicroBatchChooser:
    """Picks each step's micro-batch count on every rank alike: `choose` before the step, and
    `observe` with the exchanged times after it (in the next exchange)."""

    def __init__(self, parallel: ParallelConfig, shared_gpu: bool = False):
        self.parallel = parallel
        self.shared_gpu = shared_gpu
        self.samples: deque[StepSample] = deque(maxlen=WINDOW)
        self.steps = 0  # steps chosen for
        self.last_run: dict[tuple[int, int], int] = {}  # (bucket, count) -> the step it last ran
        # (bucket, count) -> the last steps run at that count with about as many tokens
        self.recent: dict[tuple[int, int], deque[StepSample]] = {}
        self.chosen: dict[int, int] = {}  # count -> steps run with it (stats)
        self._pending: tuple[int, tuple[int, ...]] | None = None  # (m, tokens) of the last step
        self._kept: dict[int, int] = {}  # bucket -> the count the model chose last
        self._coeffs = ((0.0, 0.0),) * 3  # `_fit` of the samples

    def choose(self, tokens: Sequence[int]) -> int:
        """The count of a step whose attention ranks compute ``tokens`` (all-gathered)."""
        m = self.parallel.micro_batches_for(tuple(tokens), self.shared_gpu)
        if m is None:
            m = self._choose(tokens)
        self.steps += 1
        self.last_run[_bucket(tokens), m] = self.steps
        self.chosen[m] = self.chosen.get(m, 0) + 1
        self._pending = (m, tuple(tokens))
        return m

    def observe(self, times: Sequence[StepTimes]) -> None:
        """Every rank's times of the step last chosen for (from `StepDecision.times`); a no-op
        when no step ran since the last call."""
        if self._pending is None or not times:
            return
        m, tokens = self._pending
        self._pending = None
        sample = StepSample.from_exchange(m, tokens, times, len(tokens))
        if sample.forward <= 0.0:  # (a rank that measured nothing: nothing to learn)
            return
        self.samples.append(sample)
        self._coeffs = self._fit()
        key = (_bucket(tokens), m)
        self.recent.setdefault(key, deque(maxlen=RATIO_SAMPLES)).append(sample)

    def predictions(self, tokens: Sequence[int], like: int | None = None) -> list[Prediction]:
        """Every candidate count's predicted forward time for a step of ``tokens``, from the
        steps of bucket ``like`` (`_like`'s, unless given)."""
        t_max, n = max(tokens), sum(tokens)
        b = self._like(tokens, _fits(tokens)) if like is None else like
        recent = {m: r for (bk, m), r in self.recent.items() if bk == b}
        ratio = {m: self._ratio(list(r)) for m, r in recent.items()}
        ratio = {m: r for m, r in ratio.items() if r is not None}
        default = median(list(ratio.values())) if ratio else 1.0
        # a count never run is predicted from the model alone: only while the model has seen
        # every explored count in its window (without one, it cannot tell a per-micro-batch
        # cost from a per-token one, and extrapolates wildly)
        fitted = {x.micro_batches for x in self.samples}
        out = []
        for m in CANDIDATES:
            if m > max(t_max, 1):
                break
            if m not in EXPLORE and m not in recent and not fitted >= set(_fits(tokens)):
                continue
            model = self.model_time(m, t_max, n)
            out.append(Prediction(m, model, model * ratio.get(m, default)))
        return out

    def model_time(self, m: int, max_tokens: int, tokens: int) -> float:
        """The cost model's forward time of a step: ``max(A, E, (A + E + X) / m)``."""
        a, e, x = self._coeffs
        att = a[0] * max_tokens + a[1] * m
        exp = e[0] * tokens + e[1] * m
        trip = x[0] * tokens + x[1] * m
        return max(att, exp, (att + exp + trip) / m)

    def stats(self) -> dict:
        return {"micro_batch_steps": {str(m): n for m, n in sorted(self.chosen.items())}}

    def _measured(self, bucket: int, fits: Sequence[int]) -> bool:
        """Whether each of ``fits`` has run `MIN_SAMPLES` steps in ``bucket``."""
        return all(len(self.recent.get((bucket, m), ())) >= MIN_SAMPLES for m in fits)

    def _like(self, tokens: Sequence[int], fits: Sequence[int]) -> int:
        """The bucket whose steps stand for a step of ``tokens`` (explored counts ``fits``):
        its own once each of ``fits`` has run `MIN_SAMPLES` steps there, else a neighbour's
        (half the tokens, then twice) where they have, else its own."""
        b = _bucket(tokens)
        if self._measured(b, fits):
            return b
        return next((nb for nb in (b - 1, b + 1) if self._measured(nb, fits)), b)

    def _choose(self, tokens: Sequence[int]) -> int:
        fits = _fits(tokens)
        own, b = _bucket(tokens), self._like(tokens, fits)
        seen = {m: len(self.recent.get((b, m), ())) for m in fits}
        new = [m for m in fits if seen[m] < MIN_SAMPLES]
        if new:  # (in turn, the least measured first)
            return min(new, key=lambda m: (seen[m], m))
        preds = self.predictions(tokens, b)
        # a count is re-run when due: every EXPLORE_EVERY steps while predicted within
        # EXPLORE_GAP of the fastest, n times less often when predicted n * EXPLORE_GAP slower
        # (re-running a much slower count then costs no more than a close one); while its
        # estimate is unsure, more often and with a wider gap: 4 times at MIN_SAMPLES steps in
        # the bucket, half that with each step more (each re-run that leaves the order as it
        # was makes the next less urgent)
        time = {p.micro_batches: p.corrected for p in preds}
        fastest = min(time[m] for m in fits)
        quickest = min(fits, key=lambda m: (time[m], m))
        last = {m: max(self.last_run.get((k, m), -EXPLORE_EVERY) for k in (own, b)) for m in fits}

        def period(m: int) -> float:
            gap = time[m] / fastest - 1.0 if fastest > 0.0 else 0.0
            # (not on a neighbour's steps: their order may not hold for this bucket's tokens)
            sure = b == own and self._dominated(b, m, quickest)
            doubt = 1.0 if sure else max(1.0, 4.0 / 2.0 ** (seen[m] - MIN_SAMPLES))
            every, tolerance = EXPLORE_EVERY / doubt, EXPLORE_GAP * doubt
            return every * max(1.0, gap / tolerance)

        due = [m for m in fits if self.steps + 1 - last[m] >= period(m)]
        if due:
            return min(due, key=lambda m: (last[m], m))
        # the count the model chose last stays (else the fewest) unless another is predicted
        # more than MARGIN faster: within it two counts are a tie, not worth a change of the
        # shapes every rank runs
        kept = self._kept.get(own, self._kept.get(b))
        best = next((p for p in preds if p.micro_batches == kept), preds[0])
        for p in preds:
            if p.corrected < best.corrected * (1.0 - MARGIN):
                best = p
        self._kept[own] = best.micro_batches
        return best.micro_batches

    def _dominated(self, bucket: int, m: int, best: int) -> bool:
        """Whether every step of count ``m`` in ``bucket`` took longer than every step of count
        ``best`` there (each with `MIN_SAMPLES` steps at least): the order of the two is then
        plain from the measurements themselves, however noisy the host, and re-running ``m`` as
        often as a count whose estimate is unsure would only cost time."""
        mine, theirs = self.recent.get((bucket, m), ()), self.recent.get((bucket, best), ())
        if m == best or min(len(mine), len(theirs)) < MIN_SAMPLES:
            return False
        return min(x.forward for x in mine) > max(x.forward for x in theirs)

    def _ratio(self, samples: list[StepSample]) -> float | None:
        """The lower quartile of measured over predicted forward time of ``samples`` (one
        count, one bucket), by the model as it is now; None where it predicts nothing. Low: on a
        shared host a step is slowed now and then (a rank loses its core), never sped up; the
        quartile, not the lowest, as now and then a step is fast for a reason the bucket hides.
        The same quantile whatever the count of samples (`_quartile`), so that a count run more
        often does not look faster for it, nor one run less often, whose few last steps a slow
        spell may all have hit, slower."""
        r = []
        for x in samples:
            predicted = self.model_time(x.micro_batches, x.max_tokens, x.tokens)
            if predicted > 0.0:
                r.append(x.forward / predicted)
        return _quartile(r) if r else None

    def _fit(self) -> tuple[tuple[float, float], ...]:
        """(per token, per micro-batch) seconds of attention, experts and the exposed trip."""
        s = self.samples
        att = _fit_two([(x.max_tokens, x.micro_batches, x.attention) for x in s])
        exp = _fit_two([(x.tokens, x.micro_batches, x.experts) for x in s])
        trip = _fit_two(
            [
                (x.tokens, 1, max(0.0, x.forward - x.attention - x.experts))
                for x in s
                if x.micro_batches == 1
            ]
        )
        return att, exp, trip


def _fits(tokens: Sequence[int]) -> list[int]:
    """The explored counts a step of ``tokens`` can run (no more micro-batches than tokens)."""
    return [m for m in EXPLORE if m <= max(tokens)]


def _quartile(values: list[float]) -> float:
    """The lower quartile of ``values`` as an order statistic: the ``k``-th smallest of ``n``
    with ``k / (n + 1)`` nearest 1/4 (the smallest of up to 4, the second of 5 to 8)."""
    return sorted(values)[max(0, round((len(values) + 1) / 4) - 1)]


def _bucket(tokens: Sequence[int]) -> int:
    """The power-of-two bucket of a step's tokens on its busiest attention rank."""
    return max(tokens).bit_length()


def _fit_two(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Non-negative least squares ``z ~ p * u + q * v`` over rows ``(u, v, z)``, in plain
    Python floats (the same result on every host). Where ``u`` and ``v`` are proportional (one
    count, one token count seen), the minimum-norm solution: the cost is split by the columns'
    scale until a second count or token count tells them apart."""
    suu = suv = svv = suz = svz = 0.0
    for u, v, z in rows:
        suu += u * u
        suv += u * v
        svv += v * v
        suz += u * z
        svz += v * z
    if suu + svv == 0.0:
        return 0.0, 0.0
    det = suu * svv - suv * suv
    if det <= 1e-9 * suu * svv:
        p, q = suz / (suu + svv), svz / (suu + svv)
    else:
        p, q = (svv * suz - suv * svz) / det, (suu * svz - suv * suz) / det
    if p < 0.0:
        p, q = 0.0, max(0.0, svz / svv) if svv else 0.0
    elif q < 0.0:
        p, q = max(0.0, suz / suu) if suu else 0.0, 0.0
    return p, q
