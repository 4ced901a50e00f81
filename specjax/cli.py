"""The `specjax` command. It parses arguments and calls the library; no logic of its own."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

from specjax.shipped import default_checkpoint
from specjax.text import TextStream, encode_prompts, stop_ids


def _info(args):
    import specjax

    model = specjax.load_model(args.path)
    c = model.config
    print(json.dumps({"model_type": c.model_type, "params": c.num_params(), "dtype": str(model.dtype),
                      "layers": c.num_layers, "hidden": c.hidden_size, "heads": c.num_heads,
                      "kv_heads": c.num_kv_heads, "vocab": c.vocab_size}, indent=2))


def _decoding(args, model, tokenizer) -> tuple[list[int] | None, dict]:
    """Stop ids and sampling parameters: the flags where given, else the model's
    generation_config.json (else config.json's ids, else the tokenizer's EOS), with
    transformers' defaults for what neither says."""
    from specjax.config import GenerationConfig

    gen = model.generation_config or GenerationConfig()
    if args.ignore_eos:
        stop = None
    elif args.eos_token_id:
        stop = list(args.eos_token_id)
    else:
        stop = stop_ids(model, tokenizer)
    sampling = {"temperature": args.temperature if args.temperature is not None
                else gen.temperature if gen.do_sample else 0.0,
                "top_k": gen.top_k if args.top_k is None else args.top_k,
                "top_p": gen.top_p if args.top_p is None else args.top_p}
    return stop, sampling


