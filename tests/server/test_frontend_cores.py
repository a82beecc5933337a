"""``python -m splitmoe.serve --frontend-cores``: the cores the CPU ranks leave to the server."""

from __future__ import annotations

from splitmoe.serve import build_parser, main, rank_threads


def test_rank_threads_share_what_the_front_end_leaves():
    assert rank_threads(16, 1, 1) == 15
    assert rank_threads(16, 0, 1) == 16
    assert rank_threads(16, 2, 2) == 7
    assert rank_threads(2, 1, 1) == 1
    assert rank_threads(2, 4, 3) == 1  # never fewer than one thread


def test_default_and_bad_value(tmp_path, capsys):
    assert build_parser().parse_args(["--model", str(tmp_path)]).frontend_cores == 0
    assert main(["--model", str(tmp_path), "--frontend-cores", "-1"]) == 2
    assert "--frontend-cores -1 must be >= 0" in capsys.readouterr().err
