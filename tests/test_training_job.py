"""`leto train`: deterministic, sharding-independent digests; outputs; the loss falls."""

from __future__ import annotations

from pathlib import Path

import torch

from conftest import step_records, summary
from leto.training.model import GPT, PRESETS
from leto.training.train_gpt import PROMPT, sample

SMALL = ("--workers", "2", "--spares", "0", "--nodes", "1")


def train(launcher, run_dir: Path, *extra: str) -> dict:
    res = launcher.run("train", *SMALL, "--run-dir", str(run_dir), *extra, run_dir=run_dir)
    assert res.returncode == 0, res.stderr[-2000:]
    return summary(run_dir)


def test_same_seed_and_config_give_identical_losses_and_digest(launcher, tmp_path: Path) -> None:
    a = train(launcher, tmp_path / "a", "--steps", "6", "--seed", "3")
    b = train(launcher, tmp_path / "b", "--steps", "6", "--seed", "3")
    assert a["digest"] == b["digest"]
    losses_a = [r["loss"] for r in step_records(tmp_path / "a")]
    losses_b = [r["loss"] for r in step_records(tmp_path / "b")]
    assert losses_a == losses_b and len(losses_a) == 6


def test_another_seed_gives_another_digest(launcher, tmp_path: Path) -> None:
    a = train(launcher, tmp_path / "a", "--steps", "3", "--seed", "1")
    b = train(launcher, tmp_path / "b", "--steps", "3", "--seed", "2")
    assert a["digest"] != b["digest"]


def test_digest_does_not_depend_on_how_state_is_chunked(launcher, tmp_path: Path) -> None:
    a = train(launcher, tmp_path / "a", "--steps", "4", "--chunk-bytes", str(12 * 4096))
    b = train(launcher, tmp_path / "b", "--steps", "4", "--chunk-bytes", str(12 * 50000))
    assert a["digest"] == b["digest"]


def test_run_dir_has_metrics_and_summary(launcher, tmp_path: Path) -> None:
    s = train(launcher, tmp_path / "r", "--steps", "5")
    assert {"steps", "final_loss", "digest", "wall_s", "workers", "recoveries"} <= s.keys()
    assert s["steps"] == 5 and s["workers"] == 2 and s["recoveries"] == []
    assert len(s["digest"]) == 64
    recs = step_records(tmp_path / "r")
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert all(r["step_s"] > 0 and r["tokens_per_s"] > 0 for r in recs)
    assert recs[-1]["loss"] == s["final_loss"]


def test_loss_falls_over_a_short_run_and_the_model_comes_out(launcher, tmp_path: Path) -> None:
    res = launcher.run(
        "train",
        "--workers",
        "4",
        "--nodes",
        "2",
        "--spares",
        "0",
        "--steps",
        "60",
        "--run-dir",
        str(tmp_path / "r"),
        run_dir=tmp_path / "r",
    )
    assert res.returncode == 0, res.stderr[-2000:]
    losses = [r["loss"] for r in step_records(tmp_path / "r")]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.5, (first, last)  # from ~5.5 nats (uniform over bytes) to well below 4
    # the final model loads into a plain GPT, without Leto, and writes the sample printed
    model = GPT(PRESETS["tiny"])
    model.load_state_dict(torch.load(tmp_path / "r" / "model.pt"), strict=True)
    (line,) = [ln for ln in res.stdout.splitlines() if ln.startswith("sample: ")]
    assert line == f"sample: {sample(model)!r}" and sample(model).startswith(PROMPT)


def test_final_none_leaves_neither_model_nor_sample_and_changes_no_bit(launcher, tmp_path: Path) -> None:
    """The benches end the built-in job as the peers end theirs (`--final none`): after the digest,
    nothing; `--final model` writes the weights without the sample."""
    runs = {}
    for final in ("model", "none"):
        run_dir = tmp_path / final
        job = ("--workers", "2", "--spares", "0", "--nodes", "1", "--persist", "off")
        cmd = ("-m", "leto.training.train_gpt", "--steps", "3", "--final", final)
        res = launcher.run("run", "--run-dir", str(run_dir), *job, *cmd, run_dir=run_dir)
        assert res.returncode == 0, res.stderr[-2000:]
        assert "sample: " not in res.stdout
        runs[final] = summary(run_dir)["digest"]
    assert (tmp_path / "model" / "model.pt").exists() and not (tmp_path / "none" / "model.pt").exists()
    assert runs["model"] == runs["none"]