def _generate(args):
    import time

    import jax

    import specjax
    from specjax.drafters.vocab import read_vocab

    prompts = [args.prompt] if args.prompt is not None else []
    if args.batch_file:
        from specjax.hf import check_regular  # a FIFO or /dev/zero would be read forever

        prompts += [line.rstrip("\n").replace("\\n", "\n")
                    for line in check_regular(Path(args.batch_file)).read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError("give a PROMPT or --batch-file")
    mesh = _mesh(args)
    target = specjax.load_model(args.target, quantize=args.quantize, mesh=mesh)
    tokenizer = specjax.load_tokenizer(args.target)
    tree = _parse_tree(args.tree)
    if mesh is not None and (args.early_exit is not None or args.prompt_lookup or args.lookahead or args.retrieval
                             or args.drafter):
        raise ValueError("--mesh shards the target and the draft model; other drafters run on one device: drop "
                         "--mesh, or draft with a draft model (--draft) or none (--no-draft)")
    if tree is not None and (args.no_draft or args.prompt_lookup or args.lookahead):
        raise ValueError("--tree needs a draft model, heads, --early-exit or --retrieval")
    if args.no_draft:
        draft, drafter_name = None, "none"
    elif args.early_exit is not None:
        draft, drafter_name = specjax.EarlyExit(args.early_exit, tree), f"early exit after {args.early_exit} layers"
    elif args.prompt_lookup:
        draft, drafter_name = specjax.PromptLookup(), "prompt lookup"
    elif args.lookahead:
        window, ngram, guesses = args.lookahead
        draft = specjax.Lookahead(window=window, ngram=ngram, guesses=guesses)
        drafter_name = f"lookahead (window {window}, {ngram}-grams, {guesses} guesses)"
    elif args.retrieval:
        draft = specjax.Retrieval(specjax.Datastore.load(args.retrieval), tree=tree)
        drafter_name = f"retrieval from {args.retrieval}"
    elif args.drafter:
        path = default_checkpoint(args.drafter) if args.drafter in ("medusa", "eagle", "eagle3") else args.drafter
        draft = specjax.load_drafter(path, tree)
        drafter_name = f"{type(draft).__name__} heads {path}"
    else:
        model = specjax.load_model(args.draft, quantize=args.quantize)
        if mesh is not None:  # small: a copy on every device, rows still over data
            model = specjax.shard_model(model, mesh, rules=(("batch", "data"),))
        draft, drafter_name = specjax.DraftModel(model, tree), f"draft model {args.draft}"
        if (vocab := read_vocab(args.draft, model.config.vocab_size)) is not None:  # distill --draft-vocab's
            draft, drafter_name = draft.with_vocab(vocab), drafter_name + f" ({len(vocab)}-token draft vocabulary)"
        try:
            draft_tokenizer = specjax.load_tokenizer(args.draft)
        except (OSError, ValueError):
            print(f"note: {args.draft} has no tokenizer; assuming it shares the target's", file=sys.stderr)
        else:
            specjax.hf.check_tokenizers(tokenizer, draft_tokenizer, args.target, args.draft)
    num_draft_tokens = args.num_draft_tokens
    if num_draft_tokens == "auto":  # chosen here, so that the summary names the choice
        from specjax.generate import auto_shape

        draft, num_draft_tokens = auto_shape(len(prompts), draft, max_new_tokens=args.max_new_tokens)
        tree = getattr(draft, "tree", None)
        drafter_name = "none (auto: speculation off at this batch size)" if draft is None else drafter_name + " (auto)"
    if tree is not None:
        drafter_name += f", tree of {tree.nodes} nodes, depth {tree.depth}"
    ids = encode_prompts(tokenizer, prompts, args.chat)
    padded, lengths = specjax.pad_prompts(ids)
    stop, sampling = _decoding(args, target, tokenizer)
    streaming = len(prompts) == 1 and not args.json and not args.no_stream
    printer = TextStream(tokenizer, skip_special_tokens=False) if streaming else None

    start = time.perf_counter()  # ahead-of-time: compilation alone, the batch is not run
    run = specjax.compile_generate(target, padded, lengths, draft=draft, key=jax.random.key(args.seed),
                                   max_new_tokens=args.max_new_tokens,
                                   num_draft_tokens=num_draft_tokens, eos_token_id=stop,
                                   adaptive_k=args.adaptive_k, stream=printer, deterministic=args.deterministic,
                                   **sampling)
    compile_seconds = time.perf_counter() - start
    if streaming:
        print(prompts[0], end="", flush=True)
    start = time.perf_counter()
    out = jax.block_until_ready(run())
    seconds = time.perf_counter() - start
    out = specjax.gather(out)

    generated = int(out.num_tokens.sum())
    steps, drafted, accepted = (int(x.sum()) for x in (out.stats.steps, out.stats.drafted, out.stats.accepted))
    stats = {
        "tokens": generated, "seconds": seconds, "tokens_per_s": generated / seconds,
        "compile_seconds": compile_seconds, "batch": len(prompts),
        "drafter": drafter_name,
        "num_draft_tokens": 0 if draft is None else tree.nodes if tree else (
            draft.resolve(None).tree.nodes if args.lookahead else num_draft_tokens or 4),
        "acceptance_rate": accepted / drafted if drafted else None,
        "tokens_per_target_pass": generated / steps,  # per row: target passes it took part in
        "eos_token_id": stop, **sampling,
    }
    texts = [tokenizer.decode(out.tokens[b, : out.num_tokens[b]].tolist()) for b in range(len(prompts))]
    if args.json:
        rows = [{"prompt": p, "prompt_ids": i, "text": t, "num_tokens": int(n), "steps": int(st),
                 "drafted": int(d), "accepted": int(a)} for p, i, t, n, st, d, a in zip(
                    prompts, ids, texts, out.num_tokens, out.stats.steps, out.stats.drafted,
                    out.stats.accepted)]
        print(json.dumps({"outputs": rows, "stats": stats}, indent=2))
        return
    if streaming:
        print(texts[0][len(printer.text):])  # what the stream held back, if anything
        print("-" * 40)
    else:
        for p, t in zip(prompts, texts):
            print(p + t)
            print("-" * 40)
    acc = "-" if stats["acceptance_rate"] is None else f"{stats['acceptance_rate']:.2f}"
    print(f"{generated} tokens in {seconds:.3f} s: {stats['tokens_per_s']:.1f} tokens/s | acceptance "
          f"{acc} | {stats['tokens_per_target_pass']:.2f} tokens per target pass | drafter: "
          f"{stats['drafter']}, K={stats['num_draft_tokens']} | compile {stats['compile_seconds']:.1f} s "
          f"(not included)")


def _mesh(args):
    """The (data, model) mesh of --mesh over every process's devices, or None."""
    if args.mesh is None:
        return None
    import specjax

    data, model = args.mesh
    return specjax.make_mesh(data=data, model=model)


def _add_mesh_args(p, more: str = ""):
    p.add_argument("--mesh", type=_ints(2, "--mesh", "2,4"), metavar="DATA,MODEL",
                   help="shard the model over a (data, model) mesh of every process's devices (rows over data, "
                        "heads over model)" + more)
    _add_distributed_args(p)


def _add_distributed_args(p):
    p.add_argument("--coordinator", metavar="HOST:PORT",
                   help="join a jax.distributed job of several processes (one per host) at this coordinator; "
                        "with --num-processes and --process-id (on TPU pods and SLURM, --distributed finds all three)")
    p.add_argument("--num-processes", type=int, metavar="N")
    p.add_argument("--process-id", type=int, metavar="I")
    p.add_argument("--distributed", action="store_true",
                   help="jax.distributed.initialize() with JAX's own detection of the job (TPU pods, SLURM)")


def _start_distributed(args) -> bool:
    """Joins the jax.distributed job the flags name (if any); True when this process must
    stay silent (every process but process 0 runs the same program and prints nothing)."""
    given = [getattr(args, name, None) is not None for name in ("coordinator", "num_processes", "process_id")]
    if not (any(given) or getattr(args, "distributed", False)):
        return False
    if any(given) and not all(given):
        raise ValueError("--coordinator, --num-processes and --process-id go together (or use --distributed)")
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes; other backends ignore it
    jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                               process_id=args.process_id)
    return jax.process_index() != 0


