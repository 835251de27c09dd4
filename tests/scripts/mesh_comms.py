"""One rank of a DP x PP x TP mesh: joins the groups of generation 0 through the store at
argv[1] and prints, as JSON, what an all-reduce of 10**rank sums to over each it has."""

import json
import sys

import torch

from leto.runtime.env import connect
from leto.runtime.mesh import Mesh, make_comms

addr, rank, world_size, tp, pp = sys.argv[1], *map(int, sys.argv[2:6])
mesh = Mesh.of(rank, world_size, tp, pp)
comms = make_comms(mesh, connect(addr, 60), 0, 60)
sums, ranks = {}, {}
for name in ("world", "tp", "pp", "embedding", "dp"):
    comm = getattr(comms, name)
    if comm is None:
        continue
    t = torch.tensor([10.0**rank], dtype=torch.float64)
    comm.all_reduce(t)
    sums[name] = int(t.item())
    ranks[name] = [comm.rank, comm.world_size]
comms.close()
print(json.dumps({"rank": rank, "sums": sums, "ranks": ranks}), flush=True)
