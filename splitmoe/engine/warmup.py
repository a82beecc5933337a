"""`LLM.warm_up`: made-up requests at the shapes serving will meet."""

from __future__ import annotations

import random
import time

from splitmoe.kernels.cpu_choice import half_octave_bucket
from splitmoe.sampling_params import SamplingParams


def warm_up(llm, decode_steps: int = 16, prefill_repeats: int = 3) -> dict:
    """Runs made-up requests through the engine at the shapes serving will meet, so that
    what a shape's first call pays for (oneDNN building its kernel for a row count, CUDA
    graphs, allocator growth) is paid now rather than in the first clients' steps. Like vLLM's
    start-up warm-up. (Kernel choices are settled before a rank reports ready, never here:
    `splitmoe.kernels.settle`.)

    Each attention rank decodes ``b`` requests for ``decode_steps`` steps at every power
    of two ``b`` up to ``max_num_seqs`` and at three quarters of each (the MoE layouts'
    classes are half an octave wide: `half_octave_bucket`), then prefills one prompt of
    each power of two from
    32 tokens up to the step's token budget (``max_num_batched_tokens``, or the longest
    prompt that fits) ``prefill_repeats`` times. A class decided on an earlier start (the
    choices' cache file) costs its normal time. Greedy, random token ids (each request its
    own, so nothing is served from the prefix cache), then `reset_metrics`. Returns what
    ran: ``decode_batches``, ``prefill_tokens``, ``seconds``."""
    cfg = llm.config
    ranks, vocab = cfg.parallel.attention_ranks, cfg.model.vocab_size
    longest = min(cfg.scheduler.max_num_batched_tokens, cfg.max_model_len - 1)
    top = cfg.scheduler.max_num_seqs
    batches = sorted({c for c in map(half_octave_bucket, range(1, top + 1)) if c <= top})
    prefills = [1 << i for i in range(5, longest.bit_length()) if 1 << i <= longest]
    prompt = 16
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    t0 = time.perf_counter()
    steps = min(decode_steps, cfg.max_model_len - prompt)
    if steps > 0:
        decode = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
        for b in batches:
            llm.generate([ids(prompt) for _ in range(b * ranks)], decode, use_tqdm=False)
    once = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for n in prefills:
        for _ in range(prefill_repeats):
            llm.generate([ids(n) for _ in range(ranks)], once, use_tqdm=False)
    llm.reset_metrics()
    return dict(
        decode_batches=batches if steps > 0 else [],
        prefill_tokens=prefills,
        seconds=time.perf_counter() - t0,
    )
