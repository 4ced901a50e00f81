"""Keeps two messages that say nothing wrong out of a specjax session: transformers'
"PyTorch was not found" advisory, which it logs when imported without torch (specjax needs
torch for nothing: it reads only tokenizers and files through transformers; only that one
message is dropped, every other warning passes), and libtpu's INVALID_ARGUMENT block on a
machine without a TPU (`without_absent_tpu`). Importing this module does both
(specjax/__init__.py imports it first).
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import logging
import os
from pathlib import Path

TORCH_ADVISORY = "PyTorch was not found."


class _NoTorchAdvisory(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(TORCH_ADVISORY)


def silence_torch_advisory():
    """Installs the filter on transformers' logger (before or after transformers is
    imported; at most once)."""
    logger = logging.getLogger("transformers")
    if not any(isinstance(f, _NoTorchAdvisory) for f in logger.filters):
        logger.addFilter(_NoTorchAdvisory())


def without_absent_tpu():
    """libtpu installed (`pip install -e '.[tpu]'` or the test extra, for `specjax plan`) on
    a machine with no TPU and no other accelerator plugin: JAX would try the TPU first and
    print libtpu's INVALID_ARGUMENT block in every session; it runs on the CPU at once
    instead (programs are still compiled for TPU slices through libtpu). JAX_PLATFORMS, when
    set, decides; so does a session whose backends were started before specjax came in."""
    if "JAX_PLATFORMS" in os.environ or importlib.util.find_spec("libtpu") is None:
        return
    google = any(Path(f).read_text().strip() == "0x1ae0" for f in glob.glob("/sys/bus/pci/devices/*/vendor"))
    plugins = importlib.metadata.entry_points(group="jax_plugins") or importlib.util.find_spec("jax_plugins")
    if not google and not plugins and not glob.glob("/dev/accel*") and not glob.glob("/dev/vfio/[0-9]*"):
        import jax

        jax.config.update("jax_platforms", "cpu")


silence_torch_advisory()
without_absent_tpu()
