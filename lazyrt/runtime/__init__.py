"""The serving runtime. A request flows one way through these packages:

    frontend (lazyrt_frontend) or any HTTP client
      -> server/     HTTP process: FastAPI app, request parsing (OpenAI + /generate), metrics;
                     starts the other processes (processes.py)
      -> tokenizer/  text -> token ids (chat/RAG templates, document token cache): a thread of the
                     HTTP process by default, a process of its own with --no-tokenizer-in-http
      -> scheduler/  scheduler process: radix cache + chunk table, admission, the step plan
      -> worker/     the device, weights and KV pages; runs a plan, samples: called inside the
                     scheduler's process by default, a process of its own with --no-worker-in-scheduler
      -> tokenizer/  detokenizes the sampled tokens (stop strings) -> server/

    ipc/         messages between the processes, their wire format and the ZMQ sockets
    engine/      `lazyrt.Engine`: scheduler + worker + tokenizer in one process, no ZMQ

Each package's __init__ says what it owns and what it may import (tests/test_import_graph.py
enforces both that list and the absence of import cycles).
"""
