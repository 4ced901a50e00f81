"""One `specjax serve` start (its HTTP server stubbed: it returns at once, once the background
compiles are done), counting JAX's persistent compilation cache's hits and misses:
tests/test_serve.py runs it twice on one cache folder. Prints {"code", "hits", "misses"} as
its last line."""

import json
import sys

import jax

events = []
jax.monitoring.register_event_listener(lambda event, **kwargs: events.append(event))

import uvicorn  # noqa: E402

import specjax.serve.server as server  # noqa: E402
from specjax.cli import entry  # noqa: E402

compile_first = server._compile
server._compile = lambda engine, *args: (compile_first(engine, *args), engine.wait_warm())
server._server_class = lambda: lambda config: type("Run", (), {"run": lambda self: None})()
uvicorn.Config = lambda *args, **kwargs: None
code = entry(["serve", *sys.argv[1:]])
print(json.dumps({"code": code, "hits": events.count("/jax/compilation_cache/cache_hits"),
                  "misses": events.count("/jax/compilation_cache/cache_misses")}))
