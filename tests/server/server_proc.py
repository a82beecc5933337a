"""A splitmoe server as a subprocess on a free local port, for the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (the server's ranks)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(d.name))
    return out


def descendants(pid: int) -> list[int]:
    """Live processes below ``pid``: its children, theirs, and so on."""
    out, todo = [], children(pid)
    while todo:
        out.append(todo.pop())
        todo += children(out[-1])
    return out


def rank_processes(pid: int) -> list[int]:
    """The rank processes front end ``pid`` started, oldest first (it starts them in rank
    order): its spawned children, and the children of its fork server (`engine.procs`)."""
    found = []
    for child in children(pid):
        try:
            cmd = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmd:
            found.append(child)
        elif b"multiprocessing.forkserver" in cmd:
            found += children(child)
    started = []
    for p in found:
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        started.append((int(stat.rsplit(")", 1)[1].split()[19]), p))
    return [p for _, p in sorted(started)]


class Server:
    def __init__(
        self,
        ckpt,
        *args: str,
        api_key: str | None = None,
        start_timeout: float = 120,
        env: dict[str, str] | None = None,
        warmup: bool = False,
        port: int | None = None,
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [sys.executable, "-m", "splitmoe.serve", "--model", str(ckpt)]
        cmd += ["--port", str(self.port), "--device", "cpu", "--dtype", "float32", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        if not warmup:  # (the server's default: tests that do not look at it skip its ~0.5 s)
            cmd += ["--no-warmup"]
        paths = [*(env or {}).get("PYTHONPATH", "").split(os.pathsep), str(REPO)]
        paths.append(os.environ.get("PYTHONPATH", ""))
        env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        self.log = open(
            Path(os.environ.get("TMPDIR", "/tmp")) / f"splitmoe-server-{self.port}.log", "w+"
        )
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + start_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                out = self.output()  # (before `stop` closes the log)
                self.stop()
                raise RuntimeError(f"server not healthy in {start_timeout} s:\n{out}")
            time.sleep(0.2)

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples by name (labels dropped, summed), through prometheus_client's
        parser."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=30).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
        return out

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
