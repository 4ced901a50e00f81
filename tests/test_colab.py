"""The Colab notebook's cells run (on CPU here): everything but the install cell, which
pip-installs this checkout, and the benchmark cell, which takes minutes."""

import json
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_notebook_runs(monkeypatch):
    notebook = json.loads((ROOT / "colab" / "specjax_tpu.ipynb").read_text())
    cells = ["".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code"]
    assert "pip" in cells[0] and "bench.run_pair" in cells[-1]
    monkeypatch.chdir(ROOT)
    scope: dict = {}
    for source in cells[1:-1]:
        exec(compile(source, "notebook", "exec"), scope)
    assert scope["auto"].tokens.shape == scope["spec"].tokens.shape
    assert bool((scope["auto"].tokens == scope["spec"].tokens).all())
    compile(cells[-1], "notebook", "exec")
