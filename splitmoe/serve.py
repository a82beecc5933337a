"""The OpenAI-compatible server: ``python -m splitmoe.serve`` (or ``splitmoe serve``).

```
python -m splitmoe.serve --model CKPT --attention-ranks 2 --expert-ranks 2 --port 8000
curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
     -d '{"model": "CKPT", "prompt": "Hello", "max_tokens": 16, "temperature": 0}'
```

Every engine option of `splitmoe.config` is a flag (as for the launcher), checked before any rank
starts. Under torchrun or mpirun, rank 0 serves: its attention rank 0 is a child process that
joins the launcher's rendezvous, and every other process runs its rank (attention ranks
``1..A-1``, then the expert ranks), so one server fronts a multi-node job. The server on rank 0
picks an attention rank for each request; every rank, in whatever process or host, talks to it
directly over ZeroMQ (`splitmoe.engine.transport`: it learns the server's address from the
job's rendezvous store):

```
torchrun --nnodes 2 --nproc-per-node 4 ... -m splitmoe.serve --model CKPT --attention-ranks 2
```
 The HTTP server comes up first and answers ``GET /health`` with 503 until every rank is
ready. SIGTERM (or Ctrl-C) drains: no new connections, running requests finish (up to
``--shutdown-timeout`` s; what still runs then gets an error), the ranks stop, the process
exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from splitmoe.chat import ChatTemplate
from splitmoe.comm.distributed import shutdown_groups
from splitmoe.config import EngineConfig
from splitmoe.engine.channel import RankChannel
from splitmoe.engine.procs import LaunchedJob
from splitmoe.launch import detect_env, rendezvous
from splitmoe.models.loader import CheckpointReader
from splitmoe.options import add_engine_args, engine_args, engine_config
from splitmoe.runtime import available_cores, run_rank
from splitmoe.server.app import ServerState, build_app
from splitmoe.server.engine import AsyncEngine
from splitmoe.server.metrics import ServerMetrics
from splitmoe.server.protocol import Limits
from splitmoe.server.tool_parsers import TOOL_PARSERS, get_tool_parser
from splitmoe.tokenizer import Tokenizer

logger = logging.getLogger("splitmoe")

# Sequences that may wait beyond the running batch: a queue that drains in a few batches at
# the defaults (256 sequences an attention rank), and bounds the front end's memory for them.
DEFAULT_MAX_QUEUED = 1024
# The largest request head (request line and headers) h11 buffers: more is a 400 (h11's own
# default; an OpenAI client's headers are well under 1 KB)
MAX_HEADER_BYTES = 16 * 1024


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m splitmoe.serve", description="OpenAI-compatible HTTP server"
    )
    ap.add_argument("--model", required=True, help="HF checkpoint directory")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in the API (default: the --model directory's name; requests may "
        "also name the --model value)",
    )
    ap.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1; repeat for several keys (default: "
        "$SPLITMOE_API_KEY, else none)",
    )
    ap.add_argument(
        "--api-key-file",
        default=None,
        help="a file of API keys, one per line (blank lines and '#' comments skipped); adds to "
        "--api-key",
    )
    Limits.add_args(ap)
    ap.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file (or the template itself) used instead of the checkpoint's",
    )
    ap.add_argument(
        "--tool-call-parser",
        default=None,
        help="parse tool calls out of chat outputs into 'tool_calls': one of "
        + ", ".join(sorted(TOOL_PARSERS)),
    )
    ap.add_argument(
        "--max-queued-requests",
        type=int,
        default=DEFAULT_MAX_QUEUED,
        help="sequences that may wait beyond the running batch (max-num-seqs x attention "
        "ranks) before new requests get a 503 with Retry-After",
    )
    ap.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds that running requests have to finish",
    )
    ap.add_argument(
        "--frontend-cores",
        type=int,
        default=0,
        help="on CPU without --threads-per-rank: cores the ranks leave to this process (HTTP, "
        "tokenizing, streaming); each local rank gets (cores - this) // ranks threads, at least 1",
    )
    ap.add_argument(
        "--no-warmup",
        action="store_true",
        help="answer /health as soon as the ranks are up, without first running made-up "
        "requests at every batch size and prompt chunk (`LLM.warm_up`): the first clients' "
        "steps then pay for each shape's first call",
    )
    ap.add_argument("-v", "--verbose", action="store_true")
    add_engine_args(ap)
    return ap


@dataclass
class _Prepared:
    """What the server is built of, every part checked before any rank starts."""

    config: EngineConfig
    tokenizer: Tokenizer | None
    chat_template: ChatTemplate | None
    tool_parser: object
    limits: Limits
    api_keys: tuple[str, ...]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="[server] %(levelname)s %(message)s",
    )
    env = detect_env()
    try:
        ready = _prepare(args, env)
    except (ValueError, TypeError, OSError, ImportError) as e:
        print(f"splitmoe.serve: error: {e}", file=sys.stderr)
        return 2
    job = None
    if env.launcher != "single":
        init_method = rendezvous(env)
        if env.rank != 0:
            return _work(ready.config, env, init_method)
        job = LaunchedJob(init_method, env.local_rank, env.local_world_size)
    return _serve(args, ready, job)


def _prepare(args, env) -> _Prepared:
    """The engine config (built once) and the server's parts; a ValueError (or OSError,
    ImportError) names what is wrong."""
    options = engine_args(args)
    launched = env.launcher != "single"
    if launched:
        options["expert_ranks"] = env.world_size - options.get("attention_ranks", 1)
        if options["expert_ranks"] < 0:
            raise ValueError(
                f"--attention-ranks {options['attention_ranks']} exceeds the {env.launcher} "
                f"world size {env.world_size}; start at least that many processes"
            )
        if env.world_size < 2:
            raise ValueError("started by a launcher with one process: run it directly instead")
    if args.max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests {args.max_queued_requests} must be >= 0")
    if args.frontend_cores < 0:
        raise ValueError(f"--frontend-cores {args.frontend_cores} must be >= 0")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port {args.port} must be in 1..65535")
    config = engine_config(args.model, **options)
    if config.device_type == "cpu" and "threads_per_rank" not in options:
        # The server process works too (HTTP, detokenizing): a thread of a rank's pool that
        # loses its core to it stalls the pool's every barrier, while a core left to it idles
        # between requests. --frontend-cores says how many the ranks leave it (none by
        # default: the ranks serve more tokens with every core than with one left to the
        # server; docs/serving.md has the figures).
        ranks = env.local_world_size if launched else config.parallel.world_size
        threads = rank_threads(len(available_cores()), args.frontend_cores, ranks)
        config = dataclasses.replace(config, threads_per_rank=threads)
    CheckpointReader(args.model)
    if args.chat_template is not None:
        chat_template = ChatTemplate.from_file(args.chat_template, args.model)
    else:
        chat_template = ChatTemplate.from_checkpoint(args.model)
    parser = args.tool_call_parser
    return _Prepared(
        config,
        Tokenizer.from_checkpoint(args.model),
        chat_template,
        None if parser is None else get_tool_parser(parser),
        Limits.from_args(args),
        _api_keys(args),
    )


def _serve(args, ready: _Prepared, job: LaunchedJob | None) -> int:
    """Serves until SIGTERM (or Ctrl-C) has drained it; 1 if the engine failed."""
    config, limits = ready.config, ready.limits
    # (never a path of this host in a response: the directory's name, the path accepted too)
    name = args.served_model_name or Path(args.model).resolve().name or "model"
    metrics = ServerMetrics(name)
    state = ServerState(
        engine=AsyncEngine(config, ready.tokenizer, metrics, job, warmup=not args.no_warmup),
        config=config,
        tokenizer=ready.tokenizer,
        chat_template=ready.chat_template,
        served_model_name=name,
        model_alias=None if args.served_model_name else args.model,
        api_keys=ready.api_keys,
        max_queued_requests=args.max_queued_requests,
        metrics=metrics,
        limits=limits,
        tool_parser=ready.tool_parser,
    )
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(state),
            host=args.host,
            port=args.port,
            log_level="info" if args.verbose else "warning",
            timeout_graceful_shutdown=args.shutdown_timeout,
            http=header_deadline_protocol(limits.header_read_timeout),
            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        )
    )
    print(
        f"splitmoe.serve: serving {name!r} on http://{args.host}:{args.port} "
        f"({config.parallel.attention_ranks} attention + {config.parallel.expert_ranks} expert "
        "ranks; GET /health answers 200 once they are ready)",
        file=sys.stderr,
        flush=True,
    )
    # uvicorn drains on SIGTERM, then raises it again with the handler it found: this one, so a
    # drained server exits 0 rather than die by the signal
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    if state.engine.state == "failed":
        print(f"splitmoe.serve: error: {state.engine.error}", file=sys.stderr)
        return 1
    return 0


def header_deadline_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, with a deadline on each request's head: a connection that has
    not sent a whole request line and headers ``timeout_s`` after it opened, or after its last
    response ended, is closed. (uvicorn has none: a client sending a header byte every few
    seconds held a connection for ever; its keep-alive timeout stops at the first byte.) The
    body's own deadline is `splitmoe.server.http.BodyLimit`'s."""

    class HeaderDeadline(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_timer = None
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._head_timer is not None and self.conn.their_state is not h11.IDLE:
                self._head_timer.cancel()  # (the head is in: the request runs)
                self._head_timer = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()  # (a kept-alive connection: the next head has its deadline too)

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(timeout_s, self._head_late)

        def _head_late(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline


def rank_threads(cores: int, frontend_cores: int, ranks: int) -> int:
    """Threads of each of ``ranks`` local ranks when ``frontend_cores`` of ``cores`` are left to
    the server process: an equal share of the rest, at least 1."""
    return max(1, (cores - frontend_cores) // ranks)


def _api_keys(args) -> tuple[str, ...]:
    """The keys of --api-key, --api-key-file and $SPLITMOE_API_KEY (none: no key needed)."""
    keys = list(args.api_key or ())
    if not keys and os.environ.get("SPLITMOE_API_KEY"):
        keys.append(os.environ["SPLITMOE_API_KEY"])
    if args.api_key_file is not None:
        with open(args.api_key_file) as f:
            for line in f:
                line = line.strip()
                if line and not line.startswith("#"):
                    keys.append(line)
        if not keys:
            raise ValueError(f"--api-key-file {args.api_key_file} holds no key")
    for key in keys:
        if not key or any(c.isspace() for c in key):
            raise ValueError("an API key must be non-empty, without spaces")
    return tuple(dict.fromkeys(keys))


def _work(config, env, init_method: str) -> int:
    """A launched job's rank other than 0, until rank 0's server closes: connected to that
    server directly (its address and token come through the job's rendezvous store)."""
    channel = RankChannel(env.rank, takes_requests=env.rank < config.parallel.attention_ranks)
    try:
        run_rank(config, env.rank, init_method, channel, env.local_rank, env.local_world_size)
    except Exception as e:
        print(f"splitmoe.serve: rank {env.rank} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    shutdown_groups()
    return 0


if __name__ == "__main__":
    sys.exit(main())
