"""A two-node job on one host: two torchrun agents that meet through a c10d rendezvous, each
starting two ranks of ``python -m splitmoe.launch`` with the two-phase transport; greedy tokens
equal to HF's."""

from __future__ import annotations

from launch_jobs import hf_tokens, launch_args, read_output, run_jobs, torchrun, write_input

from splitmoe.launch import _free_port

NODES, RANKS_PER_NODE = 2, 2
ATTENTION_RANKS = 2  # node 0: attention ranks 0-1; node 1: expert ranks 2-3
# A hang (a lost rendezvous, a collective that never completes) fails within this.
TIMEOUT_S = 120


def test_two_nodes_two_phase(tmp_path, tiny_ckpt, hf_ref):
    """The launcher takes the node size from torchrun's LOCAL_WORLD_SIZE, so each attention rank
    sees both expert ranks on the other node: the two-phase transport aggregates the node's rows
    onto one proxy per expert rank (rank 0 for rank 2, rank 1 for rank 3) before they cross."""
    ckpt = tiny_ckpt("qwen3_moe")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(inp)
    endpoint = f"127.0.0.1:{_free_port()}"
    args = launch_args(ckpt, ATTENTION_RANKS, inp, out, "--transport", "two_phase")
    # The c10d rendezvous numbers the agents as they join (torch ignores --node-rank for it,
    # with a warning): whichever is first gets ranks 0-1. The first command hosts its store;
    # left to guess, both agents would try, as both match the endpoint's host.
    cmds = [
        torchrun(
            "--nnodes",
            str(NODES),
            "--nproc-per-node",
            str(RANKS_PER_NODE),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            tmp_path.name,
            "--rdzv-conf",
            f"is_host={int(node == 0)}",
            "--local-addr",
            "127.0.0.1",
        )
        + args
        for node in range(NODES)
    ]
    logs = run_jobs(cmds, tmp_path, timeout_s=TIMEOUT_S)
    assert [r["token_ids"] for r in read_output(out)] == hf_tokens(ckpt, hf_ref)
    # Rank 0 (on whichever agent got group rank 0) names the nodes its topology saw.
    summary = [l for log in logs for l in log.splitlines() if l.startswith("splitmoe.launch:")]
    assert len(summary) == 1, logs
    assert f"{ATTENTION_RANKS} attention + 2 expert ranks, {NODES} node(s)" in summary[0]
