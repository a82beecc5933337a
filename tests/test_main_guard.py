"""A script that creates its `LLM` at the top level, without the main guard: the ranks, started
with multiprocessing's "spawn" method, run the script again; the rank refuses to build an LLM of
its own, and both its error and the front end's name the fix."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from small_default import write_small_model

GUARD = 'if __name__ == "__main__":'
TIMEOUT_S = 120

_SCRIPT = textwrap.dedent(
    """
    import sys
    from splitmoe import LLM, SamplingParams

    llm = LLM(sys.argv[1], attention_ranks=1, expert_ranks=1, device="cpu")
    print(llm.generate([[1, 2]], SamplingParams(max_tokens=2)))
    """
)


def test_unguarded_script_names_the_main_guard(tmp_path):
    ckpt = write_small_model(tmp_path / "model")
    script = tmp_path / "unguarded.py"
    script.write_text(_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(ckpt)],
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    err = proc.stderr
    assert proc.returncode != 0, err
    # each rank, running the script again, refuses to create an LLM (its traceback on stderr)
    child = [l for l in err.splitlines() if l.startswith("RuntimeError: LLM(...) was called")]
    assert child, err
    assert f"under `{GUARD}`" in child[0]
    # the front end's start-up failure carries the hint too
    (failure,) = [l for l in err.splitlines() if l.startswith("splitmoe.llm.RankFailure:")]
    assert "during start-up, before reporting in" in failure, failure
    assert str(script) in failure and f"under `{GUARD}`" in failure, failure
    assert "no progress" not in failure  # (found at once, not after the start-up timeout)
