"""A user script that records what its interpreter looks like (argv, sys.path[0], __main__, working
folder, session, environment, unseeded random draws, objects kept out of collections), then
trains 2 steps like any Leto worker; its atexit handler writes a file as it ends."""

import atexit
import gc
import json
import os
import random
import sys

import numpy as np
import torch
import torch.nn as nn

import leto

facts = {
    "argv": sys.argv,
    "path0": sys.path[0],
    "name": __name__,
    "file": __file__,
    "main_file": sys.modules["__main__"].__file__,
    "cwd": os.getcwd(),
    "own_session": os.getsid(0) == os.getpid(),
    "probe_env": os.environ.get("PROBE_DIR"),
    "numpy_draw": int(np.random.randint(1 << 30)),
    "random_draw": random.random(),
    "frozen": gc.get_freeze_count(),
}
job = leto.init()
trainer = leto.Trainer(nn.Linear(4, 1), job, leto.AdamW(lr=1e-2), seed=0)
for step in trainer.steps(2):
    x = torch.randn(8, 4)
    trainer.step(lambda: trainer.model(x).pow(2).mean())
with open(os.path.join(os.environ["PROBE_DIR"], f"rank{job.rank}.json"), "w") as f:
    json.dump(facts, f)
atexit.register(lambda: open(os.path.join(os.environ["PROBE_DIR"], f"rank{job.rank}.atexit"), "w").close())
