"""A model from the ecosystem: a Hugging Face causal LM (built from a config, no download) under
`leto run`, a worker SIGKILLed from outside at a random step, the failure-free digest."""

from __future__ import annotations

from conftest import REPO, processes_left, run_user_script, seeded_random

SCRIPT = str(REPO / "tests" / "scripts" / "hf_model.py")
STEPS = 9


def test_a_hugging_face_gpt2_recovers_to_the_failure_free_digest(launcher, tmp_path) -> None:
    ref_out, ref = run_user_script(launcher, tmp_path / "ref", SCRIPT, "--steps", str(STEPS))
    # tied embeddings: the LM head is the token embedding, so a plain state dict misses nothing
    assert "state_dict loads: missing [] unexpected []" in ref_out
    rng, seed = seeded_random()
    kill_step = rng.randrange(2, STEPS - 3)
    # a step takes milliseconds: with no pause the kill, sent once the step is recorded, could
    # come after the last step (nothing to recover); a pause between steps leaves it >= 1.5 s
    args = ("--steps", str(STEPS), "--step-sleep", "0.5")
    _, s = run_user_script(launcher, tmp_path / "run", SCRIPT, *args, kill_step=kill_step, rng=rng)
    assert len(s["recoveries"]) == 1 and s["digest"] == ref["digest"], f"seed {seed}: killed at step {kill_step}"
    assert not processes_left(tmp_path / "run")
