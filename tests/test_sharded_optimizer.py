"""ZeRO-1 over 3 ranks equals plain single-process torch.optim.AdamW on the same global batch."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from conftest import REPO

# Tolerance: the sharded run sums per-rank gradients in another order than one process does,
# so results agree to float32 rounding, not bit for bit.
RTOL, ATOL = 1e-5, 1e-6


def reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    data = torch.Generator().manual_seed(7)
    X, Y = torch.randn(5, 12, 8, generator=data), torch.randn(5, 12, 4, generator=data)
    for step in range(5):
        opt.zero_grad()
        nn.functional.mse_loss(model(X[step]), Y[step]).backward()
        opt.step()
    params = list(model.parameters())
    flat = lambda ts: torch.cat([t.reshape(-1) for t in ts])  # noqa: E731
    return {
        "params": flat(params),
        "exp_avg": flat(opt.state[p]["exp_avg"] for p in params),
        "exp_avg_sq": flat(opt.state[p]["exp_avg_sq"] for p in params),
    }


def test_sharded_adamw_matches_torch_adamw(launcher, tmp_path: Path) -> None:
    out = tmp_path / "state.pt"
    res = launcher.run(
        "run",
        "--workers",
        "3",
        "--run-dir",
        str(tmp_path / "run"),
        str(REPO / "tests" / "scripts" / "adamw_check.py"),
        str(out),
        run_dir=tmp_path / "run",
    )
    assert res.returncode == 0, res.stderr[-2000:]
    got, want = torch.load(out), reference()
    for name in ("params", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL, msg=name)
    torch.testing.assert_close(got["master"], want["params"], rtol=RTOL, atol=ATOL)
