"""vLLM's offline engine on given token ids, timed as `bench_generate.py` times HF: the peer row
of ``bench_generate.py --peer vllm``.

Run by `bench_generate.py` in a Python where vLLM imports (its own venv: vLLM pins its own
torch), so it needs nothing from splitmoe. Reads one JSON object on stdin::

    {"model": dir, "dtype": "float32", "prompts": [[ids]], "warmup": [[ids]],
     "max_tokens": n, "max_num_seqs": b, "max_model_len": l}

and writes one JSON line on stdout, prefixed ``VLLM_PEER_RESULT `` (vLLM logs to stdout too):
the generated ``tokens``, ``wall_s``, ``ttft_ms``, ``tpot_ms``, ``decode_tok_s``,
``output_tok_s``, ``startup_s`` and vLLM's version. TTFT is the time of a 1-token run of the
batch, decode the rest of an n-token run (as for HF); the prompts go in as token ids, greedy,
without EOS, so the tokens compare with HF's and splitmoe's.
"""

from __future__ import annotations

import json
import sys
import time

RESULT_PREFIX = "VLLM_PEER_RESULT "


def main() -> None:
    req = json.load(sys.stdin)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=req["model"],
        dtype=req["dtype"],
        max_num_seqs=req["max_num_seqs"],
        max_model_len=req["max_model_len"],
        skip_tokenizer_init=True,
        seed=0,
        # on the CPU backend the fraction of the host's memory that vLLM reserves (KV cache):
        # its default (0.92) fails to start when anything else holds a few GiB, and a peer
        # with a smaller cache than ours would not be slower for it at these sizes
        gpu_memory_utilization=req.get("memory_fraction", 0.5),
    )
    startup = time.perf_counter() - t0

    def run(prompts: list[list[int]], n: int):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        t = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        wall = time.perf_counter() - t
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        if any(len(t) != n for t in tokens):
            raise RuntimeError(f"vLLM stopped early: {[len(t) for t in tokens]} of {n} tokens")
        return wall, tokens

    run(req["warmup"], 2)  # the first batch of a shape: allocations, compiled graphs
    n, batch = req["max_tokens"], len(req["prompts"])
    ttft, _ = run(req["first"], 1)  # other prompts: nothing of "prompts" in its prefix cache
    wall, tokens = run(req["prompts"], n)
    decode = wall - ttft
    result = dict(
        tokens=tokens,
        wall_s=wall,
        ttft_ms=1e3 * ttft,
        tpot_ms=1e3 * decode / (n - 1),
        decode_tok_s=batch * (n - 1) / decode,
        output_tok_s=batch * n / wall,
        startup_s=startup,
        version=vllm.__version__,
    )
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
