"""One rank of a DP x TP mesh: joins the world, TP and DP groups of generation 0 through the
store at argv[1] and prints, as JSON, what an all-reduce of 10**rank sums to over each."""

import json
import sys

import torch

from leto.runtime.env import connect
from leto.runtime.mesh import Mesh, make_comms

addr, rank, world_size, tp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
mesh = Mesh.of(rank, world_size, tp)
comms = make_comms(mesh, connect(addr, 30), 0, 30)
sums = {}
for name in ("world", "tp", "dp"):
    t = torch.tensor([10.0**rank], dtype=torch.float64)
    getattr(comms, name).all_reduce(t)
    sums[name] = int(t.item())
ranks = {"tp": [comms.tp.rank, comms.tp.world_size], "dp": [comms.dp.rank, comms.dp.world_size]}
comms.close()
print(json.dumps({"rank": rank, "sums": sums, "ranks": ranks}), flush=True)
