"""What a person sees: plain progress lines (not a terminal) with step/total, ETA, loss,
tokens/s and the recoveries so far."""

from __future__ import annotations

from leto.console import StepDisplay


def test_plain_lines_show_step_eta_loss_throughput_and_recoveries(capsys, monkeypatch) -> None:
    clock = iter([100.0, 102.0, 104.0])
    monkeypatch.setattr("leto.console.time.monotonic", lambda: next(clock))
    with StepDisplay(total=10, plain_every_s=0.0) as d:
        d.step({"step": 1, "loss": 5.0, "tokens_per_s": 2048.0})
        d.recovered()
        d.step({"step": 3, "loss": 4.5, "tokens_per_s": 1000.0})
        d.step({"step": 5, "loss": 4.0, "tokens_per_s": None})
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "step 1/10  loss 5.0000  2,048 tok/s  recoveries 0",
        "step 3/10  eta 7s  loss 4.5000  1,000 tok/s  recoveries 1",
        "step 5/10  eta 5s  loss 4.0000  recoveries 1",
    ]
