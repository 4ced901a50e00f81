"""The Colab notebooks (colab/*.ipynb) run top to bottom on CPU in their offline small mode
(SPECJAX_SMALL=1), from the repository root, so a broken API call fails here; and the
stored notebooks carry no outputs.

The quickstart runs in the default suite; the drafters and training notebooks, which
compile and train for minutes, run with -m slow. The kernels asked for run at the same time
(nbclient's async API): most of their time is single-threaded XLA compilation, so on 2
cores this takes about half of running them one after another."""

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import pytest

from tests import children

ROOT = Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "colab").glob("*.ipynb"))


def test_the_notebooks_are_the_three_the_docs_list():
    assert [p.name for p in NOTEBOOKS] == ["drafters.ipynb", "quickstart.ipynb", "train_draft.ipynb"]
    guide = (ROOT / "docs/guides/notebooks.md").read_text()
    for p in NOTEBOOKS:
        assert f"colab/{p.name}" in guide


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_notebook_has_no_outputs(path):
    notebook = json.loads(path.read_text())
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [] and cell.get("execution_count") is None, \
                f"{path.name}: strip outputs before committing (jupyter nbconvert --clear-output --inplace)"


SLOW = ("drafters", "train_draft")  # minutes each on 2 cores: -m slow
CASES = [pytest.param(p.stem, marks=pytest.mark.slow) if p.stem in SLOW else p.stem for p in NOTEBOOKS]


@pytest.fixture(scope="module")
def executed(tmp_path_factory, request):
    """The notebooks this session's tests ask for (all three with -m slow, else the
    quickstart), executed in small mode: name -> (notebook or the exception, seconds)."""
    nbclient = pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("ipykernel")
    env = children.env(SPECJAX_SMALL="1", MPLBACKEND="agg",
                       PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    home = tmp_path_factory.mktemp("kernel_home")  # keeps IPython's history and config out of ~

    async def run(path):
        notebook = nbformat.read(path, as_version=4)
        client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                         resources={"metadata": {"path": str(ROOT)}})
        start = time.perf_counter()
        try:
            await client.async_execute(env=dict(env, IPYTHONDIR=str(home / path.stem)))
        except Exception as e:  # reported by the notebook's own test
            return path.stem, (e, time.perf_counter() - start)
        return path.stem, (notebook, time.perf_counter() - start)

    asked = {item.callspec.params["name"] for item in request.session.items
             if item.originalname == "test_notebook_runs_in_small_mode" and hasattr(item, "callspec")}

    async def run_all():
        return dict(await asyncio.gather(*(run(p) for p in NOTEBOOKS if p.stem in asked)))

    start = time.perf_counter()
    results = asyncio.run(run_all())
    print(f"\nnotebooks executed in {time.perf_counter() - start:.0f} s: "
          + ", ".join(f"{k} {v[1]:.0f} s" for k, v in results.items()), file=sys.stderr)
    return results


@pytest.mark.parametrize("name", CASES)
def test_notebook_runs_in_small_mode(executed, name):
    result, _ = executed[name]
    if isinstance(result, Exception):
        pytest.fail(f"colab/{name}.ipynb failed in small mode:\n{result}")
    text = "".join(o.get("text", "") for c in result.cells if c.cell_type == "code" for o in c.outputs)
    assert "small mode (offline, shipped pair)" in text
    assert "autoregressive" in text and "exact" in text  # the comparison table was printed
