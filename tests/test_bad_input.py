"""Bad input gets a clear error before any rank is asked to work."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys

import pytest
from small_default import write_small_model

from splitmoe import LLM, SamplingParams


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_small_model(tmp_path_factory.mktemp("small"))


@pytest.fixture(scope="module")
def llm(ckpt):
    with LLM(str(ckpt), attention_ranks=1, expert_ranks=1, device="cpu") as llm:
        yield llm


def _no_children():
    return not multiprocessing.active_children()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(expert_ranks=5), r"expert_ranks=5 exceeds the model's 4 experts"),
        (dict(attention_ranks=0), r"attention_ranks=0 must be an integer >= 1"),
        (dict(transport="carrier-pigeon"), r"transport='carrier-pigeon' is not available"),
        (dict(dtype="float8"), r"dtype='float8' is not supported"),
        (dict(max_model_len=1000), r"max_model_len=1000 exceeds .*max_position_embeddings=64"),
        (dict(block_size=0), r"block_size=0"),
        (dict(moe_backend="cpu"), r"moe_backend='cpu' .* no longer exists.*'auto' or 'torch'"),
        (dict(pin_cores="no"), r"pin_cores='no' must be True or False"),
    ],
)
def test_bad_llm_arguments_start_no_rank(ckpt, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(ckpt), device="cpu", **kwargs)
    assert _no_children()


def test_unknown_llm_option_names_the_closest(ckpt):
    """Options come from the config dataclasses: a misspelt one is an error naming the option
    meant, never silently dropped."""
    with pytest.raises(TypeError, match=r"'expert_rank' \(did you mean expert_ranks"):
        LLM(str(ckpt), expert_rank=2)
    assert _no_children()


def test_launcher_flags_are_the_engine_options(ckpt, tmp_path):
    """The launcher's engine flags are built from the same declarations as LLM's options."""
    from splitmoe.launch import LaunchEnv, build_parser, prepare
    from splitmoe.options import engine_options

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2]}\n')
    args = build_parser().parse_args(
        ["--model", str(ckpt), "--prompts", str(prompts), "--output", "-", "--balancer",
         "global", "--redundant-experts", "2", "--micro-batches", "3", "--no-pin-cores"]
    )  # fmt: skip
    env = LaunchEnv(rank=0, world_size=3, local_rank=0, local_world_size=3, launcher="single")
    cfg, _, _ = prepare(args, env)
    par = cfg.parallel
    assert (par.balancer, par.redundant_experts, par.micro_batches) == ("global", 2, 3)
    assert par.expert_ranks == 2 and not cfg.pin_cores
    help_text = build_parser().format_help()
    for name, f in engine_options().items():
        if name != "expert_ranks":  # (the rest of the world)
            assert (f.metadata["flag"] or "--" + name.replace("_", "-")) in help_text, name


def test_missing_directory_and_unknown_family(tmp_path, ckpt):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "missing"))
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((ckpt / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type='gpt2' .* not supported"):
        LLM(str(bad))
    assert _no_children()


@pytest.mark.parametrize(
    "prompts,params,match",
    [
        ([[]], SamplingParams(), "prompt 0 is empty"),
        ([""], SamplingParams(), "prompt 0 is empty"),
        (
            [[1, 2], list(range(64))],
            SamplingParams(),
            "prompt 1 has 64 tokens, but max_model_len is 64",
        ),
        ([[1, 320]], SamplingParams(), r"outside the vocabulary \[0, 320\)"),
        ([[-1]], SamplingParams(), "outside the vocabulary"),
        ([[1.5]], SamplingParams(), "non-integer token ids"),
        ([[1]], SamplingParams(stop_token_ids=(999,)), "stop_token_ids .* outside the vocabulary"),
        ([[1], [2]], [SamplingParams()], "got 1 SamplingParams for 2 prompts"),
        (42, SamplingParams(), "prompts must be"),
    ],
)
def test_bad_prompts_rejected_and_llm_still_serves(llm, prompts, params, match):
    with pytest.raises((ValueError, TypeError), match=match):
        llm.generate(prompts, params)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))
    assert len(out[0].token_ids) == 2


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_tokens=0), "max_tokens=0 must be >= 1"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=-1.0), "temperature=-1.0"),
        (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
        (dict(top_k=0), "top_k=0"),
        (dict(seed=-3), "seed=-3"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_launcher_reports_bad_jsonl_line(ckpt, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2]}\n{"prompt_token_ids": [1, 2}\n')
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "splitmoe.launch",
            "--model",
            str(ckpt),
            "--prompts",
            str(prompts),
            "--output",
            str(tmp_path / "o.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert f"{prompts}:2: not valid JSON" in r.stderr
    prompts.write_text('{"prompt_token_ids": [1, 2], "max_tokens": 0}\n')
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "splitmoe.launch",
            "--model",
            str(ckpt),
            "--prompts",
            str(prompts),
            "--output",
            str(tmp_path / "o.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "p.jsonl:1: max_tokens=0 must be >= 1" in r.stderr


def test_truncated_checkpoint_refused_before_any_rank_starts(ckpt, tmp_path):
    import shutil

    from splitmoe.models.loader import CheckpointError

    bad = tmp_path / "truncated"
    shutil.copytree(ckpt, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) * 2 // 3])
    before = set(multiprocessing.active_children())
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        LLM(str(bad), expert_ranks=1, device="cpu")
    assert set(multiprocessing.active_children()) <= before
