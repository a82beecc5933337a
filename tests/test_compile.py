"""``torch.compile`` of the per-layer compute (`splitmoe.attention_nodes.compiled`) and the
``enforce_eager`` option: the compiled pieces give HF's tokens in float32, they trace every
attention kind (MLA included), a failing compile falls back to eager with one warning, and the
default (eager: compiling measured no faster on CPU) stays as documented."""

from __future__ import annotations

import argparse
import logging

import torch
from tiny_models import cpu_llm, prompt_ids

from splitmoe import SamplingParams
from splitmoe.attention_nodes.compiled import CompiledPieces, GuardedCompile
from splitmoe.attention_nodes.model import AttentionModel
from splitmoe.kernels.backends import attention_backend
from splitmoe.models.config import ModelConfig
from splitmoe.models.loader import load_attention_weights
from splitmoe.options import add_engine_args, engine_args, engine_config

CPU = torch.device("cpu")


def test_enforce_eager_option(tiny_ckpt):
    cfg = ModelConfig.from_hf(tiny_ckpt("qwen3_moe"))
    default = engine_config(cfg, device="cpu")
    assert default.enforce_eager is None and not default.compile_model
    assert not default.cuda_graphs
    assert engine_config(cfg, device="cpu", enforce_eager=False).compile_model
    assert not engine_config(cfg, device="cpu", enforce_eager=True).compile_model
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    assert engine_args(ap.parse_args(["--enforce-eager"])) == {"enforce_eager": True}
    assert "enforce_eager" not in engine_args(ap.parse_args([]))
    try:
        engine_config(cfg, enforce_eager="yes")
    except ValueError as e:
        assert "enforce_eager" in str(e)
    else:
        raise AssertionError("enforce_eager='yes' was accepted")


def test_compiled_matches_hf(tiny_ckpt, hf_ref):
    """A dense and two MoE layers, compiled by Inductor, prompts of 1 to 17 tokens decoded
    together (row counts 1, several, and a prefill): HF's greedy tokens, float32."""
    ckpt = tiny_ckpt("qwen3_moe_dense")
    prompts = [prompt_ids(n, seed=i) for i, n in enumerate((1, 5, 17))]
    want = [hf_ref(ckpt, p, 8) for p in prompts]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    # (the first steps compile: tens of seconds on a loaded 2-core host)
    with cpu_llm(ckpt, 1, 0, enforce_eager=False, timeout_s=600.0) as llm:
        outs = llm.generate(prompts, params)
        stats = llm.stats()[0]
    assert [list(o.token_ids) for o in outs] == want
    # compiled by Inductor, not fallen back to eager (the router's GEMM went through the CPU
    # kernel choice's oneDNN call, which Inductor cannot lower, until `linear` left it to it)
    assert stats["compile_errors"] == {}
    assert stats["cuda_graph_sizes"] == [] and stats["cuda_graph_steps"] == 0  # (CPU: none)


def _pieces_agree(model: AttentionModel, pieces: CompiledPieces, rows: int) -> None:
    cfg = model.cfg
    g = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, cfg.hidden_size, generator=g)
    moe = torch.randn(rows, cfg.hidden_size, generator=g)
    cos_sin = model.rope(torch.arange(rows) + 3, torch.float32)
    for layer in model.layers:
        want_h, want_in = model.layer_in(layer, h, moe, cos_sin)
        got_h, got_in = pieces.layer_in(layer, h, moe, cos_sin)
        torch.testing.assert_close(got_h, want_h)
        for got, want in zip(got_in, want_in, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        o = torch.randn(rows, cfg.num_heads, want_in[0].shape[-1], generator=g)
        if layer.mla is not None:
            o = o[..., : cfg.kv_lora_rank]
        want = model.layer_out(layer, want_h, o)
        got = pieces.layer_out(layer, want_h, o)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        if want[2] is not None:
            assert torch.equal(got[2][0], want[2][0])  # the same experts chosen
            torch.testing.assert_close(got[2][1], want[2][1], rtol=1e-5, atol=1e-5)


def test_pieces_trace_every_attention_kind(tiny_ckpt):
    """MLA (DeepSeek-V3: q LoRA, YaRN, a dense layer, grouped sigmoid routing) and q/k-normed
    GQA (Qwen3-MoE), traced by Dynamo (``aot_eager``: the graph Inductor would get, run
    eagerly, so the test stays quick), at 1, 3 and 7 rows (static, then dynamic rows), agree
    with the eager pieces, without falling back."""
    for name in ("deepseek_v3", "qwen3_moe"):
        cfg = ModelConfig.from_hf(tiny_ckpt(name))
        g, layers = load_attention_weights(cfg, torch.float32, "cpu")
        model = AttentionModel(cfg, g, layers, CPU, attention_backend("torch", CPU))
        pieces = CompiledPieces(model, lambda fn: torch.compile(fn, backend="aot_eager"))
        with torch.inference_mode():
            for rows in (1, 3, 7):
                _pieces_agree(model, pieces, rows)
        assert pieces.errors == {}


def test_compile_failure_falls_back_with_one_warning(caplog):
    """A backend that fails (as Inductor does without a C++ compiler): the eager result, one
    warning, no second try."""
    calls = []

    def broken_backend(gm, example_inputs):
        calls.append(1)
        raise RuntimeError("no working C++ compiler found")

    def piece(scale: float, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * scale

    guarded = GuardedCompile(piece, "piece", lambda fn: torch.compile(fn, backend=broken_backend))
    x = torch.randn(4, 3)
    with caplog.at_level(logging.WARNING, logger="splitmoe"):
        assert torch.equal(guarded(2.0, x), torch.relu(x) * 2.0)
        assert torch.equal(guarded(3.0, x), torch.relu(x) * 3.0)
    assert len(calls) == 1 and guarded.compiled is None
    warned = [r.getMessage() for r in caplog.records if "torch.compile of piece" in r.getMessage()]
    assert len(warned) == 1 and "C++ compiler" in warned[0]
    # a call with no rows runs eagerly (an idle rank's empty micro-batch compiles nothing)
    ok = GuardedCompile(piece, "ok", lambda fn: torch.compile(fn, backend=broken_backend))
    assert ok(1.0, x[:0]).shape == (0, 3) and ok.compiled is not None
