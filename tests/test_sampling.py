"""Sampling, stopping and the user-facing LLM API, on a tiny Qwen3-MoE.

Seeded sampling must be reproducible and must not depend on the topology or on
what else is in the batch (per-request seeded generator); stop_token_ids and
EOS must end requests with finish_reason "stop"; ignore_eos must not.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from tiny_models import EOS_ID, cpu_llm, make_tiny_checkpoint, prompt_ids

from splitmoe import SamplingParams
from splitmoe.attention_nodes.sampler import sample

CKPT = "qwen3_moe"
N_SAMPLED = 32
SEEDED = dict(temperature=0.8, top_k=20, top_p=0.9, seed=123)
PROMPTS = [prompt_ids(4, seed=201), prompt_ids(11, seed=202), prompt_ids(1, seed=203)]


def _seeded(seed=SEEDED["seed"], **kw):
    return SamplingParams(max_tokens=N_SAMPLED, ignore_eos=True, **dict(SEEDED, seed=seed, **kw))


# vLLM's logits controls, greedy and seeded: the same tokens on every topology
CONTROLS = [
    SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.6, logit_bias={"9": 3.0}),
    SamplingParams(max_tokens=12, temperature=0.8, seed=11, presence_penalty=1.2, min_p=0.05),
    SamplingParams(max_tokens=12, temperature=0.0, frequency_penalty=-0.8),
    SamplingParams(
        max_tokens=12, temperature=0.0, min_tokens=10, stop_token_ids=list(range(3, 60))
    ),
]


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt(CKPT)


@pytest.fixture(scope="module")
def llm(ckpt):
    with cpu_llm(ckpt, 1, 1) as llm:
        yield llm


@pytest.fixture(scope="module")
def controls_ref(llm, ckpt, hf_ref):
    """CONTROLS on PROMPTS[0] from the 1+1 LLM; each control really changed the output."""
    outs = llm.generate([PROMPTS[0]] * len(CONTROLS), CONTROLS)
    greedy = hf_ref(ckpt, PROMPTS[0], 12)
    for p, o in zip(CONTROLS, outs):
        assert o.token_ids != greedy[: len(o.token_ids)], f"{p} gave the plain greedy tokens"
    masked = outs[3]  # min_tokens: none of the stop tokens among its first 10, 12 in all
    assert not set(masked.token_ids[:10]) & set(range(3, 60)) and len(masked.token_ids) >= 11
    return [list(o.token_ids) for o in outs]


@pytest.fixture(scope="module")
def seeded_ref(llm):
    """Seeded samples of PROMPTS from the 1+1 LLM."""
    outs = llm.generate(PROMPTS, _seeded())
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    for o in outs:
        assert len(o.token_ids) == N_SAMPLED and o.finish_reason == "length"
    return [list(o.token_ids) for o in outs]


# ----------------------------------------------------------------- seeded sampling


def test_seeded_sampling_is_reproducible(llm, seeded_ref, ckpt, hf_ref):
    again = llm.generate(PROMPTS, _seeded())
    assert [list(o.token_ids) for o in again] == seeded_ref
    # And it really samples: at temperature 0.8 some prompt leaves the greedy path.
    greedy = [hf_ref(ckpt, p, N_SAMPLED) for p in PROMPTS]
    assert seeded_ref != greedy, (
        "temperature=0.8 sampling returned the greedy tokens for every prompt"
    )


def test_seeded_sampling_independent_of_batch(llm, seeded_ref):
    """A request's seeded samples do not depend on the other requests in the batch."""
    alone = llm.generate([PROMPTS[1]], _seeded())
    assert list(alone[0].token_ids) == seeded_ref[1]
    reordered = llm.generate([PROMPTS[2], PROMPTS[0]], _seeded())
    assert [list(o.token_ids) for o in reordered] == [seeded_ref[2], seeded_ref[0]]


def test_different_seeds_give_different_tokens(llm, seeded_ref):
    other = llm.generate(PROMPTS, _seeded(seed=124))
    for i, o in enumerate(other):
        assert len(o.token_ids) == N_SAMPLED
        assert list(o.token_ids) != seeded_ref[i], (
            f"prompt {i}: seeds 123 and 124 sampled the same {N_SAMPLED} tokens"
        )