def _text_files(paths):
    """Files named, and every file under the folders named (sorted, hidden ones skipped)."""
    files = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            files += sorted(f for f in path.rglob("*") if f.is_file()
                            and not any(part.startswith(".") for part in f.relative_to(path).parts))
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(f"datastore build: no file or folder {name}")
    return files


def _datastore_build(args):
    from tqdm import tqdm

    import specjax

    if bool(args.paths) == bool(args.stdlib_train):
        raise ValueError("datastore build: give FILES_OR_DIRS or --stdlib-train (not both)")
    tokenizer = specjax.load_tokenizer(args.tokenizer)
    if args.stdlib_train:
        from specjax.train.data import split_corpus

        texts = split_corpus()[0]
        sources = [(f"stdlib text {i}", t) for i, t in enumerate(texts)]
    else:
        sources = _text_files(args.paths)
    docs, skipped = [], []
    for source in tqdm(sources, desc="encoding", unit="file"):
        if isinstance(source, tuple):
            text = source[1]
        else:
            try:
                text = source.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                skipped.append(str(source))
                continue
        docs.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    if skipped:
        print(f"skipped {len(skipped)} files that are not UTF-8 text, e.g. {skipped[0]}", file=sys.stderr)
    if not any(docs):
        raise ValueError("datastore build: the files hold no text")
    datastore = specjax.Datastore.build(docs)
    datastore.save(args.out)
    size = sum(f.stat().st_size for f in Path(args.out).iterdir())
    print(f"{args.out}: {datastore.num_tokens} tokens in {datastore.num_documents} documents, "
          f"{size / 1e6:.1f} MB")


def _ints(count: int | None, flag: str, example: str):
    """An argparse type: COUNT comma-separated ints (any number for None), e.g. 5,4,5. Every
    flag's value is one word, so no flag can swallow the prompt that follows it."""
    def parse(text):
        try:
            values = tuple(int(x) for x in text.split(","))
        except ValueError:
            values = ()
        if not values or count is not None and len(values) != count:
            raise argparse.ArgumentTypeError(
                f"expected {count or 'one or more'} comma-separated ints such as {example}, got {text!r} "
                f"(a prompt goes before the flags, or write {flag}={example})")
        return values
    return parse


def _seed(text):
    """--seed: an int in [0, 2**32)."""
    try:
        seed = int(text)
    except ValueError:
        seed = -1
    if not 0 <= seed < 2**32:
        raise argparse.ArgumentTypeError(f"expected an int in [0, 2**32), got {text!r}")
    return seed


