"""Serving: `Engine` (continuous batching over loop.py's step, engine.py) and the compiled
programs it runs (programs.py)."""

from specjax.serve.engine import Engine, Request

__all__ = ["Engine", "Request"]
