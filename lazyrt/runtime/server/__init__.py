"""The HTTP process, first stage of a served request, and the process manager.

- serve.py: `serve()`, run by `python -m lazyrt.launch`: starts the processes, runs uvicorn, checks
  health, stops everything on a signal or a child's death.
- processes.py: ProcessGroup, the tokenizer, scheduler and model worker processes (the tokenizer
  runs in this process instead with --tokenizer-in-http).
- scheduler_worker_process.py: the scheduler's process with the model worker called in it (no
  worker process; --worker-in-scheduler).
- app.py: the FastAPI routes (/generate, /score, /v1/*, /health, /metrics, /cache_stats, ...).
- protocol.py: request bodies -> GenerateReq, with 4xx errors naming the field.
- constraint_fields.py: response_format / guided_* / sampling_params constraints -> SamplingParams.
- tool_grammar.py: tool_choice 'required' / a named function as a grammar in the tool-call format.
- errors.py: ApiError, the 4xx/5xx with OpenAI's error body.
- document_routes.py: /v1/documents routes (the store lives with the tokenizer, here or in its process).
- pipeline_client.py: sends GenerateReqs to the tokenizer (its process, or its loop in this one),
  routes TextOuts back per request.
- metrics.py: Prometheus metrics in the server's own registry.
- doc_owners.py: the router's x-lazyrt-doc-owners header (peer KV: where each document is cached).

The top of the process tree: it may start every process, but it never touches the model or the
caches itself (the scheduler and worker run elsewhere; with --tokenizer-in-http it tokenizes).

May import: lazyrt.api_key, lazyrt.cache (placement.py's header name only), lazyrt.config,
lazyrt.constraint, lazyrt.documents (request checks only), lazyrt.process_name,
lazyrt.sampling_params, lazyrt.runtime.ipc, and the process entry points lazyrt.runtime.tokenizer,
lazyrt.runtime.scheduler, lazyrt.runtime.worker.
"""
