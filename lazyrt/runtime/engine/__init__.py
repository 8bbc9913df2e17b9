"""`lazyrt.Engine`: the whole pipeline in one process, for Python users, tests and batch jobs.

- engine.py: Engine: tokenizes, runs the scheduler's EngineCore against a ModelWorker called
  directly (no ZMQ), detokenizes; generate / rag / rag_batch / score; documents by reference
  (add_document, get / list / delete_document; requests pass {"id": ...}).
- engine_loop.py: EngineLoop: one thread runs an Engine's steps so requests from many threads
  batch together (the frontend's in-process backend, `python -m lazyrt.batch`).

May import: lazyrt.config, lazyrt.constraint, lazyrt.documents, lazyrt.prompt, lazyrt.sampling_params,
lazyrt.runtime.tokenizer, lazyrt.runtime.scheduler, lazyrt.runtime.worker
"""
