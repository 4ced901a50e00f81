"""What a new user meets first: the package without torch, its version, the command's flags,
help and one-line refusals (no model is compiled here, or only a tiny one)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def _python(code: str) -> subprocess.CompletedProcess:
    """code run by a fresh Python that imports this checkout's specjax, offline."""
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_no_torch_advisory_without_torch():
    """Without torch (the plain install), importing specjax and loading a tokenizer prints
    nothing about PyTorch; transformers' other warnings still pass."""
    done = _python("import sys; sys.modules['torch'] = None\n"
                   "import specjax\n"
                   f"specjax.load_tokenizer({str(ROOT / 'checkpoints' / 'target')!r})\n"
                   "from transformers.utils import logging\n"
                   "logging.get_logger('transformers').warning('another warning')\n")
    assert done.returncode == 0, done.stderr
    assert "PyTorch" not in done.stderr and "another warning" in done.stderr, done.stderr
