"""What an operator sees when a prefill-decode deployment is set up wrong: no secret, a
short one, Mooncake missing or its system library missing. Each is an error naming what to
set or install, before any rank starts, and never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from splitmoe.config import KVTransferConfig
from splitmoe.kv_transfer.auth import SECRET_ENV

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(module: str, args: list[str], env: dict, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, **env}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (env.pop("SHIM", ""), REPO, os.environ.get("PYTHONPATH", "")) if p
    )
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )


def no_secret() -> dict:
    return {SECRET_ENV: ""}


@pytest.fixture
def serve_args(tiny_ckpt):
    ckpt = str(tiny_ckpt("qwen3_moe"))
    return ["--model", ckpt, "--kv-role", "prefill", "--kv-connector", "mooncake", "--port", "1"]


def test_an_instance_with_a_connector_and_no_secret_refuses_to_start(serve_args, tmp_path):
    done = run("splitmoe.serve", serve_args, no_secret(), tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert SECRET_ENV in done.stderr and "--kv-secret-file" in done.stderr, done.stderr
    done = run("splitmoe.serve", serve_args, {SECRET_ENV: "short"}, tmp_path)
    assert done.returncode == 2 and "at least 16" in done.stderr, done.stderr
    secret_file = tmp_path / "secret"
    done = run("splitmoe.serve", [*serve_args, "--kv-secret-file", str(secret_file)], {}, tmp_path)
    assert done.returncode == 2 and "cannot read the KV secret file" in done.stderr


def test_the_router_needs_the_secret_too(tmp_path):
    args = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--port", "1"]
    done = run("splitmoe.router", args, no_secret(), tmp_path)
    assert done.returncode == 2 and SECRET_ENV in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "shim,names",
    [
        ("raise ModuleNotFoundError(\"No module named 'mooncake.engine'\")", "splitmoe[pd]"),
        (
            "raise ImportError('libibverbs.so.1: cannot open shared object file')",
            "apt-get install libibverbs1",
        ),
    ],
)
def test_a_missing_mooncake_is_named_before_any_rank_starts(serve_args, tmp_path, shim, names):
    pkg = tmp_path / "shim" / "mooncake"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(shim + "\n")
    env = {SECRET_ENV: "x" * 32, "SHIM": str(tmp_path / "shim")}
    done = run("splitmoe.serve", serve_args, env, tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert names in done.stderr and "kv_connector='mooncake'" in done.stderr


def test_the_python_api_refuses_a_connector_without_a_secret(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match=SECRET_ENV):
        KVTransferConfig(kv_role="decode", kv_connector="mooncake")
    assert KVTransferConfig().kv_connector is None  # (no connector: no secret needed)
