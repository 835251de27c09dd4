"""One rank of a tensor-parallel GPT checked against the full model it was cut from.

argv: rank, world size, the port of the test's TCPStore on 127.0.0.1. Exits non-zero on a
mismatch; every rank checks its own slices.
"""

import copy
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from leto.runtime.comm import Comm
from leto.training.model import GPT, GPTConfig, tensor_parallel_gpt
from leto.training.tensor_parallel import gather_full_state_dict, shard, tp_layout

# float32 sums of partial products in another order: equal to rounding, not bit for bit
LOSS_RTOL, GRAD_ATOL, GRAD_RTOL, STEP_ATOL = 1e-5, 1e-6, 1e-5, 1e-4
CFG = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=256)

torch.set_num_threads(1)
rank, world, port = (int(a) for a in sys.argv[1:4])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
group = Comm(store, 0, rank, world, timeout_s=20, name="tp")

torch.manual_seed(0)
full = GPT(CFG)
tp = tensor_parallel_gpt(copy.deepcopy(full), group)
layout = tp_layout(tp)
assert [n for n, _ in tp.named_parameters()] == [n for n, _ in full.named_parameters()]
assert any(layout.values()) and not all(layout.values())

data = torch.Generator().manual_seed(1)
batches = [torch.randint(0, CFG.vocab_size, (2, 4, CFG.block_size), generator=data) for _ in range(4)]

# the first batch: loss, every gradient, the replicated gradients across TP ranks
x, y = batches[0]
loss_full, loss_tp = full(x, y), tp(x, y)
torch.testing.assert_close(loss_tp, loss_full, rtol=LOSS_RTOL, atol=0)
loss_full.backward()
loss_tp.backward()
full_params = dict(full.named_parameters())
for name, p in tp.named_parameters():
    want = full_params[name].grad
    if spec := layout[name]:
        want = shard(want, spec, rank, world)
    torch.testing.assert_close(p.grad, want, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)

replicated = torch.cat([p.grad.reshape(-1) for n, p in tp.named_parameters() if layout[n] is None])
every = torch.empty(world * replicated.numel())
group.all_gather(every, replicated)
assert all(torch.equal(g, replicated) for g in every.chunk(world)), "replicated gradients differ over TP"

# the reassembled state dict is the full model's, exactly, and loads into the plain model
state = gather_full_state_dict(tp, group)
assert state.keys() == full.state_dict().keys()
for name, value in full.state_dict().items():
    assert torch.equal(state[name], value), name
GPT(CFG).load_state_dict(state)

# a few SGD steps on both stay together
opt_full = torch.optim.SGD(full.parameters(), lr=0.5)
opt_tp = torch.optim.SGD(tp.parameters(), lr=0.5)
for step, (x, y) in enumerate(batches):
    for model, opt in ((full, opt_full), (tp, opt_tp)):
        if step:  # the first batch's gradients are there already
            opt.zero_grad()
            model(x, y).backward()
        opt.step()
state = gather_full_state_dict(tp, group)
for name, value in full.state_dict().items():
    torch.testing.assert_close(state[name], value, rtol=0, atol=STEP_ATOL, msg=name)
torch.testing.assert_close(tp(*batches[0]), full(*batches[0]), rtol=STEP_ATOL, atol=0)
print(f"rank {rank}: ok", flush=True)
