"""Pipeline parallelism of the built-in GPT: P stages of whole blocks, run by real gloo processes
on 127.0.0.1 under the 1F1B schedule, compute the loss and the gradients of the model they were
cut from; a stage killed mid-schedule is a `PeerFailure` in the others, not a hang.

Run as a script, this file is one of those processes (see `_worker`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from leto.runtime.comm import Comm, PeerFailure
from leto.runtime.env import LOOPBACK, connect, loopback_store, network_env
from leto.training.model import GPT, GPTConfig
from leto.training.pipeline import TIED, GPTStage, one_f_one_b, stage_layers, tied_grads_all_reduce

CFG = GPTConfig(block_size=16, n_layer=4, n_head=2, n_embd=32)
MICRO_BATCH = 2
PROCESSES = 4
# name -> (stages, micro-batches): also fewer micro-batches than stages, 4 blocks cut 2, 1, 1, one stage
CASES = {"P4-M4": (4, 4), "P2-M4": (2, 4), "P4-M2": (4, 2), "P3-M5": (3, 5), "P1-M3": (1, 3)}


def model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def micro_batches(m: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(m)
    tokens = torch.randint(CFG.vocab_size, (m, MICRO_BATCH, CFG.block_size + 1), generator=g)
    return list(tokens[:, :, :-1]), list(tokens[:, :, 1:])


def reference(m: int) -> tuple[float, dict[str, torch.Tensor]]:
    """The whole model's mean loss over the micro-batches (each weighted 1/m) and its gradients,
    accumulated; on one intra-op thread, as the stages run (a LayerNorm's backward sums in
    another order on two)."""
    full, losses, threads = model(), [], torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for x, y in zip(*micro_batches(m)):
            loss = full(x, y)
            (loss * (1.0 / m)).backward()
            losses.append(loss.item() * (1.0 / m))
    finally:
        torch.set_num_threads(threads)
    return sum(losses), {n: p.grad for n, p in full.named_parameters()}


def test_blocks_are_cut_into_contiguous_balanced_runs() -> None:
    assert [stage_layers(4, 2, s) for s in range(2)] == [range(0, 2), range(2, 4)]
    assert [stage_layers(4, 4, s) for s in range(4)] == [range(i, i + 1) for i in range(4)]
    assert [stage_layers(5, 3, s) for s in range(3)] == [range(0, 2), range(2, 4), range(4, 5)]
    assert [stage_layers(7, 3, s) for s in range(3)] == [range(0, 3), range(3, 5), range(5, 7)]
    assert stage_layers(4, 1, 0) == range(4)
    for n_layer in range(1, 9):
        for stages in range(1, n_layer + 1):
            runs = [stage_layers(n_layer, stages, s) for s in range(stages)]
            assert [i for r in runs for i in r] == list(range(n_layer))
            assert max(map(len, runs)) - min(map(len, runs)) <= 1


@pytest.mark.parametrize("n_layer, stages, stage", [(4, 5, 0), (4, 0, 0), (4, 2, 2), (4, 2, -1)])
def test_more_stages_than_blocks_or_a_stage_outside_is_a_value_error(n_layer: int, stages: int, stage: int) -> None:
    with pytest.raises(ValueError):
        stage_layers(n_layer, stages, stage)


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_a_stage_holds_the_full_models_parameters_by_their_names(stages: int) -> None:
    """In the full model's order; the embeddings on the first stage, the final LayerNorm on the
    last, the tied weight on both, each stage's copy its own, equal to the full model's."""
    full = dict(model().named_parameters())
    cut = [GPTStage(model(), s, stages) for s in range(stages)]
    names = [[n for n, _ in stage.named_parameters()] for stage in cut]
    for stage_names in names:
        assert stage_names == [n for n in full if n in stage_names]
    assert [n for n in full if n != TIED] == [n for stage_names in names for n in stage_names if n != TIED]
    assert [TIED in stage_names for stage_names in names] == [True] + [False] * (stages - 2) + [True]
    assert "wpe.weight" in names[0] and "ln_f.weight" in names[-1]
    assert all(torch.equal(stage.state_dict()[n], full[n]) for stage in cut for n in stage.state_dict())
    one = GPTStage(model(), 0, stages), GPTStage(model(), stages - 1, stages)
    assert one[0].wte.weight is not one[1].wte.weight


def test_one_stage_is_the_whole_model() -> None:
    x, y = (b[0] for b in micro_batches(1))
    whole = GPTStage(model(), 0, 1)
    assert list(whole.state_dict()) == list(model().state_dict())
    assert torch.equal(whole(x, y), model()(x, y))
    assert torch.equal(whole(x), model()(x))


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory) -> dict[str, dict[int, dict]]:
    """Every case run by real processes: case -> stage -> {"loss", "grads"} after the schedule
    and the tied gradients' all-reduce."""
    out = tmp_path_factory.mktemp("pipeline")
    with _stages("grads", out) as procs:
        errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * PROCESSES, errs
    return {name: {s: torch.load(out / f"{name}.{s}.pt") for s in range(p)} for name, (p, _) in CASES.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_the_last_stage_returns_the_whole_models_mean_loss(pipelined, name: str) -> None:
    """Bit for bit: each micro-batch goes through the same operations as in the whole model."""
    stages, m = CASES[name]
    assert [pipelined[name][s]["loss"] for s in range(stages)] == [None] * (stages - 1) + [reference(m)[0]]


@pytest.mark.parametrize("name", list(CASES))
def test_the_stages_gradients_are_the_whole_models(pipelined, name: str) -> None:
    """Accumulated over the micro-batches, bit for bit, but for the tied weight's: the whole
    model adds its two parts (LM head, embedding) in each micro-batch's backward, then over the
    micro-batches; a pipeline adds each part over the micro-batches, then the two parts over the
    embedding group, and float32 rounds the two orders differently. Both copies of the tied
    weight hold the same gradient."""
    stages, m = CASES[name]
    want = reference(m)[1]
    got: dict[str, torch.Tensor] = {}
    for s in range(stages):
        for n, g in pipelined[name][s]["grads"].items():
            if n == TIED and n in got:
                assert torch.equal(got[n], g), "the two copies of the tied weight hold different gradients"
            got[n] = g
    assert list(got) == [n for n in want if n in got] and set(got) == set(want)
    assert [n for n in want if not torch.equal(got[n], want[n])] in ([], [TIED])
    torch.testing.assert_close(got[TIED], want[TIED], rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("name", list(CASES))
def test_the_schedule_marks_each_phase_and_each_message(pipelined, name: str) -> None:
    """Where the trainer injects faults: each phase once, in order, with the first micro-batch
    it runs (stage s warms up with P - s - 1 forwards); and every micro-batch's activations and
    gradients, sent once and received once by every stage that has a neighbour for them."""
    stages, m = CASES[name]
    for s in range(stages):
        points = pipelined[name][s]["points"]
        warmup = min(stages - s - 1, m)
        phases = [p for p in points if p[0] in ("pp-warmup", "pp-steady", "pp-cooldown")]
        assert phases == [("pp-warmup", 0), ("pp-steady", warmup), ("pp-cooldown", m - warmup)]
        in_warmup = points[points.index(phases[0]) + 1 : points.index(phases[1])]
        kinds = ("pp-recv", "pp-send") if s > 0 else ("pp-send",)  # stage 0 reads its micro-batches
        assert in_warmup == [(kind, mb) for mb in range(warmup) for kind in kinds]
        neighbours = (s > 0) + (s < stages - 1)
        for kind in ("pp-send", "pp-recv"):
            assert sorted(mb for k, mb in points if k == kind) == sorted(list(range(m)) * neighbours)


def test_a_killed_stage_is_a_peer_failure_in_every_other_stage() -> None:
    """Stage 1 of 4 stops in the steady state, with micro-batches in flight, and is SIGKILLed:
    its neighbours' messages fail, and stage 3's when stage 2 abandons its group, long before
    the 120 s comm timeout. The survivors then build the next generation's group, 3 stages of
    a fresh model, and run the schedule to the whole model's loss: nothing of the abandoned
    group holds them."""
    with _stages("kill", 1) as procs:
        victim, survivors = procs[1], [procs[0], *procs[2:]]
        assert victim.stdout.readline().strip() == "stopped", victim.communicate(timeout=60)[1]
        os.kill(victim.pid, signal.SIGKILL)
        outs = [p.communicate(timeout=60) for p in survivors]
    assert [p.returncode for p in survivors] == [0, 0, 0], [err for _, err in outs]
    failures, again = zip(*([json.loads(line) for line in out.strip().splitlines()] for out, _ in outs))
    for f in failures:
        assert f["failure"].startswith(f"pipeline stage {f['stage']} send/receive failed in generation 0"), failures
    assert [a["loss"] for a in again[:-1]] == [None, None]
    assert again[-1]["loss"] == reference(4)[0]


@contextmanager
def _stages(mode: str, arg: object) -> Iterator[list[subprocess.Popen]]:
    """The worker processes of `mode`, one a rank, on a fresh loopback store; whatever is left of
    them is killed and reaped on the way out."""
    store = loopback_store(60)
    cmd, env = [sys.executable, __file__, mode, f"{LOOPBACK}:{store.port}"], dict(os.environ, **network_env(LOOPBACK))
    pipe = subprocess.PIPE
    procs = [
        subprocess.Popen([*cmd, str(r), str(arg)], env=env, stdout=pipe, stderr=pipe, text=True)
        for r in range(PROCESSES)
    ]
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _worker(mode: str, addr: str, rank: int, arg: str) -> None:
    torch.set_num_threads(1)
    store = connect(addr, 60)
    act_shape = (MICRO_BATCH, CFG.block_size, CFG.n_embd)
    if mode == "grads":  # every case in turn, one generation each; arg: the output folder
        for gen, (name, (stages, m)) in enumerate(CASES.items()):
            if rank >= stages:
                continue
            pp = Comm(store, gen, rank, stages, 30, name="pp")
            ends = rank in (0, stages - 1) and stages > 1
            embedding = Comm(store, gen, min(rank, 1), 2, 30, name="embedding") if ends else None
            stage = GPTStage(model(), rank, stages)
            points: list[tuple[str, int]] = []
            loss = one_f_one_b(stage, pp, rank, stages, *micro_batches(m), act_shape, lambda *p: points.append(p))
            if embedding is not None:
                tied_grads_all_reduce(stage, embedding)
            grads = {n: p.grad for n, p in stage.named_parameters()}
            torch.save({"loss": loss, "grads": grads, "points": points}, Path(arg) / f"{name}.{rank}.pt")
            for comm in (pp, embedding):
                if comm is not None:
                    comm.close()
        os._exit(0)  # past gloo's destructors, whose threads may abort an exiting process
    victim, seen = int(arg), []  # "kill": P = 4, M = 4; the victim stops at its first send of the steady state

    def point(phase: str, mb: int) -> None:
        seen.append(phase)
        if rank == victim and phase == "pp-send" and "pp-steady" in seen:
            print("stopped", flush=True)
            signal.pause()

    pp = Comm(store, 0, rank, PROCESSES, 120, name="pp")
    try:
        one_f_one_b(GPTStage(model(), rank, PROCESSES), pp, rank, PROCESSES, *micro_batches(4), act_shape, point)
        sys.exit("the schedule finished without the victim")
    except PeerFailure as e:
        pp.close(abandon=True)
        print(json.dumps({"stage": rank, "failure": str(e), "at": seen[-1]}), flush=True)
    s, stages = rank - (rank > victim), PROCESSES - 1  # the survivors, in rank order
    pp = Comm(store, 1, s, stages, 120, name="pp")
    loss = one_f_one_b(GPTStage(model(), s, stages), pp, s, stages, *micro_batches(4), act_shape)
    print(json.dumps({"stage": s, "loss": loss}), flush=True)
    os._exit(0)  # the abandoned group is left to its background timeout


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
