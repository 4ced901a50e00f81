"""Silences transformers' "PyTorch was not found" advisory, which it logs when imported
without torch (specjax needs torch for nothing: it reads only tokenizers and files through
transformers). Only that one message is dropped; every other warning passes. Importing
this module installs the filter (specjax/__init__.py imports it first)."""

from __future__ import annotations

import logging

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


silence_torch_advisory()
