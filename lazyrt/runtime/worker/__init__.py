"""The model worker process: the only owner of the device, the weights and the KV page tensors.

- process.py: the process loop: one StepMsg in, one StepResult (sampled tokens) out, or StepFailed
  when the step raised (the worker serves on).
- model_worker.py: ModelWorker: loads the model, sizes the KV pool, executes a step, samples.
- model_runner.py: ModelRunner: a StepPlan -> attention metadata -> forward -> logits.
- step_inputs.py: a StepPlan flattened to host int arrays (token ids, page tables, store slots).
- cuda_graph.py: decode steps replayed from CUDA graphs.
- grammar.py: structured output: per-request llguidance matchers, batch token masks on the logits.
- sampler.py: greedy / temperature / top-k / top-p, seeded per request.
- tp_group.py: TPGroup, a rank's torch.distributed process group (gloo / NCCL) for the
  model's all-reduces, the page-count minimum and the sampled tokens.
- peer_all_reduce.py: PeerAllReduce, decode-sized all-reduces over NVLink peer memory (torch
  symmetric memory's one-shot kernel) instead of NCCL.
- tp_ranks.py: TPRendezvous, TPMember, PlanLinks (rank 0 forwards each StepMsg to the others).
- tp_follower.py: the process of ranks >= 1, and FollowerRanks (the Engine starts them itself).
- host_segments.py: retrieval attention's host-tier segments taken out of a step (lazyrt.retrieval
  attends them).

May import: lazyrt.cache, lazyrt.config, lazyrt.constraint, lazyrt.kernels, lazyrt.models, lazyrt.retrieval,
lazyrt.sampling_params, lazyrt.runtime.ipc, lazyrt.runtime.scheduler (the plan types and the StepMsg
decoder only)
"""
