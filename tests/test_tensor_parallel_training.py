"""Tensor parallelism x ZeRO-1 in real jobs: a TP2 x DP2 run of the built-in GPT tracks the
DP-only run of the same seed and global batch, is deterministic, clips by the global norm of the
whole model, and saves the full model."""

from __future__ import annotations

import torch

from conftest import REPO, step_records, train
from leto.training.model import GPT, PRESETS, tensor_parallel_gpt
from leto.training.tensor_parallel import PendingGroup
from leto.training.tp_slices import SliceLayout

STEPS = 20
TP_JOB = ("--tp", "2", "--workers", "4", "--nodes", "2", "--spares", "0", "--protection", "off")
DP_JOB = ("--workers", "2", "--nodes", "1", "--spares", "0", "--protection", "off")
TRAIN_GPT = str(REPO / "src" / "leto" / "training" / "train_gpt.py")


def _relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def test_tp2_x_dp2_tracks_the_dp_only_run_and_repeats_its_digest(launcher, tmp_path) -> None:
    runs = {}
    for name, job in (("tp", TP_JOB), ("tp_again", TP_JOB), ("dp", DP_JOB)):
        res, s = train(launcher, tmp_path / name, *job, "--steps", str(STEPS))
        assert res.returncode == 0, res.stderr[-3000:]
        runs[name] = s
    tp, dp = step_records(tmp_path / "tp"), step_records(tmp_path / "dp")
    assert len(tp) == len(dp) == STEPS
    assert _relative([r["loss"] for r in tp], [r["loss"] for r in dp]) < 1e-3
    assert runs["tp"]["digest"] == runs["tp_again"]["digest"]  # deterministic
    assert runs["tp"]["digest"] != runs["dp"]["digest"]  # equal in form only: summed in other orders

    # model.pt is the full model: it loads into the plain GPT and is the DP-only run's, to rounding
    full, ref = (torch.load(tmp_path / n / "model.pt") for n in ("tp", "dp"))
    GPT(PRESETS["tiny"]).load_state_dict(full)
    assert full.keys() == ref.keys()
    for k in full:
        assert (full[k] - ref[k]).norm() < 0.25 * ref[k].norm(), k  # a misplaced slice is off by ~1x
    whole = torch.cat([v.reshape(-1) for v in full.values()])
    whole_ref = torch.cat([v.reshape(-1) for v in ref.values()])
    assert (whole - whole_ref).norm() < 1e-3 * whole_ref.norm()


def test_clipping_uses_the_global_norm_of_the_whole_model(launcher, tmp_path) -> None:
    """The same clipped job over TP2 x DP2 and DP-only: the same global gradient norms (a
    replicated parameter counted once per TP group would raise them by its share)."""
    norms = {}
    for name, job in (("tp", TP_JOB), ("dp", DP_JOB)):
        run_dir = tmp_path / name
        res = launcher.run(
            "run", *job, "--run-dir", str(run_dir), TRAIN_GPT, "--steps", "8", "--max-grad-norm", "0.5", run_dir=run_dir
        )
        assert res.returncode == 0, res.stderr[-3000:]
        norms[name] = [r["grad_norm"] for r in step_records(run_dir)]
    assert len(norms["tp"]) == 8 and min(norms["dp"]) > 0.5  # every step was clipped
    assert _relative(norms["tp"], norms["dp"]) < 1e-4


def test_the_slices_reassemble_into_the_plain_model_and_count_each_element_once() -> None:
    """In one process: the flat parameters of both TP slices give the plain model's flat
    parameters, and the norm masks count every element of the plain model exactly once."""

    def plain() -> GPT:
        torch.manual_seed(0)
        return GPT(PRESETS["tiny"])

    full = torch.cat([p.detach().reshape(-1) for p in plain().parameters()])
    flats, squares = [], 0.0
    for rank in range(2):
        model = tensor_parallel_gpt(plain(), PendingGroup(rank, 2))
        params = list(model.parameters())
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        mask = SliceLayout(model, params, rank, 2).norm_mask(flat.numel() + 5, flat.device)
        assert (mask is None) == (rank == 0)
        sq = flat.double().pow(2)
        squares += float((sq if mask is None else sq * mask[: flat.numel()]).sum())
        flats.append(torch.cat([flat, torch.zeros(5)]))  # padded, as the flat buffers are
    assert torch.equal(SliceLayout(model, params, 1, 2).unshard_flat(flats), full)
    assert abs(squares - float(full.double().pow(2).sum())) < 1e-9 * squares
