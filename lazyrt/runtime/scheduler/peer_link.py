"""The sockets between peer replicas' schedulers (peer KV): each binds a PULL socket at its own
peer address and PUSHes to the others'; every message names its sender (its address), so one
inbound socket serves every peer and an answer goes back to the address it names."""

from __future__ import annotations

import zmq

from lazyrt.runtime.ipc.sockets import send, socket


class PeerLink:
    def __init__(self, ctx: zmq.Context, names: list[str]):
        """names: this replica's peer address first, then the others' (PeerKV.names)."""
        try:
            self.inbox = socket(ctx, zmq.PULL, names[0], bind=True)
        except zmq.ZMQError as e:
            raise ValueError(f"kv_peers: cannot listen on {names[0]} ({e}): in use?") from e
        # a peer that is not up yet gets its messages when it binds (zmq reconnects); an unsent one is
        # dropped at close (linger 0)
        self.out = {i: socket(ctx, zmq.PUSH, a, bind=False) for i, a in enumerate(names) if i}

    def send_all(self, messages: list[tuple[int, object]]) -> None:
        for peer, msg in messages:
            send(self.out[peer], msg)

    def close(self) -> None:
        self.inbox.close(linger=0)
        for s in self.out.values():
            s.close(linger=0)
