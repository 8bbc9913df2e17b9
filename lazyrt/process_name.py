"""The name a lazyrt process shows in `top`, `ps -o comm` and psutil (lazyrt-http, lazyrt-tokenize,
lazyrt-schedule, lazyrt-worker, lazyrt-router, ...): every process of a server is otherwise
`python3`, and telling which one is busy is the first question of a profile (the router's
replicas, benchmarks/rag_serving.py --sample-cpu). Also: a child that is signalled when its parent
dies, however it dies (the router's --dp replicas)."""

from __future__ import annotations

import ctypes
import sys

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_PR_SET_NAME = 15
NAME_BYTES = 15  # the kernel keeps 15 bytes and a NUL


def set_process_name(name: str) -> bool:
    """Names the calling thread, and with it the process when called from the main thread (threads
    started later inherit it); Linux only, the name cut to 15 bytes. Returns whether it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_NAME, name.encode()[:NAME_BYTES], 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def signal_when_parent_dies(sig: int) -> bool:
    """Asks the kernel to send `sig` to the calling process when its parent exits, even by SIGKILL
    (for subprocess.Popen's preexec_fn: a replica must not outlive the router holding its GPU);
    Linux only. Returns whether it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
