"""The architecture holds: each layer imports only the layers below it (the import-linter
contract in pyproject.toml, docs/design.md "Architecture"), so a wrong-way import fails CI."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).parent / "lint-imports"


def _lint(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), str(config), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_every_layer_imports_only_the_layers_below_it() -> None:
    res = _lint(ROOT / "pyproject.toml")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "1 kept, 0 broken" in res.stdout


def test_the_contract_catches_a_wrong_way_import(tmp_path: Path) -> None:
    """The same contract with two layers swapped must break: the linter reads the real imports."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = cfg["contracts"][0]["layers"]
    i, j = layers.index("leto.training"), layers.index("leto.protection")
    layers[i], layers[j] = layers[j], layers[i]  # training, which imports protection, now below it
    lines = [
        f'[tool.importlinter]\nroot_package = "{cfg["root_package"]}"\n',
        '[[tool.importlinter.contracts]]\nname = "swapped"\ntype = "layers"',
        "layers = [" + ", ".join(f'"{layer}"' for layer in layers) + "]",
    ]
    (tmp_path / "swapped.toml").write_text("\n".join(lines) + "\n")
    res = _lint(tmp_path / "swapped.toml")
    assert res.returncode != 0 and "leto.training is not allowed to import leto.protection" in res.stdout, res.stdout[
        -3000:
    ]
