"""python -m lazyrt.router: one OpenAI-compatible address in front of several lazyrt.launch replicas.

  python -m lazyrt.router --worker http://127.0.0.1:30001 --worker http://127.0.0.1:30002
  python -m lazyrt.router --dp 2 -- --model /models/llama --device cuda   # starts the replicas itself
  python -m lazyrt.router --dp 2 --dp-devices 0,1 --dp-kv-peers -- --model /models/llama   # peer KV
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from functools import partial
from urllib.parse import urlsplit

import uvicorn

from lazyrt.process_name import set_process_name, signal_when_parent_dies
from lazyrt.router.app import Replica, RouterState, create_router_app
from lazyrt.router.policy import POLICIES, AffinityPolicy

logger = logging.getLogger("lazyrt.router")
LOG_LEVELS = ("debug", "info", "warning", "error")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lazyrt.router",
        description="Route requests over lazyrt.launch replicas: each goes to the replica that already "
        "holds most of its documents' KV (rendezvous hashing on the documents, bounded by load), "
        "else to the least-loaded one; a replica that fails before answering is skipped.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Arguments after -- go to every replica `--dp` starts (python -m lazyrt.launch ...).",
    )
    p.add_argument("--worker", action="append", default=[], metavar="URL", help="a running replica (repeat)")
    p.add_argument("--dp", type=int, default=0, help="start N replicas (lazyrt.launch)")
    p.add_argument("--dp-base-port", type=int, default=31000, help="--dp: the replicas' first port")
    p.add_argument("--dp-devices", default=None,
                   help="--dp: CUDA devices, one per replica (CUDA_VISIBLE_DEVICES; with --dp-kv-peers "
                        "--device cuda:N, every device visible), e.g. 0,1")  # fmt: skip
    p.add_argument("--dp-kv-peers", action="store_true",
                   help="--dp: the replicas keep each document once between them and read each other's "
                        "KV pages (lazyrt.launch --kv-peers; one host); routing then defaults to "
                        "least_loaded (any replica reads every cached document)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=30000, help="port to listen on")
    p.add_argument("--imbalance", type=float, default=0.5,
                   help="skip a request's document owner when its in-flight requests exceed "
                        "(1 + imbalance) x the least-loaded replica's + --slack")  # fmt: skip
    p.add_argument("--slack", type=int, default=16,
                   help="see --imbalance (a replica batches: a few more requests in flight cost less "
                        "than a request computing its documents away from them)")  # fmt: skip
    p.add_argument("--policy", default=None, choices=POLICIES,
                   help="affinity (the default): where the documents are (the router's view of each "
                        "cache), else their rendezvous owners; hash: the owners only; owner: where peer KV "
                        "replicas cache most of the documents (fewer copies, less even load); "
                        "least_loaded (the default with --dp-kv-peers), round_robin")
    p.add_argument("--api-key", default=None, help="required from clients, and sent to the replicas")
    p.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS, help="logging level")
    return p


def check_args(
    p: argparse.ArgumentParser, argv: list[str], args: argparse.Namespace, extra: list[str]
) -> None:
    """Exits with a usage error naming the flag for a combination parse_args lets through: no replica, a
    worker URL that cannot be one (or given twice), a port out of range, `--dp` options without --dp."""
    if not args.worker and args.dp <= 0:
        p.error("give --worker URL (repeat) or --dp N")
    if args.dp < 0:
        p.error(f"--dp {args.dp}: must be >= 0 (the number of replicas to start)")
    if not args.imbalance >= 0:  # (not >=: NaN)
        p.error(f"--imbalance {args.imbalance}: must be a number >= 0")
    if args.slack < 0:
        p.error(f"--slack {args.slack}: must be >= 0")
    if args.api_key == "":
        p.error("--api-key: must not be empty (leave it out for no key)")
    if not 0 <= args.port <= 65535:
        p.error(f"--port {args.port}: must be in [0, 65535]")
    base, dp = args.dp_base_port, args.dp
    if dp > 0 and not 1 <= base <= 65536 - dp:
        p.error(f"--dp-base-port {base}: the replicas' ports must be in [1, 65535] (--dp {dp})")
    if dp > 0 and base <= args.port < base + dp:
        p.error(f"--port {args.port} is one of the replicas' (--dp-base-port {base}, --dp {dp})")
    if args.dp <= 0:  # what only --dp uses would be ignored
        given = _given(argv)
        for flag in ("--dp-base-port", "--dp-devices"):
            if flag in given:
                p.error(f"{flag}: only with --dp N (the replicas the router starts)")
        if extra:
            p.error(f"arguments after -- ({' '.join(extra)}) go to the replicas --dp starts: give --dp N")
    if args.dp_devices is not None and args.dp > 0 and len(args.dp_devices.split(",")) != args.dp:
        p.error(f"--dp-devices names {len(args.dp_devices.split(','))} devices for --dp {args.dp}")
    seen: dict[tuple, str] = {}
    dp_urls = [f"http://127.0.0.1:{args.dp_base_port + i}" for i in range(max(args.dp, 0))]
    for url, source in [*((w, "--worker") for w in args.worker), *((u, "--dp") for u in dp_urls)]:
        why = worker_url_error(url)
        if why is not None:
            p.error(f"--worker {url!r}: {why}")
        u = urlsplit(url)
        key = (u.scheme, u.hostname, u.port or (443 if u.scheme == "https" else 80), u.path.rstrip("/"))
        if key in seen:
            what = "given twice" if source == "--worker" else "a replica --dp starts there"
            p.error(f"--worker {seen[key]!r}: {what} (each replica once)")
        seen[key] = url


def worker_url_error(url: str) -> str | None:
    """Why url cannot be a replica's address (http[s]://host[:port][/path], no query or fragment)."""
    try:
        u = urlsplit(url)
        u.port  # noqa: B018 (raises ValueError for a port that is not a number in [0, 65535])
    except ValueError as e:
        return f"not a URL ({e})"
    if u.scheme not in ("http", "https") or not u.hostname:
        return "must be http://HOST:PORT or https://HOST:PORT"
    if u.query or u.fragment or "?" in url or "#" in url:
        return "must not have a query or a fragment"
    return None


