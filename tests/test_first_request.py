"""The first request's outputs equal the hundredth's: kernel choices are settled before the
engine reports ready (`splitmoe.kernels.settle`), never by timing candidates on requests."""

from __future__ import annotations

import pytest
from tiny_models import cpu_llm, prompt_ids

from splitmoe import SamplingParams


@pytest.mark.parametrize("expert_ranks", [0, 1])
def test_first_request_equals_the_hundredth_without_a_kernel_cache(
    tiny_ckpt, tmp_path, monkeypatch, expert_ranks
):
    """On a machine with no cache file of kernel choices (an empty `SPLITMOE_CACHE_DIR`), a
    request run 100 times gives the same token ids and the same logprobs, to the bit, each time
    (when candidates were timed on the first requests, the second one's first logprob differed
    from the first's in the seventh digit: the candidates round apart in float32)."""
    monkeypatch.setenv("SPLITMOE_CACHE_DIR", str(tmp_path / "empty"))
    ckpt = tiny_ckpt("qwen3_moe")
    prompt = prompt_ids(11, seed=5)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    with cpu_llm(ckpt, 1, expert_ranks, max_num_seqs=4, max_num_batched_tokens=64) as llm:
        outs = [llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(100)]
    first = outs[0]
    assert first.logprobs is not None and len(first.token_ids) == 8
    for i, out in enumerate(outs[1:], 2):
        assert out.token_ids == first.token_ids, f"request {i}"
        assert out.logprobs == first.logprobs, f"request {i}"
