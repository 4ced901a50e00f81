"""`specjax serve`: models loaded, the engine built and compiled, the API served by uvicorn.

uvicorn owns the process's signals: SIGTERM (or Ctrl-C) closes the listening socket, lets
in-flight requests finish for up to `drain_timeout` seconds, then the app's lifespan cancels
what is left and stops the engine, and the process exits 0.

It knows where models come from (paths, the shipped pair) and how to start a server;
nothing of routes (api.py) or of what the engine computes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import stat
import sys
import threading
import time
from pathlib import Path

from specjax.memory import readable

DRAFT_CHOICES = "PATH|none|prompt-lookup|lookahead|early-exit:N|medusa|eagle|eagle3"


def load_draft(spec: str, target, tokenizer, target_path: str):
    """The drafter `--draft` names: a draft model's folder or hub id (or trained heads':
    drafter.json or a published EAGLE-3 head's; or a datastore's, for retrieval), none,
    prompt-lookup, lookahead (its defaults),
    early-exit:N, or medusa / eagle / eagle3 (the shipped heads)."""
    import specjax
    from specjax.drafters.load import drafter_folder, holds_heads
    from specjax.shipped import default_checkpoint
    from specjax.text import check_draft_tokenizer

    if spec == "none":
        return None
    if spec == "prompt-lookup":
        return specjax.PromptLookup()
    if spec == "lookahead":
        return specjax.Lookahead()
    if spec.startswith("early-exit:"):
        layers = spec.partition(":")[2]
        if not layers.isdigit() or not 1 <= int(layers) < target.config.num_layers:
            raise ValueError(f"--draft early-exit:N wants 1 <= N < {target.config.num_layers} (the target's "
                             f"layers), got {spec!r}")
        return specjax.EarlyExit(int(layers))
    path = drafter_folder(default_checkpoint(spec) if spec in ("medusa", "eagle", "eagle3") else spec)
    if holds_heads(path):  # specjax's trained heads, or a published EAGLE-3 head's folder
        return specjax.load_drafter(path)
    if (Path(path) / "datastore.json").exists():  # `specjax datastore build`'s folder
        return specjax.Retrieval(specjax.Datastore.load(path))
    draft = specjax.DraftModel.load(path, attention=target.attention)  # with its saved vocabulary
    if (note := check_draft_tokenizer(tokenizer, target_path, path)) is not None:
        print(f"note: {note}", file=sys.stderr)
    return draft


def serve(target_path: str, draft: str, *, host: str = "127.0.0.1", port: int = 8000, slots: int = 8,
          max_model_len: int | None = None, served_model_name: str | None = None, api_key: str | None = None,
          max_queue: int | None = None, deterministic: bool = False, mesh=None, steps_per_call: int = 4,
          drain_timeout: float = 30.0, warmup: bool = True, attention: str = "auto",
          tokenizer: str | None = None, kv_pages: int | None = None, kv_cache_bytes: int | str | None = None,
          page_size: int = 16, compilation_cache: str | None = "default", prefix_caching: bool = True,
          prefill_chunk: int | None = None, dense_kv_cache: bool = False, max_logprobs: int | None = 20,
          logprobs_mode: str = "raw", max_grammar_states: int | None = None,
          max_grammar_edges: int | None = None, max_grammar_masks: int | None = None,
          access_log: bool = True) -> int:
    """Serves until SIGTERM. tokenizer: the target's tokenizer's folder or hub id (None: the
    target's own folder's). max_logprobs, logprobs_mode: the Engine's (None: no request may
    ask for logprobs, and no program scores tokens). max_grammar_states, max_grammar_masks,
    max_grammar_edges: the Engine's (each slot's room for a structured-output grammar; 0
    states: none). kv_pages, kv_cache_bytes, page_size,
    prefix_caching, prefill_chunk: the engine's page pool, whether it shares cached prefixes
    and the most prompt tokens a call prefills (Engine's; the last two only where paged).
    Without kv_pages or kv_cache_bytes the caches are paged all the same (`default_pool`)
    unless dense_kv_cache: then each slot holds max_model_len positions of its own.
    compilation_cache: a folder for JAX's persistent compilation cache, where a second start
    finds every program compiled ("default": `default_compilation_cache()`; None: none).
    access_log: a line on stderr per request (uvicorn's access log; its other messages stay
    at warnings)."""
    import uvicorn

    import specjax
    from specjax.serve.api import Server, create_app
    from specjax.serve.engine import default_max_len
    from specjax.text import stop_ids, target_tokenizer

    if compilation_cache is not None:
        folder = use_compilation_cache(default_compilation_cache() if compilation_cache == "default"
                                       else compilation_cache)
        print(f"specjax serve: compiled programs cached in {folder} ({len(list(folder.iterdir()))} there)",
              file=sys.stderr, flush=True)
    target = specjax.load_model(target_path, mesh=mesh, attention=attention)
    tokenizer = target_tokenizer(target_path, tokenizer)
    drafter = load_draft(draft, target, tokenizer, target_path)
    if mesh is not None and drafter is not None and not isinstance(drafter, specjax.DraftModel):
        raise ValueError("--mesh shards the target and a draft model; other drafters run on one device")
    if mesh is not None and drafter is not None:  # small: a copy on every device, rows over data
        drafter = drafter.replace(model=specjax.shard_model(drafter.model, mesh, rules=(("batch", "data"),)))
    length = int(max_model_len or default_max_len(target.config))
    if kv_pages is None and kv_cache_bytes is None and not dense_kv_cache:
        kv_pages, kv_cache_bytes = default_pool(slots, length, page_size, mesh)
    engine = specjax.Engine(target, draft=drafter, slots=slots, max_len=length, mesh=mesh,
                            deterministic=deterministic, steps_per_call=steps_per_call, kv_pages=kv_pages,
                            kv_cache_bytes=kv_cache_bytes, page_size=page_size,
                            prefix_caching=None if prefix_caching else False, prefill_chunk=prefill_chunk,
                            max_logprobs=max_logprobs, logprobs_mode=logprobs_mode,
                            max_grammar_states=max_grammar_states, max_grammar_edges=max_grammar_edges,
                            max_grammar_masks=max_grammar_masks)
    name = served_model_name or Path(target_path).name
    server = Server(engine, tokenizer, name, max_model_len=length, api_key=api_key, max_queue=max_queue,
                    stop_ids=stop_ids(target, tokenizer) or ())
    if warmup:
        _compile(engine, slots, length)
    if engine.pages is not None:
        pool = engine.pages
        print(f"specjax serve: KV cache in {pool.num_pages - 1} pages of {pool.page_size} positions "
              f"({readable(engine.kv_budget['kv_cache_bytes'])}): {pool.capacity_tokens} tokens for {slots} slots; "
              f"prefix caching {'on' if engine.prefix_caching else 'off'}",
              file=sys.stderr, flush=True)
    print(f"specjax serve: {name} on http://{host}:{port}/v1 (draft: {draft})", file=sys.stderr, flush=True)
    config = uvicorn.Config(create_app(server, owns_engine=True), host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=drain_timeout, access_log=access_log)
    if access_log:  # (Config set every uvicorn logger to log_level)
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    _server_class()(config).run()
    return 0


def default_pool(slots: int, length: int, page_size: int, mesh=None) -> tuple[int | None, str | None]:
    """(kv_pages, kv_cache_bytes) of a server given neither: "auto" (90% of the free device
    memory) where the device reports its memory; elsewhere (a CPU) the pages that `slots`
    rows of `length` positions would hold, the memory of dense rows."""
    from specjax.memory import device_free_bytes

    if device_free_bytes(mesh) is not None:
        return None, "auto"
    return slots * -(-length // page_size), None


def default_compilation_cache() -> Path:
    """$XDG_CACHE_HOME/specjax/xla (~/.cache/specjax/xla): where `specjax serve` keeps its
    compiled programs unless told otherwise."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specjax" / "xla"


def use_compilation_cache(folder) -> Path:
    """Turns on JAX's persistent compilation cache in `folder` for this process (every
    program, however quick to compile: a server compiles many small ones). A process-wide
    setting: the server's, never the library's."""
    import jax

    folder = Path(folder).expanduser().absolute()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    check_private(folder)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return folder


def check_private(folder: Path):
    """Refuses (ValueError) a compilation cache that another user could write: its entries
    are native code this process runs. The folder and every folder above it up to the root
    must be owned by this user or root and not writable by others (a sticky folder such as
    /tmp excepted above it)."""
    if not hasattr(os, "getuid"):
        return
    me = os.getuid()
    for at in [folder, *folder.parents]:
        info = at.stat()
        sticky = at != folder and info.st_mode & stat.S_ISVTX
        if info.st_uid not in (me, 0) or (info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky):
            raise ValueError(f"the compilation cache {folder} holds code this server runs, and {at} can be written by "
                             f"others (owner uid {info.st_uid}, mode {stat.filemode(info.st_mode)}): give "
                             f"--compilation-cache a folder only you can write")


def _compile(engine, slots: int, length: int):
    """On a CPU: every program compiled in the background while the server serves at once (a
    request compiles what it needs first; `Engine.compile_all(background=True)`). Elsewhere
    (a state of the thread's own beside the engine's would not fit an accelerator): the
    programs needed to serve compiled now with a count on stderr, the rest (grouped
    prefills) in the background. Either way a line says when they are all done (/health
    says "warming" until then)."""
    from tqdm import tqdm

    programs = len(engine.stats()["programs"])
    start = time.perf_counter()
    background = {"done": 0}
    if engine.compiles_while_serving:
        print(f"specjax serve: serving at once; its {programs} programs ({slots} slots x {length} tokens, K by "
              f"live rows {list(engine.k_table)}) compile in the background, and a request compiles those it "
              f"needs first", file=sys.stderr, flush=True)
        engine.compile_all(background=True, progress=lambda n: background.update(done=background["done"] + n))
    else:
        later = len(engine.programs.admissions) * len(engine.programs.groups())
        print(f"specjax serve: compiling {programs - later} of {programs} programs ({slots} slots x {length} tokens, "
              f"K by live rows {list(engine.k_table)}); the {later} that prefill several requests at once "
              f"compile in the background once serving", file=sys.stderr, flush=True)
        with tqdm(total=programs - later, desc="specjax serve: compiling", unit="program", file=sys.stderr,
                  mininterval=1.0) as bar:

            def progress(n):
                if threading.current_thread() is threading.main_thread():
                    bar.update(n)
                else:
                    background["done"] += n

            engine.compile_all(groups_later=True, progress=progress)
        if engine.step_ms is not None:
            print(f"specjax serve: K by live rows {list(engine.k_table)} at the steps timed here", file=sys.stderr,
                  flush=True)

    def announce():
        engine.wait_warm()
        if engine.compile_error is not None:
            print(f"specjax serve: the background compile stopped ({engine.compile_error!r}); requests compile the "
                  f"programs they need, and are prefilled in the group sizes compiled", file=sys.stderr, flush=True)
        elif not engine.stats()["compiling"]:
            print(f"specjax serve: fully warm: {programs} programs compiled in {time.perf_counter() - start:.0f} s "
                  f"({background['done']} in the background); K by live rows {list(engine.k_table)}",
                  file=sys.stderr, flush=True)

    threading.Thread(target=announce, name="specjax-warm", daemon=True).start()


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            """SIGTERM and SIGINT start uvicorn's graceful shutdown (a second one forces it).
            uvicorn's own capture raises the signal again once drained, and the process then
            dies of it (exit -15); a server that drained as asked exits 0."""
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server
