"""The scheduler process: which requests run, where their KV lives, and what each step computes.

- process.py: the process loop (SchedulerLoop): takes TokenizedReqs, aborts and control requests,
  runs steps against the model worker over ZMQ, sends TokenBatches to the detokenizer.
- engine_core.py: EngineCore, the step loop shared with the in-process Engine: plan -> StepMsg ->
  worker -> sampled tokens -> finished requests.
- scheduler.py: Scheduler: admission (pages reserved up front), chunk lookup in the chunk table,
  radix prefix reuse, the plan of each step (chunk prefills, prefills, decodes, block copies).
- plan.py: StepPlan / ForwardItem / PageCopy, the contract with the model worker.
- step_wire.py: StepPlan <-> StepMsg (each request's page table is sent once).
- request.py: Request and Segment (a run of KV pages at a position).
- recompute.py: which document pages selective recompute computes in context.

The worker imports plan.py, request.py and step_wire.py from here; nothing here imports the worker.

May import: lazyrt.cache, lazyrt.config, lazyrt.constraint, lazyrt.sampling_params, lazyrt.runtime.ipc
"""
