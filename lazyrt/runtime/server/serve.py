"""serve(): run the processes and the HTTP app until a signal or a child's death.

Startup: children load in the background while HTTP already answers (/health is 503). Once the
pipeline reports ready, one real 1-token generation goes through every process; only then is
/health 200. A child that dies fails pending requests, is logged, and the server exits non-zero; so
does a start-up that cannot complete (a --max-model-len past the model's, a failed warm-up, a child
whose start-up hit bad input: it logged one line naming the flag). The port is bound before any child
starts (one in use: an error naming --port).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
from dataclasses import dataclass

import uvicorn

from lazyrt.config import EngineConfig
from lazyrt.process_name import set_process_name
from lazyrt.runtime.ipc.messages import ErrorOut, GenerateReq
from lazyrt.runtime.server.app import ServerState, create_app
from lazyrt.runtime.server.pipeline_client import PipelineClient
from lazyrt.runtime.server.processes import ProcessGroup
from lazyrt.runtime.worker.process import STARTUP_FAILED
from lazyrt.sampling_params import SamplingParams

logger = logging.getLogger("lazyrt")
_WATCH_S = 0.5
# An idle keep-alive connection stays open this long: past the clients' own expiry (httpx / the OpenAI
# client 5 s, aiohttp, the router's relay, 15 s), so a client never reuses a connection the server is
# closing at that moment ("Server disconnected without sending a response"; uvicorn's default is 5 s).
KEEP_ALIVE_S = 30


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    log_level: str = "info"
    served_model_name: str | None = None


def served_name(cfg: EngineConfig) -> str:
    if cfg.model is None:
        return "SmolLM2-135M-Instruct"
    return os.path.basename(os.path.normpath(str(cfg.model))) or str(cfg.model)


def _stop(server: uvicorn.Server, state: ServerState, status: dict, why: str) -> None:
    """Start-up cannot complete: say why and exit non-zero (not a server that stays unhealthy)."""
    logger.error("%s; shutting down", why)
    state.healthy = False
    status["code"] = 1
    server.should_exit = True


async def _warmup(state: ServerState, cfg: EngineConfig, server: uvicorn.Server, status: dict) -> None:
    client = state.client
    await client.ready.wait()
    info = client.ready_info
    if cfg.max_model_len is not None and info.max_context < cfg.max_model_len:
        _stop(server, state, status, f"--max-model-len {cfg.max_model_len}: the model's context length "
              f"is {info.max_context}; pass at most that, or leave the flag out")  # fmt: skip
        return
    req = GenerateReq(client.new_rid(), SamplingParams(max_tokens=1, ignore_eos=True), text="Hello")
    q = client.submit(req)
    while True:
        out = await q.get()
        if isinstance(out, ErrorOut):
            _stop(server, state, status, f"the warm-up generation (a 1-token prompt, 1 token out) failed: "
                  f"{out.message}")  # fmt: skip
            return
        if out.finish_reason is not None:
            break
    state.healthy = True
    logger.info(
        "ready: %s on %s, %d KV pages of %d tokens",
        info.model_id,
        info.device,
        info.num_pages,
        info.page_size,
    )


async def _watch(procs: ProcessGroup, state: ServerState, server: uvicorn.Server, status: dict) -> None:
    while not server.should_exit:
        if state.client.fatal:  # the in-process tokenizer could not start
            state.healthy = False
            status["code"] = 1
            server.should_exit = True
            return
        dead = procs.dead()
        if dead:
            if len(dead) == 1:
                await asyncio.sleep(_WATCH_S)  # one death often brings others (a rank's peers): name them all
                dead = procs.dead()
            why = "; ".join(
                f"the {n} process could not start (its error is above)"
                if c == STARTUP_FAILED
                else f"the {n} process exited unexpectedly (exit code {c})"
                for n, c in dead
            )
            logger.error("%s; shutting down", why)
            state.healthy = False
            state.client.fail_all(why)
            status["code"] = 1
            server.should_exit = True
            return
        await asyncio.sleep(_WATCH_S)


def serve(cfg: EngineConfig, opts: ServerOptions) -> int:
    """Run until SIGINT/SIGTERM (returns 0) or a child's death (returns 1)."""
    cfg.validate()
    set_process_name("lazyrt-http")  # the children name themselves (ipc.sockets.child_setup)
    logging.basicConfig(level=opts.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    holder: dict = {"server": None}

    def on_signal(sig: int, _frame: object) -> None:
        # Before uvicorn has its own handlers (and when it re-raises ours after shutdown).
        if holder["server"] is not None:
            holder["server"].should_exit = True
        else:
            raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:  # before any child starts, and held: the port cannot be taken between this and serving
        socks = listen_sockets(opts.host, opts.port)
    except ValueError as e:
        logger.error("%s", e)
        return 1
    status = {"code": 0}
    try:
        procs = ProcessGroup(cfg, opts.log_level)
    except BaseException:
        for s in socks:
            s.close()
        raise
    try:
        procs.start()
        asyncio.run(_main(cfg, opts, procs, holder, status, socks))
    except KeyboardInterrupt:
        pass
    finally:
        holder["server"] = None
        procs.stop()
        for s in socks:
            s.close()
    return status["code"]


def listen_sockets(host: str, port: int) -> list[socket.socket]:
    """The sockets uvicorn would bind (as asyncio's create_server: one per address `host` resolves to,
    SO_REUSEADDR, IPv6 ones v6-only), bound now for it to serve on. A port in use is a ValueError naming
    --port (uvicorn's own error named no flag, after the children had started)."""
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except (OSError, UnicodeError) as e:
        raise ValueError(f"--host: cannot listen on {host!r}: {getattr(e, 'strerror', None) or e}") from None
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            s = socket.socket(family, kind, proto)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and socket.has_ipv6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(addr)
    except OSError as e:
        for s in socks:
            s.close()
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        why = (e.strerror or str(e)).lower()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"--port {port}: cannot listen on {where}: {why} (another server?); pass "
                             "another --port, or --port 0 for any free one") from None  # fmt: skip
        if e.errno == errno.EACCES:
            raise ValueError(f"--port {port}: cannot listen on {where}: {why}") from None
        raise ValueError(f"--host {host}, --port {port}: cannot listen on {where}: {why}") from None
    return socks


class _Server(uvicorn.Server):
    """uvicorn.Server on the sockets serve() bound; says where it listens, as uvicorn does when it binds
    them itself (with --port 0, the port it got)."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and sockets:
            self._log_started_message(sockets)


async def _main(
    cfg: EngineConfig,
    opts: ServerOptions,
    procs: ProcessGroup,
    holder: dict,
    status: dict,
    socks: list[socket.socket],
) -> None:
    client = PipelineClient(procs.ipc, cfg.tokenizer_in_http, cfg.document_store)
    state = ServerState(client, opts.served_model_name or served_name(cfg), opts.api_key)
    app = create_app(state)
    config = uvicorn.Config(
        app,
        host=opts.host,
        port=opts.port,
        log_level=opts.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=2,
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    server = _Server(config)
    holder["server"] = server
    tasks = [
        asyncio.create_task(client.run()),
        asyncio.create_task(_warmup(state, cfg, server, status)),
        asyncio.create_task(_watch(procs, state, server, status)),
    ]
    try:
        await server.serve(sockets=socks)
        if not server.started and status["code"] == 0:
            status["code"] = 1  # the app's start-up failed, for example
    finally:
        for t in tasks:
            t.cancel()
        client.close()
