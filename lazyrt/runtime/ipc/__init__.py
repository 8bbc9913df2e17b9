"""How the processes talk: typed messages (messages.py: plain dataclasses, msgpack with one type tag
per class, no pickle) and the ZMQ plumbing (sockets.py: ipc:// addresses in a private temp dir,
send/recv, child-process setup).

The bottom of the runtime: every process imports it, it imports none of them.

May import: lazyrt.process_name, lazyrt.sampling_params
"""
