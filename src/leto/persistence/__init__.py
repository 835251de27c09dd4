"""Persistence: the last line of defence behind in-memory protection (docs/design.md, "Persistence").

Every K steps each rank writes its part of an asynchronous `torch.distributed.checkpoint`
(its ZeRO-1 shard, the step, its extra state; rank 0 - with tensor parallelism, each TP
slice's first rank - also the parameters) off the critical path; `leto train|run --resume
RUN_DIR` starts a new job from the newest complete one.
"""