def _descendants(pid=None):
    """Live (non-zombie) descendant processes of ``pid``: {pid: cmdline}."""
    pid = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    info: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 2 :].split()
        state, ppid = rest[0], int(rest[1])
        if state == "Z":
            continue
        children.setdefault(ppid, []).append(int(entry))
        info[int(entry)] = cmd
    out, todo = {}, [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out[c] = info.get(c, "")
            todo.append(c)
    return out


# Long-lived helper processes that multiprocessing may legitimately leave behind.
_HELPERS = ("resource_tracker", "semaphore_tracker", "forkserver")


@pytest.mark.parametrize("topology", [(1, 0), (2, 2)], ids=["1+0", "2+2"])
def test_seeded_sampling_same_across_topologies(topology, ckpt, seeded_ref, controls_ref):
    before = set(_descendants())
    with cpu_llm(ckpt, *topology) as other:
        outs = other.generate(PROMPTS, _seeded())
        controlled = other.generate([PROMPTS[0]] * len(CONTROLS), CONTROLS)
    assert [list(o.token_ids) for o in outs] == seeded_ref
    assert [list(o.token_ids) for o in controlled] == controls_ref

    # Closing the LLM shuts its rank processes down.
    deadline = time.time() + 30
    while True:
        leaked = {
            p: c
            for p, c in _descendants().items()
            if p not in before and not any(h in c for h in _HELPERS)
        }
        if not leaked or time.time() > deadline:
            break
        time.sleep(0.2)
    assert not leaked, f"processes still alive after LLM closed: {leaked}"


def test_top_k_1_and_tiny_top_p_are_greedy(llm, ckpt, hf_ref):
    """Per-prompt SamplingParams list; top_k=1 and top_p->0 leave only the argmax."""
    p = PROMPTS[0]
    params = [
        SamplingParams(max_tokens=16, temperature=0.8, top_k=1, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.8, top_p=1e-6, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
    ]
    outs = llm.generate([p, p, p, p], params)
    want = hf_ref(ckpt, p, 16)
    assert [list(o.token_ids) for o in outs] == [want, want, want, want[:5]]
    assert all(o.finish_reason == "length" for o in outs)


# ----------------------------------------------------------------- stopping


def _first_fresh_position(seq, min_pos=2):
    """Smallest j >= min_pos with seq[j] not in seq[:j] and no EOS in seq[:j+1]."""
    for j in range(min_pos, len(seq)):
        if EOS_ID in seq[: j + 1]:
            return None
        if seq[j] not in seq[:j]:
            return j
    return None


def _stop_case(ckpt, hf_ref, n=24):
    """(prompt, greedy continuation, j, t): greedy produces t first at position j."""
    for s in range(300, 320):
        p = prompt_ids(3 + s % 7, seed=s)
        greedy = hf_ref(ckpt, p, n)
        j = _first_fresh_position(greedy)
        if j is not None:
            return p, greedy, j, greedy[j]
    pytest.fail("test setup: found no prompt whose greedy output has a fresh token before EOS")


def test_stop_token_ids(llm, ckpt, hf_ref):
    p, greedy, j, t = _stop_case(ckpt, hf_ref)
    other = PROMPTS[1]
    outs = llm.generate(
        [p, other],
        [
            SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[t]),
            SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        ],
    )
    stopped, unaffected = outs
    assert stopped.finish_reason == "stop"
    assert list(stopped.token_ids) == greedy[: j + 1]
    assert stopped.token_ids[-1] == t and len(stopped.token_ids) == j + 1
    # The other request in the batch runs on, unaffected.
    assert unaffected.finish_reason == "length"
    assert list(unaffected.token_ids) == hf_ref(ckpt, other, 24)


def test_eos_from_checkpoint_stops_unless_ignored(ckpt, hf_ref, tmp_path_factory):
    p, greedy, j, t = _stop_case(ckpt, hf_ref)
    # Same weights (same seed and shapes), but EOS is the token greedy makes at j.
    # No tokenizer files, so config.json / generation_config.json alone name the EOS.
    eos_ckpt = make_tiny_checkpoint(
        CKPT, tmp_path_factory.mktemp(f"eos{t}"), eos_token_id=t, with_tokenizer=False
    )
    assert hf_ref(eos_ckpt, p, 24) == greedy  # test setup: same weights
    with cpu_llm(eos_ckpt, 1, 1) as llm:
        stop, run_on = llm.generate(
            [p, p],
            [
                SamplingParams(max_tokens=24, temperature=0.0),
                SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
            ],
        )
    assert stop.finish_reason == "stop"
    assert list(stop.token_ids) == greedy[: j + 1]
    assert run_on.finish_reason == "length"
    assert list(run_on.token_ids) == greedy


# ----------------------------------------------------------------- API surface


def test_string_prompts_and_text(llm, ckpt, hf_ref):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    texts = ["Hello, world!", "MoE"]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate(texts, greedy)
    assert len(outs) == 2
    for text, out in zip(texts, outs):
        ids = tok.encode(text)
        assert list(out.prompt_token_ids) == ids
        assert list(out.token_ids) == hf_ref(ckpt, ids, 12)
        assert isinstance(out.text, str)
        assert out.text in (
            tok.decode(out.token_ids, skip_special_tokens=True),
            tok.decode(out.token_ids, skip_special_tokens=False),
        )
    single = llm.generate(texts[0], greedy)  # a bare str is one prompt
    assert len(single) == 1
    assert list(single[0].token_ids) == list(outs[0].token_ids)


def test_request_metrics(llm):
    t0 = time.perf_counter()
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    wall = time.perf_counter() - t0
    for o in outs:
        m = o.metrics
        for name in ("ttft", "tpot", "e2e_latency"):
            v = getattr(m, name)
            assert isinstance(v, float), f"{name} = {v!r}"
            assert v >= 0.0, f"{name} = {v}"
        assert 0.0 < m.ttft <= m.e2e_latency <= wall + 1e-3
        assert 0.0 < m.tpot <= m.e2e_latency


def test_greedy_rows_take_the_first_of_equal_maxima():
    """Greedy rows are torch's argmax (HF's greedy choice), ties to the lowest token id."""
    ties = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -3.0, -1.0, -2.0]])
    greedy = [SamplingParams(temperature=0.0)] * 3
    assert sample(ties, greedy, [None] * 3) == [1, 0, 0]
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(0))
    logits[::3, 7] = logits[::3, 11] = logits.max() + 1  # tied maxima in every third row
    assert sample(logits, [greedy[0]] * 64, [None] * 64) == logits.argmax(-1).tolist()