def _draft_tokens(text):
    """-k: an int or auto."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int or auto, got {text!r}") from None


def _parse_tree(text):
    """--tree DEPTH,TOP_K,NODES (dynamic) or a JSON list of rank paths (static)."""
    import specjax

    if text is None:
        return None
    try:
        if text.lstrip().startswith("["):
            return specjax.Tree.from_paths(json.loads(text))
        depth, top_k, nodes = (int(x) for x in text.split(","))
        return specjax.Tree(depth, top_k, nodes)
    except RecursionError:
        raise ValueError(f"--tree: its JSON nests too deeply to be rank paths ({len(text)} characters)") from None
    except (ValueError, TypeError) as e:
        raise ValueError(f"--tree {text!r}: {e} (give DEPTH,TOP_K,NODES such as 8,2,24, "
                         f"or rank paths such as '[[0], [1], [0, 0]]')")


def _model_config(args, vocab_size, tokenizer):
    from specjax.config import ModelConfig

    return ModelConfig(
        model_type="llama", vocab_size=vocab_size, hidden_size=args.hidden, num_layers=args.layers,
        num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        intermediate_size=args.intermediate, max_position_embeddings=args.max_positions,
        norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def _train_config(args):
    from specjax.train import TrainConfig

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in fields and v is not None})


def _train(args):
    import jax
    import jax.numpy as jnp

    from specjax.models import init
    from specjax.train import data, train

    mesh = _mesh(args)
    tokenizer, stream, held, held_modules = _in_turn(lambda: data.prepare(args.out, vocab_size=args.vocab))
    config = _model_config(args, len(tokenizer), tokenizer)
    model = _placed(init(config, jax.random.key(args.init_seed), jnp.float32), mesh)
    print(f"target: {config.num_params() / 1e6:.2f}M params; {len(stream)} training tokens; "
          f"held out: {', '.join(held_modules)}")
    model, metrics = train(model, stream, held, _train_config(args), args.out,
                           record={"held_out_modules": held_modules}, mesh=mesh)
    _export(model, Path(args.out) / "tokenizer", Path(args.out) / "hf", args.dtype)


def _distill(args):
    import jax
    import jax.numpy as jnp

    import specjax
    from specjax.drafters import vocab
    from specjax.models import init
    from specjax.train import data, train

    mesh = _mesh(args)
    teacher = specjax.load_model(args.target, dtype=jnp.float32, mesh=mesh)
    V = teacher.config.vocab_size
    if args.draft_vocab is not None:  # refused before the corpus is prepared
        vocab.check_vocab_size(args.draft_vocab, V)
    tokenizer, stream, held, held_modules = _in_turn(lambda: data.prepare(args.out, tokenizer_folder=args.target))
    if args.on_policy:
        stream = _with_continuations(args, teacher, tokenizer, stream, mesh)
    config = _model_config(args, teacher.config.vocab_size, tokenizer)
    model = _placed(init(config, jax.random.key(args.init_seed), jnp.float32), mesh)
    print(f"draft: {config.num_params() / 1e6:.2f}M params distilled from "
          f"{teacher.config.num_params() / 1e6:.2f}M ({args.loss}, T={args.temperature}, "
          f"ce_weight={args.ce_weight})")
    model, metrics = train(model, stream, held, _train_config(args), args.out, teacher=teacher,
                           record={"held_out_modules": held_modules, "target": str(args.target)}, mesh=mesh)
    _export(model, args.target, Path(args.out) / "hf", args.dtype)
    if args.draft_vocab is not None and jax.process_index() == 0:  # its training text's most frequent ids
        vocab.save_vocab(Path(args.out) / "hf", vocab.draft_vocabulary(stream, args.draft_vocab, V), V)


def _with_continuations(args, teacher, tokenizer, stream, mesh):
    """The training stream and --on-policy-repeat copies of the target's continuations,
    generated once per run directory (a resumed run reads the same tokens)."""
    import numpy as np

    from specjax.train import continuations, data

    if mesh is not None:
        raise ValueError("--on-policy does not run with --mesh or several processes yet: leave them out")
    file = Path(args.out) / "data" / f"continuations_{args.on_policy}.npy"
    if not file.exists():
        eos = tokenizer.convert_tokens_to_ids(data.EOS)
        np.save(file, continuations.continuations(teacher, stream, args.on_policy, eos))
    generated = np.load(file)
    print(f"on-policy: {args.on_policy} target continuations ({len(generated)} tokens) x {args.on_policy_repeat}")
    return continuations.mixed(stream, generated, args.on_policy_repeat)


def _train_heads(args):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import specjax
    from specjax.drafters import vocab
    from specjax.measure import held_out_prompts
    from specjax.train import data, heads

    if args.kind == "eagle":
        if args.draft_vocab is not None and not args.eagle3:
            raise ValueError("--draft-vocab is EAGLE-3's: pass --eagle3 with it")
        if args.steps is None:
            args.steps = 500 if args.eagle3 else 1000
        if args.lr is None:
            args.lr = 1.5e-3 if args.eagle3 else 1e-3
    mesh = _mesh(args)
    target = specjax.load_model(args.target, dtype=jnp.float32, mesh=mesh)
    if getattr(args, "draft_vocab", None) is not None:  # refused before the corpus is prepared
        vocab.check_vocab_size(args.draft_vocab, target.config.vocab_size)
    tokenizer, stream, held, held_modules = _in_turn(lambda: data.prepare(args.out, tokenizer_folder=args.target))
    probe = np.array(held_out_prompts(tokenizer, args.probe_prompts, 64, seed=1), np.int32)
    common = dict(record={"held_out_modules": held_modules, "target": str(args.target)}, probe_prompts=probe,
                  mesh=mesh)
    if args.kind == "medusa":
        drafter, metrics = heads.train_medusa(target, args.heads, stream, held, _train_config(args), args.out,
                                              num_layers=args.head_layers, **common)
    elif args.eagle3:
        drafter, metrics = heads.train_eagle3(target, stream, held, _train_config(args), args.out,
                                              steps=args.ttt_steps, feature_layers=args.feature_layers,
                                              draft_vocab=args.draft_vocab, **common)
    else:
        drafter, metrics = heads.train_eagle(target, stream, held, _train_config(args), args.out, **common)
    drafter = drafter.replace(params=specjax.gather(drafter.params))  # whole in every process
    if jax.process_index() == 0:  # one process writes
        out = drafter.replace(signature=dataclasses.replace(drafter.signature, name=str(args.target))).save(
            Path(args.out) / "drafter")
        print(f"saved to {out}; last evaluation: {json.dumps(metrics)}")


def _in_turn(prepare):
    """prepare() in process 0 first (it writes the run directory's caches), then in the
    others (they read them)."""
    import jax

    from specjax.sharding import barrier

    out = prepare() if jax.process_index() == 0 else None
    barrier("specjax data prepared")
    return out if out is not None else prepare()


def _placed(model, mesh):
    """The model on the mesh (tensor parallel over model, rows over data), or as it is."""
    import specjax

    return model if mesh is None else specjax.shard_model(model, mesh)


def _export(model, tokenizer_folder, out, dtype):
    import jax
    import jax.numpy as jnp

    import specjax

    model = model.replace(params=specjax.gather(model.params))  # whole in every process
    if jax.process_index() != 0:  # one process writes
        return
    specjax.save_model(model, out, dtype=None if dtype == "float32" else jnp.dtype(dtype))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(tokenizer_folder) / name).exists():
            shutil.copy(Path(tokenizer_folder) / name, Path(out) / name)
    print(f"exported to {out}")


def _export_run(args):
    from specjax.train.loop import restore_model

    model, record = restore_model(args.run_dir)
    tokenizer = Path(record.get("target") or Path(args.run_dir) / "tokenizer")
    _export(model, tokenizer, args.out, args.dtype)
    print(json.dumps(record.get("metrics", {}), indent=2))


def _add_model_args(p, hidden, layers, heads, kv_heads, intermediate):
    p.add_argument("--hidden", type=int, default=hidden)
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--heads", type=int, default=heads)
    p.add_argument("--kv-heads", type=int, default=kv_heads)
    p.add_argument("--intermediate", type=int, default=intermediate)
    p.add_argument("--max-positions", type=int, default=1024)
    p.add_argument("--init-seed", type=int, default=0)


def _add_train_args(p, steps, lr, defaults=None, lr_defaults=None):
    p.add_argument("--out", required=True, help="run directory (checkpoints, data, export)")
    p.add_argument("--steps", type=int, default=steps, help=defaults)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=lr, help=lr_defaults)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--seed", type=int, default=0, help="data order")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="storage dtype of the exported Hugging Face folder")


def _bench(args):
    """`specjax bench`: a synthetic pair (specjax.synthetic), or bench's own sections."""
    if not args.synthetic:
        from specjax import bench

        return bench.run_from_args(args)
    if args.dtype != "float32":
        raise ValueError("--synthetic runs in the backend's default dtype; leave out --dtype")
    import jax

    from specjax.models import default_dtype
    from specjax.synthetic import run_synthetic

    run_synthetic(args.synthetic, args.draft_layers, ks=tuple(args.ks or (1, 2, 4, 6)), batches=tuple(args.batches),
                  max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                  dtype=jax.numpy.dtype(default_dtype()).name, hf=args.hf)


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad flag reported in one line (not the whole usage) and exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv=None):
    parser = _Parser(prog="specjax", description="Speculative decoding in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="describe a Hugging Face checkpoint folder")
    p.add_argument("path")
    p.set_defaults(run=_info)

    p = sub.add_parser("generate", help="speculative decoding on the shipped pair (or any pair)")
    p.add_argument("prompt", nargs="?", help="prompt text (or use --batch-file)")
    p.add_argument("--target", default=default_checkpoint("target"))
    p.add_argument("--draft", default=default_checkpoint("draft"))
    drafters = p.add_mutually_exclusive_group()
    drafters.add_argument("--no-draft", action="store_true", help="plain autoregressive decoding")
    drafters.add_argument("--drafter", metavar="PATH|medusa|eagle|eagle3",
                          help="trained draft heads saved by train-medusa/train-eagle (medusa, eagle, eagle3: "
                               "the shipped checkpoints/medusa, checkpoints/eagle, checkpoints/eagle3)")
    drafters.add_argument("--early-exit", type=int, metavar="N",
                          help="draft with the target's own first N layers")
    drafters.add_argument("--prompt-lookup", action="store_true",
                          help="draft by n-gram lookup in the prompt and output")
    drafters.add_argument("--lookahead", type=_ints(3, "--lookahead", "5,4,5"), nargs="?", const=(5, 4, 5),
                          metavar="W,N,G",
                          help="lookahead decoding, no draft: Jacobi window W, N-grams, G guesses (default 5,4,5)")
    drafters.add_argument("--retrieval", metavar="DATASTORE",
                          help="draft by retrieval from a datastore folder (specjax datastore build)")
    p.add_argument("--adaptive-k", action="store_true",
                   help="move each row's draft length in 1..K by its acceptance")
    _add_mesh_args(p, "; the draft model is replicated")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("-k", "--num-draft-tokens", type=_draft_tokens, default=None,
                   help="chain length K (default 4), or auto: K for the batch size (with --tree D,C,N: the "
                        "node budget, at most N) from the shipped cost profile")
    p.add_argument("--tree", metavar="SHAPE",
                   help="draft a token tree: DEPTH,TOP_K,NODES (dynamic, e.g. 8,2,24) or JSON rank paths")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 is greedy (default: the model's generation_config.json, else greedy)")
    p.add_argument("--top-k", type=int, default=None,
                   help="0 is off (default: generation_config.json's, else 50 as in transformers)")
    p.add_argument("--top-p", type=float, default=None,
                   help="1 is off (default: generation_config.json's, else 1)")
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--batch-file", help="one prompt per line (\\n for newlines), run as one batch")
    p.add_argument("--chat", action="store_true",
                   help="wrap each prompt as a user turn of the tokenizer's chat template")
    stops = p.add_mutually_exclusive_group()
    stops.add_argument("--eos-token-id", type=_ints(None, "--eos-token-id", "2,7"), metavar="ID[,ID...]",
                       help="stop ids, comma-separated (default: the model's generation_config.json, "
                            "else config.json's)")
    stops.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    p.add_argument("--no-stream", action="store_true", help="print a single prompt's text only at the end")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--deterministic", action="store_true",
                   help="compute every token of the target by fixed-shape passes: greedy output equals plain "
                        "greedy output bit for bit in any dtype, whatever the drafter and batch (slower; CPU)")
    p.add_argument("--quantize", choices=["int8"], default=None,
                   help="int8 weight-only quantisation of the target and the draft, each on its own")
    p.set_defaults(run=_generate)

    p = sub.add_parser("datastore", help="datastores for retrieval drafting (specjax.Retrieval)")
    datastore = p.add_subparsers(dest="datastore_command", required=True)
    p = datastore.add_parser("build", help="tokenize text files and build a suffix-array datastore")
    p.add_argument("paths", nargs="*", metavar="FILES_OR_DIRS", help="text files, or folders to read all files of")
    p.add_argument("--tokenizer", required=True, help="a folder with the target's tokenizer")
    p.add_argument("--out", required=True, help="the datastore folder to write")
    p.add_argument("--stdlib-train", action="store_true",
                   help="instead of files: the shipped pair's training corpus (specjax.train.data.split_corpus)")
    p.set_defaults(run=_datastore_build)

    p = sub.add_parser("bench", help="autoregressive vs speculative, side by side, with plots")
    from specjax import bench

    bench.add_arguments(p)
    _add_distributed_args(p)  # in a job of several processes each benches its own devices; process 0 prints
    p.set_defaults(run=_bench)

    p = sub.add_parser("train", help="train a Llama-family target from scratch on the stdlib")
    _add_train_args(p, steps=1000, lr=1.5e-3)
    _add_mesh_args(p)
    _add_model_args(p, hidden=384, layers=6, heads=6, kv_heads=2, intermediate=1024)
    p.add_argument("--vocab", type=int, default=4096, help="byte-level BPE vocabulary size")
    p.set_defaults(run=_train)

    p = sub.add_parser("distill", help="distill a small draft from a target folder")
    p.add_argument("--target", default="checkpoints/target")
    _add_train_args(p, steps=1000, lr=3e-3)
    _add_mesh_args(p)
    _add_model_args(p, hidden=128, layers=2, heads=2, kv_heads=1, intermediate=384)
    p.add_argument("--loss", default="kl", choices=["kl", "tv"])
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--ce-weight", type=float, default=0.0)
    p.add_argument("--on-policy", type=int, default=0, metavar="N",
                   help="also train on N continuations of training windows written by the target (batches of 64, "
                        "greedy and temperature 1 in turn); 0: the corpus only")
    p.add_argument("--on-policy-repeat", type=int, default=4, metavar="R",
                   help="copies of those continuations in the training stream (their share of the windows)")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N", help="save the training text's N most "
                   "frequent tokens beside the export (draft_vocab.json): the draft proposes only those")
    p.set_defaults(run=_distill)

    for kind in ("medusa", "eagle"):
        p = sub.add_parser(f"train-{kind}", help=f"train {kind.capitalize()} draft heads on a frozen target "
                                                 f"(self-distillation on the stdlib)")
        p.add_argument("--target", default="checkpoints/target")
        if kind == "medusa":
            _add_train_args(p, steps=1000, lr=1e-3)
        else:  # EAGLE-3's steps each unroll --ttt-steps drafting steps: its recipe takes fewer, larger ones
            _add_train_args(p, steps=None, lr=None, defaults="(default: 1000, or 500 with --eagle3)",
                            lr_defaults="(default: 1e-3, or 1.5e-3 with --eagle3)")
        p.add_argument("--loss", default="kl", choices=["kl", "tv"])
        p.add_argument("--temperature", type=float, default=1.0)
        p.add_argument("--probe-prompts", type=int, default=4,
                       help="held-out prompts on which each evaluation runs the real loop")
        _add_mesh_args(p, "; the heads are replicated")
        if kind == "medusa":
            p.add_argument("--heads", type=int, default=4, help="number of heads (the deepest draft)")
            p.add_argument("--head-layers", type=int, default=1, help="residual blocks per head")
        else:
            p.add_argument("--eagle3", action="store_true",
                           help="EAGLE-3: features of three target layers, trained over unrolled drafting steps")
            p.add_argument("--ttt-steps", type=int, default=4, help="EAGLE-3: drafting steps unrolled in training")
            p.add_argument("--feature-layers", type=_ints(None, "--feature-layers", "1,3,5"), default=None,
                           metavar="I,J,K", help="EAGLE-3: the target layers (1..L) whose outputs it reads "
                                                 "(default: low, middle, high)")
            p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                           help="EAGLE-3: draft only the corpus' N most frequent tokens, through a head of its "
                                "own (default: the target's whole vocabulary)")
        p.set_defaults(run=_train_heads, kind=kind)

    p = sub.add_parser("export", help="write a run's latest checkpoint as a Hugging Face folder")
    p.add_argument("run_dir", metavar="RUN")
    p.add_argument("out")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.set_defaults(run=_export_run)

    args = parser.parse_args(argv)
    if _start_distributed(args):
        import contextlib
        import os

        with open(os.devnull, "w") as silent, contextlib.redirect_stdout(silent):
            return args.run(args)
    return args.run(args)


def entry(argv=None):
    """The `specjax` command: `main`, with a user's error (a missing or refused checkpoint, a
    bad value, a file that cannot be read, a request too large for the memory: ValueError,
    OSError and MemoryError, which specjax raises for bad input) printed as one line on
    stderr and exit code 2, as argparse does for bad flags.
    SPECJAX_TRACEBACK=1 shows the traceback instead; `main` itself raises (for programs)."""
    import os

    try:
        return main(argv)
    except KeyboardInterrupt:
        print("specjax: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, MemoryError) as e:
        if os.environ.get("SPECJAX_TRACEBACK"):
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"specjax: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(entry())
