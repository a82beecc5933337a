"""Shared fixtures: tiny random checkpoints (one per family, built once per
session, lazily) and cached HF transformers greedy references."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Rank processes spawned by the runtime (and torchrun / mpirun children)
# inherit this environment: on a 2-core machine, several processes each with
# a full OpenMP pool would oversubscribe the CPU badly.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
for p in (str(TESTS_DIR), str(REPO_ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)
# Spawned processes (torchrun, mpirun, the runtime's ranks) must find the package too.
_pp = os.environ.get("PYTHONPATH", "")
if str(REPO_ROOT) not in _pp.split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([_pp] if _pp else []))

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

# Without a GPU the Triton kernels run in Triton's interpreter (tests/kernels, test_e2e_triton).
# It is chosen when triton is first imported, so it is set here, before anything (splitmoe,
# tiny_models) may import it; rank processes spawned by the tests inherit it. With CUDA the
# kernels compile as usual.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import tiny_models  # noqa: E402

# name -> (family, kwargs for make_tiny_checkpoint)
CHECKPOINT_SPECS = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "mixtral": ("mixtral", {}),
    "olmoe": ("olmoe", {}),
    # 3 layers: layer 0 dense (first_k_dense_replace=1), layers 1-2 MoE with a shared expert.
    "glm4_moe": ("glm4_moe", {"num_layers": 3}),
    "minimax_m2": ("minimax_m2", {}),
    # 3 layers, layer 0 a dense MLP (mlp_only_layers), layers 1-2 MoE.
    "qwen3_moe_dense": ("qwen3_moe", {"num_layers": 3, "mlp_only_layers": [0]}),
    # MLA: 3 layers, layer 0 dense. V3 with q LoRA, YaRN, interleaved rotary and attention
    # biases; V3 without q LoRA, default rope, halves rotary; V2 without q LoRA.
    "deepseek_v3": ("deepseek_v3", {"num_layers": 3}),
    "deepseek_v3_nolora": (
        "deepseek_v3",
        {
            "num_layers": 3,
            "q_lora_rank": None,
            "rope_interleave": False,
            "attention_bias": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    "deepseek_v2": ("deepseek_v2", {"num_layers": 3}),
    # sliding-window layer 0, full layer 1 (tiny_models.GPT_OSS_WINDOW = 8 keys)
    "gpt_oss": ("gpt_oss", {}),
}


@pytest.fixture(scope="session", autouse=True)
def kernel_choice_cache(tmp_path_factory):
    """The CPU kernel choices tests measure (`splitmoe.kernels.cpu_choice`) go to a file of
    this session, not the user's ``~/.cache/splitmoe``; rank processes inherit the variable."""
    old = os.environ.get("SPLITMOE_CACHE_DIR")
    os.environ["SPLITMOE_CACHE_DIR"] = str(tmp_path_factory.mktemp("splitmoe-cache"))
    yield Path(os.environ["SPLITMOE_CACHE_DIR"])
    if old is None:
        del os.environ["SPLITMOE_CACHE_DIR"]
    else:
        os.environ["SPLITMOE_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """``tiny_ckpt(name, **extra)`` -> Path of a checkpoint, built once per session.

    ``name`` is a key of CHECKPOINT_SPECS; ``extra`` overrides go to
    make_tiny_checkpoint (and make a distinct checkpoint)."""
    cache: dict = {}

    def get(name: str, **extra) -> Path:
        key = (name, tuple(sorted((k, repr(v)) for k, v in extra.items())))
        if key not in cache:
            family, kwargs = CHECKPOINT_SPECS[name]
            kwargs = dict(kwargs, **extra)
            label = name + "".join(f"-{k}{v}" for k, v in sorted(extra.items()))
            out = tmp_path_factory.mktemp(
                label.replace(" ", "").replace("[", "").replace("]", "").replace(",", "_")
            )
            cache[key] = tiny_models.make_tiny_checkpoint(family, out, **kwargs)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def hf_ref():
    """``hf_ref(ckpt, prompt_ids, n)`` -> HF greedy continuation (n tokens), cached."""
    cache: dict = {}

    def get(ckpt, prompt_ids, n: int) -> list[int]:
        key = (str(Path(ckpt).resolve()), tuple(prompt_ids))
        have = cache.get(key)
        if have is None or len(have) < n:
            # Greedy is prefix-consistent: a longer run answers shorter queries too.
            have = tiny_models.hf_greedy(ckpt, list(prompt_ids), max(n, 24))
            cache[key] = have
        return list(have[:n])

    return get


# Test modules that assert how long something takes (a deadline met, a stall bounded, a stream
# never pausing) or kill and stop ranks on a timer: `scripts/test.sh` runs them alone, after the
# rest has run in parallel (pytest-xdist), so that another test's processes on the same two
# cores do not make their clocks lie.
SERIAL_MODULES = {
    "comm/test_membership.py",
    "comm/test_nonblocking.py",
    "kernels/test_cpu_choice.py",
    "kernels/test_settle.py",
    "pd/test_agent.py",
    "pd/test_connector.py",
    "pd/test_pd_edges.py",
    "pd/test_pd_soak.py",
    "server/test_metrics_scrape.py",
    "server/test_schema_check.py",
    "server/test_server_edges.py",
    "server/test_server_fault_tolerance.py",
    "server/test_tool_parser_bounds.py",
    "test_fault_tolerance.py",
    "test_lifecycle.py",
    "test_micro_batch_choice.py",
    "test_warm_up.py",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        rel = Path(str(item.fspath)).resolve().relative_to(TESTS_DIR).as_posix()
        if rel in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)