def _given(argv: list[str]) -> set[str]:
    """The long options argv gives (however abbreviated), by their full names."""
    p = build_parser()
    for a in p._actions:
        a.default = argparse.SUPPRESS
    return {"--" + k.replace("_", "-") for k in vars(p.parse_args(argv))}


def _start_replicas(
    n: int, base_port: int, devices: str | None, extra: list[str], kv_peers: bool = False
) -> list[subprocess.Popen]:
    devs = devices.split(",") if devices else []
    if devs and len(devs) != n:
        raise SystemExit(f"--dp-devices names {len(devs)} devices for --dp {n}")
    # peer KV: each replica's address for the others (a private directory, removed with the router's tmp)
    peer_dir = tempfile.mkdtemp(prefix="lazyrt-router-peers-") if kv_peers else ""
    addrs = [f"ipc://{os.path.join(peer_dir, f'r{i}')}" for i in range(n)] if kv_peers else []
    procs = []
    for i in range(n):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "lazyrt.launch", "--port", str(base_port + i), *extra]
        if kv_peers:  # replicas read each other's GPU memory: every device stays visible
            cmd += ["--kv-peer-addr", addrs[i], "--kv-peers", *(a for j, a in enumerate(addrs) if j != i)]
            cmd += ["--device", f"cuda:{devs[i]}"] if devs else []
        elif devs:
            env["CUDA_VISIBLE_DEVICES"] = devs[i]
        # SIGTERM when the router dies, even by SIGKILL: a replica holds a GPU and a port
        on_death = partial(signal_when_parent_dies, signal.SIGTERM)
        out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}  # tagged lines: _tag_output
        p = subprocess.Popen(cmd, env=env, preexec_fn=on_death, **out)
        tag = f"[replica {i} :{base_port + i}] ".encode()
        threading.Thread(target=_tag_output, args=(p, tag), name=f"dp{i}-output", daemon=True).start()
        procs.append(p)
    return procs


def _tag_output(proc: subprocess.Popen, tag: bytes) -> None:
    """A replica's output, each line tagged with the replica, on the router's stderr: the replicas'
    logs interleave, and an error must say whose it is."""
    out = sys.stderr.buffer
    for line in iter(proc.stdout.readline, b""):
        out.write(tag + line)
        out.flush()


def _stop_replicas(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _interrupt(sig: int, _frame: object) -> None:
    raise KeyboardInterrupt


def _watch_replicas(procs: list[subprocess.Popen], urls: list[str], server: uvicorn.Server,
                    done: threading.Event, all_died: threading.Event) -> None:  # fmt: skip
    """Names each `--dp` replica whose process ends on its own (a bad flag, out of memory, killed);
    when none is left, stops the router (it would only answer 503) with all_died set."""
    told: set[int] = set()
    while not done.wait(0.5):
        for i, p in enumerate(procs):
            if i not in told and p.poll() is not None and not done.is_set():  # (not our own stop)
                told.add(i)
                logger.error("replica %s exited with code %s (its output is above)", urls[i], p.returncode)
        if len(told) == len(procs):
            logger.error("no --dp replica is left; stopping the router")
            all_died.set()
            server.should_exit = True
            return


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    args = build_parser().parse_args(own)
    check_args(build_parser(), own, args, extra)
    if args.dp_kv_peers and args.dp < 2:
        build_parser().error("--dp-kv-peers needs --dp 2 or more (replicas it starts on this host)")
    if args.policy is None:
        args.policy = "least_loaded" if args.dp_kv_peers else "affinity"
    fmt = "%(asctime)s %(name)s %(levelname)s %(message)s"
    set_process_name("lazyrt-router")
    logging.basicConfig(level=args.log_level.upper(), format=fmt)
    if logging.getLogger().level > logging.DEBUG:
        # httpx logs every proxied request at INFO: a line a request costs the router's one core
        logging.getLogger("httpx").setLevel(logging.WARNING)
    # uvicorn re-raises the SIGTERM / SIGINT it shut down on: with the default handler that would kill
    # this process before it stops its replicas (they would keep their GPUs), so raise instead.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    procs = []
    if args.dp > 0:
        procs = _start_replicas(args.dp, args.dp_base_port, args.dp_devices, extra, args.dp_kv_peers)
    urls = list(args.worker) + [f"http://127.0.0.1:{args.dp_base_port + i}" for i in range(args.dp)]
    policy = AffinityPolicy(args.imbalance, args.slack, args.policy)
    state = RouterState([Replica(u.rstrip("/")) for u in urls], policy, args.api_key)
    # idle keep-alive past the clients' own expiry, as the server's (runtime/server/serve.py KEEP_ALIVE_S)
    config = uvicorn.Config(create_router_app(state), host=args.host, port=args.port,
                            log_level=args.log_level.lower(), access_log=False,
                            timeout_keep_alive=30)  # fmt: skip
    server = uvicorn.Server(config)
    done, all_died = threading.Event(), threading.Event()
    if procs:
        watch = (procs, urls[len(args.worker) :], server, done, all_died)
        threading.Thread(target=_watch_replicas, args=watch, name="dp-watch", daemon=True).start()
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        done.set()
        _stop_replicas(procs)
    return 1 if all_died.is_set() or not server.started else 0


if __name__ == "__main__":
    sys.exit(main())
