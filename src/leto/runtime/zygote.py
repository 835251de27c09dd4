"""Zygotes: warm shadows that never adopt a rank, they fork new shadows on request.

Starting a shadow from scratch imports torch and builds the model and data pipeline: seconds
of CPU that, on a busy host, slow the training steps that follow a recovery (measured here: a
replacement shadow warming up made steps ~25 % slower for ~2.5 s, even at SCHED_IDLE). A fork
of a warm process costs milliseconds and shares its memory until written. One zygote per node
(`procs.json` role `zygote`); its forks are shadows of that node.

The fork is double: the zygote's child forks the shadow and exits at once, so the shadow is
reparented to the controller (a child subreaper), which supervises it like any child.
"""

from __future__ import annotations

import gc
import os
import sys
from datetime import timedelta

from leto.errors import BadValue
from leto.protocol import keys
from leto.protocol.messages import ForkRequest
from leto.runtime import env as rt
from leto.runtime import linux, trace

REPARENT_TIMEOUT_S = 5.0


def serve(job: rt.Job) -> bool:
    """Serve fork requests until the job shuts down (False); returns True in a forked child,
    which is now a shadow with its own identity and store connection."""
    import torch

    if torch.cuda.is_initialized():  # a CUDA context does not survive fork: no zygotes in this job
        job.store.set(keys.ZYGOTES_OFF, "the job's processes use CUDA, which cannot be forked")
        return False
    job.store.set(keys.warm(job.proc_id), "1")
    gc.freeze()  # what every shadow forked from here inherits stays out of its collections (prefork.py)
    seq = 0
    while not job.shutdown_requested():
        key = keys.fork(job.proc_id, seq)
        try:
            job.store.wait([key], timedelta(seconds=0.5))
        except RuntimeError:  # timed out: check for shutdown, wait again
            continue
        seq += 1
        try:
            request = ForkRequest.from_json(job.store.get(key), key)
        except BadValue as e:  # that request is not served; the supervisor gives up on it in time
            print(f"leto: zygote {job.proc_id} ignored a malformed value of {e}", file=sys.stderr)
            continue
        if request.node != job.node:
            print(
                f"leto: zygote {job.proc_id} of node {job.node} ignored {key}: it asks for node {request.node}",
                file=sys.stderr,
            )
            continue
        trace.mark("zygote_request", shadow=request.proc_id)
        if _fork(job, request):
            return True
    return False


def _fork(job: rt.Job, request: ForkRequest) -> bool:
    if not linux.fork_adopted(os.getppid(), REPARENT_TIMEOUT_S):
        return False
    try:
        os.setsid()
        job.role, job.proc_id, job.node = "shadow", request.proc_id, request.node
        os.environ.update({rt.ENV_ROLE: "shadow", rt.ENV_PROC_ID: job.proc_id, rt.ENV_NODE: str(job.node)})
        job.store = rt.connect(os.environ[rt.ENV_STORE], job.timeout_s)  # never share the zygote's socket
        job.store.set(keys.forked(job.proc_id), str(os.getpid()))
        trace.mark("forked")
        return True
    except BaseException:  # a half-made shadow must not return into the zygote's loop
        os._exit(1)
