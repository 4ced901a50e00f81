"""The `specjax` command. It parses arguments and calls the library; no logic of its own."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specjax import flags
from specjax.shipped import default_checkpoint
from specjax.text import (TextStream, check_draft_tokenizer, encode_prompts, read_prompts, stop_ids,
                          target_tokenizer)
from specjax.train import commands


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
                "top_p": gen.top_p if args.top_p is None else args.top_p,
                "min_p": (gen.min_p if gen.do_sample else 0.0) if args.min_p is None else args.min_p,
                "repetition_penalty": gen.repetition_penalty if args.repetition_penalty is None
                else args.repetition_penalty,
                "presence_penalty": args.presence_penalty, "frequency_penalty": args.frequency_penalty}
    return stop, sampling


def _generate(args):
    import time

    import jax

    import specjax

    prompts = read_prompts(args.prompt, args.batch_file)
    mesh = flags.mesh(args)
    target = specjax.load_model(args.target, quantize=args.quantize, mesh=mesh, attention=args.attention)
    tokenizer = target_tokenizer(args.target, args.tokenizer)
    tree = _parse_tree(args.tree)
    if mesh is not None and (args.early_exit is not None or args.prompt_lookup or args.lookahead or args.retrieval
                             or args.drafter):
        raise ValueError("--mesh shards the target and the draft model; other drafters run on one device: drop "
                         "--mesh, or draft with a draft model (--draft) or none (--no-draft)")
    if tree is not None and (args.no_draft or args.prompt_lookup or args.lookahead):
        raise ValueError("--tree needs a draft model, heads, --early-exit or --retrieval")
    draft, drafter_name = _drafter(args, target, tokenizer, tree, mesh)
    num_draft_tokens = args.num_draft_tokens
    if num_draft_tokens == "auto":  # chosen here, so that the summary names the choice
        from specjax.generate import auto_shape

        draft, num_draft_tokens = auto_shape(len(prompts), draft, max_new_tokens=args.max_new_tokens)
        tree = getattr(draft, "tree", None)
        drafter_name = "none (auto: speculation off at this batch size)" if draft is None else drafter_name + " (auto)"
    shape = tree if tree is not None else draft.resolve(None).tree if args.lookahead else None  # a tree's shape
    if shape is not None:
        drafter_name += f", tree of {shape.nodes} nodes, depth {shape.depth}"
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
        "num_draft_tokens": 0 if draft is None else shape.nodes if shape else num_draft_tokens or 4,
        "tree": None if shape is None else {"depth": shape.depth, "nodes": shape.nodes},
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
    print(_summary(stats))


def _summary(stats: dict) -> str:
    """generate's last line: tokens per target pass (one name, chain or tree), and a chain's
    acceptance rate and K. A tree's (and lookahead's) shape is in the drafter's name; a rate
    over all its nodes, most of them siblings that cannot all be kept, says nothing."""
    if stats["tree"] is not None:
        speculation = f"{stats['tokens_per_target_pass']:.2f} tokens per target pass"
        drafter = stats["drafter"]
    else:
        acc = "-" if stats["acceptance_rate"] is None else f"{stats['acceptance_rate']:.2f}"
        speculation = f"acceptance {acc} | {stats['tokens_per_target_pass']:.2f} tokens per target pass"
        drafter = f"{stats['drafter']}, K={stats['num_draft_tokens']}"
    return (f"{stats['tokens']} tokens in {stats['seconds']:.3f} s: {stats['tokens_per_s']:.1f} tokens/s | "
            f"{speculation} | drafter: {drafter} | compile {stats['compile_seconds']:.1f} s (not included)")


def _drafter(args, target, tokenizer, tree, mesh):
    """(the drafter the flags name or None, its name for the summary)."""
    import specjax

    if args.no_draft:
        return None, "none"
    if args.early_exit is not None:
        return specjax.EarlyExit(args.early_exit, tree), f"early exit after {args.early_exit} layers"
    if args.prompt_lookup:
        return specjax.PromptLookup(), "prompt lookup"
    if args.lookahead:
        window, ngram, guesses = args.lookahead
        return (specjax.Lookahead(window=window, ngram=ngram, guesses=guesses),
                f"lookahead (window {window}, {ngram}-grams, {guesses} guesses)")
    if args.retrieval:
        return specjax.Retrieval(specjax.Datastore.load(args.retrieval), tree=tree), f"retrieval from {args.retrieval}"
    if args.drafter:
        path = default_checkpoint(args.drafter) if args.drafter in ("medusa", "eagle", "eagle3") else args.drafter
        draft = specjax.load_drafter(path, tree)
        return draft, f"{type(draft).__name__} heads {path}"
    return _draft_model(args, target, tokenizer, tree, mesh)


def _draft_model(args, target, tokenizer, tree, mesh):
    """--draft's model as a DraftModel (with the vocabulary saved beside it, if any), after
    checking that it shares the target's tokenizer and noting a vocabulary of another size."""
    import specjax
    from specjax.drafters.model import vocabulary_note
    from specjax.drafters.vocab import read_vocab

    model = specjax.load_model(args.draft, quantize=args.quantize, attention=args.attention)
    if (note := vocabulary_note(target.config.vocab_size, model)) is not None:
        print(f"note: {note}", file=sys.stderr)
    if mesh is not None:  # small: a copy on every device, rows still over data
        model = specjax.shard_model(model, mesh, rules=(("batch", "data"),))
    draft, drafter_name = specjax.DraftModel(model, tree), f"draft model {args.draft}"
    if (vocab := read_vocab(args.draft, model.config.vocab_size)) is not None:  # distill --draft-vocab's
        draft, drafter_name = draft.with_vocab(vocab), drafter_name + f" ({len(vocab)}-token draft vocabulary)"
    if (note := check_draft_tokenizer(tokenizer, args.target, args.draft)) is not None:
        print(f"note: {note}", file=sys.stderr)
    return draft, drafter_name


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


def _bench(args):
    """`specjax bench`: a synthetic pair (specjax.tools.synthetic), or bench's own sections."""
    if args.tokenizer is not None and (args.synthetic or args.aot):
        raise ValueError("--tokenizer encodes the held-out prompts of a checkpoint pair; --synthetic and --aot "
                         "read none: leave it out")
    if not args.synthetic or args.aot:
        from specjax.tools import bench

        return bench.run_from_args(args)
    if args.dtype != "float32":
        raise ValueError("--synthetic runs in the backend's default dtype; leave out --dtype")
    import jax

    from specjax.models import default_dtype
    from specjax.tools import synthetic

    runs = synthetic.run_synthetic(args.synthetic, args.draft_layers, ks=tuple(args.ks or (1, 2, 4, 6)),
                                   batches=tuple(args.batches or (1, 4, 16)), max_new_tokens=args.max_new_tokens,
                                   repeats=args.repeats, dtype=jax.numpy.dtype(default_dtype()).name, hf=args.hf)
    if args.out is not None:
        _write_synthetic(args, runs)


def _write_synthetic(args, runs):
    """--synthetic's timed runs as OUT/synthetic.json."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"synthetic": args.synthetic, "draft_layers": args.draft_layers, "max_new_tokens": args.max_new_tokens,
              "repeats": args.repeats, "runs": [r.as_dict() for r in runs]}
    (out / "synthetic.json").write_text(json.dumps(report, indent=2, default=lambda x: x.tolist()) + "\n")
    print(f"wrote {out / 'synthetic.json'}")


def _serve(args):
    from specjax.serve.server import serve

    return serve(args.target, args.draft, host=args.host, port=args.port, slots=args.slots,
                 max_model_len=args.max_model_len, served_model_name=args.served_model_name,
                 api_key=args.api_key, max_queue=args.max_queue, deterministic=args.deterministic,
                 mesh=flags.mesh(args), steps_per_call=args.steps_per_call, drain_timeout=args.drain_timeout,
                 warmup=not args.no_warmup, attention=args.attention, tokenizer=args.tokenizer,
                 kv_pages=args.kv_pages, kv_cache_bytes=args.kv_cache_memory, page_size=args.page_size,
                 compilation_cache=None if args.no_compilation_cache else args.compilation_cache,
                 prefix_caching=not args.no_prefix_caching, prefill_chunk=args.prefill_chunk,
                 dense_kv_cache=args.dense_kv_cache, max_logprobs=None if args.no_logprobs else args.max_logprobs,
                 logprobs_mode=args.logprobs_mode, max_grammar_states=args.max_grammar_states,
                 max_grammar_edges=args.max_grammar_edges, max_grammar_masks=args.max_grammar_masks,
                 access_log=not args.no_access_log)


def _plan(args):
    """`specjax plan`: compile generate's program for a TPU slice here and say if it fits.
    Exit 0 when it fits, 1 when it does not (2: a usage error, from `entry`)."""
    from specjax.tools import plan

    draft = None if args.draft in (None, "none") else args.draft
    if args.draft is None and args.early_exit is None and args.target == default_checkpoint("target"):
        draft = default_checkpoint("draft")  # the shipped pair
    serving = {"--slots": args.slots, "--page-size": args.page_size, "--mean-tokens": args.mean_tokens,
               "--compile-limit": args.compile_limit}
    if args.serve:
        from specjax.tools.serve_plan import serve_plan

        given = _given_flags({"--early-exit": args.early_exit, "--tree": args.tree, "--mesh": args.mesh,
                              "--batch": args.batch, "--prompt-len": args.prompt_len})
        if given:
            raise ValueError(f"plan --serve plans `specjax serve`'s engine (a draft model's chain, on one chip): "
                             f"{given} not taken")
        print(serve_plan(args.target, draft, topology=args.topology, max_len=args.max_len,
                         num_draft_tokens=args.num_draft_tokens, quantize=args.quantize,
                         log=lambda line: print(line, file=sys.stderr, flush=True),
                         **_given_values(serving)))
        return 0
    if _given_flags(serving):
        raise ValueError(f"{_given_flags(serving)}: these plan a server; add --serve")
    result = plan.plan(args.target, draft, topology=args.topology, max_len=args.max_len,
                       num_draft_tokens=args.num_draft_tokens, tree=_parse_tree(args.tree), mesh=args.mesh,
                       quantize=args.quantize, early_exit=args.early_exit,
                       log=lambda line: print(line, file=sys.stderr, flush=True),
                       **_given_values({"--batch": args.batch, "--prompt-len": args.prompt_len}))
    print(result)
    return 0 if result.fits else 1


def _given_flags(values: dict) -> str:
    """The flags of `values` ({flag: value, None where not given}) that were given, in words."""
    return ", ".join(flag for flag, value in values.items() if value is not None)


def _given_values(values: dict) -> dict:
    """{flag: value} as keyword arguments ("--page-size" -> page_size), those given only: the
    library's defaults stand for the rest."""
    return {flag.removeprefix("--").replace("-", "_"): value for flag, value in values.items() if value is not None}


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad flag reported in one line (not the whole usage) and exit code 2;
    an unknown flag is named by the (sub)command that met it, with the closest known one."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        unknown = [a for a in extras if a.startswith("-") and a != "-" and not _is_number(a)]
        if unknown:  # the words after an unknown flag were read as positionals: name the flag alone
            self.error(f"unrecognized arguments: {' '.join(unknown)}{_did_you_mean(unknown[0], self)}")
        return namespace, extras


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _did_you_mean(flag: str, parser: argparse.ArgumentParser) -> str:
    import difflib

    close = difflib.get_close_matches(flag.partition("=")[0], list(parser._option_string_actions), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def main(argv=None):
    import specjax

    parser = _Parser(prog="specjax", description="Speculative decoding in JAX.")
    parser.add_argument("--version", action="version", version=f"specjax {specjax.__version__}",
                        help="print specjax's version and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="describe a Hugging Face checkpoint folder")
    p.add_argument("path", help="a model's folder or hub id")
    p.set_defaults(run=_info)

    p = sub.add_parser("generate", help="speculative decoding on the shipped pair (or any pair)")
    p.add_argument("prompt", nargs="?", help="prompt text (or use --batch-file; with both, this prompt is the "
                                             "batch's first row, before the file's)")
    p.add_argument("--target", default=default_checkpoint("target"),
                   help="the target model's folder or hub id (default: the shipped target)")
    p.add_argument("--draft", default=default_checkpoint("draft"),
                   help="the draft model's folder or hub id, drafting from the vocabulary saved beside it "
                        "(draft_vocab.json) if any (default: the shipped draft)")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="the target's tokenizer: a folder or hub id (default: the target's own folder; needed "
                        "for a folder that specjax.save_model wrote without one)")
    drafters = p.add_mutually_exclusive_group()
    drafters.add_argument("--no-draft", action="store_true", help="plain autoregressive decoding")
    drafters.add_argument("--drafter", metavar="PATH|medusa|eagle|eagle3",
                          help="trained draft heads: a folder or hub id of specjax's (train-medusa/train-eagle; "
                               "medusa, eagle, eagle3: the shipped checkpoints/medusa, checkpoints/eagle, "
                               "checkpoints/eagle3) or a published EAGLE-3 head's (EAGLE, SpecForge, speculators)")
    drafters.add_argument("--early-exit", type=int, metavar="N",
                          help="draft with the target's own first N layers")
    drafters.add_argument("--prompt-lookup", action="store_true",
                          help="draft by n-gram lookup in the prompt and output")
    drafters.add_argument("--lookahead", type=flags.ints(3, "--lookahead", "5,4,5"), nargs="?", const=(5, 4, 5),
                          metavar="W,N,G",
                          help="lookahead decoding, no draft: Jacobi window W, N-grams, G guesses (default 5,4,5)")
    drafters.add_argument("--retrieval", metavar="DATASTORE",
                          help="draft by retrieval from a datastore folder (specjax datastore build)")
    p.add_argument("--adaptive-k", action="store_true",
                   help="move each row's draft length in 1..K by its acceptance")
    flags.add_mesh_args(p, "; the draft model is replicated")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt at most "
                                                                   "(default 128)")
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
    p.add_argument("--min-p", type=float, default=None,
                   help="keep tokens of at least this times the top token's probability (0 is off; default: "
                        "generation_config.json's, else 0)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="divide (multiply, where negative) the logits of tokens the prompt or output holds by this "
                        "(1 is off; default: generation_config.json's, else 1)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract this from the logits of tokens the output holds (OpenAI's; 0, the default, is off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this per occurrence in the output (OpenAI's; 0, the default, is off)")
    p.add_argument("--seed", type=_seed, default=0, help="the sampling seed, an int in [0, 2**32) (default 0)")
    p.add_argument("--batch-file", metavar="FILE",
                   help="one prompt per line (\\n for newlines; blank lines skipped), run as one batch; a PROMPT "
                        "given too runs with them, as the batch's first row")
    p.add_argument("--chat", action="store_true",
                   help="wrap each prompt as a user turn of the tokenizer's chat template")
    stops = p.add_mutually_exclusive_group()
    stops.add_argument("--eos-token-id", type=flags.ints(None, "--eos-token-id", "2,7"), metavar="ID[,ID...]",
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
    flags.add_attention_arg(p)
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

    p = sub.add_parser("bench", help="autoregressive vs speculative, side by side in interleaved rounds (--sweep: "
                                     "every section, with plots)")
    from specjax.tools import bench

    bench.add_arguments(p)
    flags.add_distributed_args(p)  # in a job of several processes each benches its own devices; process 0 prints
    p.set_defaults(run=_bench)

    p = sub.add_parser("serve", help="an OpenAI-compatible server (/v1/completions, /v1/chat/completions) on the "
                                     "shipped pair (or any pair), with continuous batching")
    p.add_argument("target", nargs="?", default=default_checkpoint("target"),
                   help="the target's folder or hub id (default: the shipped target)")
    from specjax.serve.server import DRAFT_CHOICES

    p.add_argument("--draft", default=default_checkpoint("draft"), metavar=DRAFT_CHOICES,
                   help="a draft model's folder or hub id (or trained heads': specjax's drafter.json, or a "
                        "published EAGLE-3 head's; or a datastore's, for "
                        "retrieval), none (plain decoding), prompt-lookup, lookahead, early-exit:N (the target's "
                        "first N layers), medusa, eagle or eagle3 (the shipped heads); default: the shipped draft")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="the target's tokenizer: a folder or hub id (default: the target's own folder; needed "
                        "for a folder that specjax.save_model wrote without one)")
    p.add_argument("--host", default="127.0.0.1", help="the address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="the port to listen on (default 8000)")
    p.add_argument("--slots", type=int, default=8, help="requests decoded together (the engine's rows; default 8)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="tokens per request, prompt included (default: the target's positions, at most 2048)")
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the folder's)")
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on every /v1 route")
    p.add_argument("--max-queue", type=int, default=None,
                   help="requests that may wait for a slot; past it, 503 at once (default: 4 x slots)")
    p.add_argument("--deterministic", action="store_true",
                   help="a request's output does not depend on its neighbours, bit for bit (slower)")
    p.add_argument("--steps-per-call", type=int, default=4,
                   help="the most steps a device call runs (default 4): calls run the steps that last about 20 ms "
                        "at their timed costs, two at most while a slot is free")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests may take to finish (default 30)")
    p.add_argument("--no-warmup", action="store_true", help="compile programs as requests first need them")
    p.add_argument("--no-access-log", action="store_true",
                   help="no line on stderr per request (default: one, uvicorn's: client, request line, status)")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--compilation-cache", default="default", metavar="DIR",
                       help="keep compiled programs in DIR, so that a second start compiles nothing (default: "
                            "$XDG_CACHE_HOME/specjax/xla, i.e. ~/.cache/specjax/xla)")
    cache.add_argument("--no-compilation-cache", action="store_true", help="compile every program at every start")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--kv-pages", type=int, default=None, metavar="N",
                      help="keys and values (the target's and the drafter's) in a pool of N pages that the slots "
                           "share (PagedAttention): a request holds the pages its tokens reach, so --slots can exceed "
                           "what max-model-len rows would fit (default: --kv-cache-memory auto where the device "
                           "reports its memory; on a CPU the pages that --slots rows of --max-model-len would hold)")
    pool.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                      help="the page pool sized from a budget instead of --kv-pages: e.g. 4GiB, 512MiB; or 'auto': "
                           "90%% of the device's free memory after the weights and the programs' temporaries (not "
                           "on a CPU)")
    pool.add_argument("--dense-kv-cache", action="store_true",
                      help="no pages: each slot holds --max-model-len positions of its own (no prefix caching, no "
                           "chunked prefill)")
    p.add_argument("--page-size", type=int, default=16, help="positions per page, dividing 16 or a multiple of it (default 16)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="with pages, prefill every prompt whole (by default a prompt takes the cached pages of an "
                        "earlier one that began with the same tokens)")
    p.add_argument("--max-logprobs", type=int, default=20, metavar="N",
                   help="the most alternatives a request's logprobs / top_logprobs may list, 0-20 (default 20, "
                        "vLLM's): a call with such a request runs a program that scores its tokens")
    p.add_argument("--no-logprobs", action="store_true", help="refuse logprobs: compile no program that scores tokens")
    p.add_argument("--logprobs-mode", choices=("raw", "processed"), default="raw",
                   help="raw: the model's own distribution (vLLM's raw_logprobs, the default); processed: the one "
                        "sampled from (logit bias, temperature, top-k, top-p, min-p applied)")
    p.add_argument("--max-grammar-states", type=int, default=None, metavar="N",
                   help="each slot's room for a structured-output grammar (response_format, guided_json, "
                        "guided_regex, guided_choice), in automaton states, 12 bytes each (default 8192; a JSON "
                        "object of five strings of up to 20-50 characters takes ~1,500; 0 refuses them)")
    p.add_argument("--max-grammar-masks", type=int, default=None, metavar="N",
                   help="and in distinct sets of allowed tokens, vocabulary/8 bytes each (default: what 4 MiB "
                        "holds, 256-1024; that object takes ~100 at 4k tokens, ~200 at 128k)")
    p.add_argument("--max-grammar-edges", type=int, default=None, metavar="N",
                   help="and in moves that leave a state other than by its usual one, 8 bytes each (default "
                        "65536; that object takes ~13,000 at 4k tokens, ~33,000 at 128k)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="with pages, the most prompt tokens one device call prefills: a longer prompt is prefilled a "
                        "chunk a call while the running requests stream (default 64 on a CPU, 512 elsewhere)")
    flags.add_attention_arg(p)
    flags.add_mesh_args(p, "; the draft model is replicated", one_host=True)
    p.set_defaults(run=_serve, one_host="specjax serve")

    p = sub.add_parser("plan", help="before you rent a TPU or a GPU: compile the program for it here and see if it "
                                   "fits")
    p.add_argument("target", nargs="?", default=default_checkpoint("target"),
                   help="the target's folder or hub id (only config.json is read; default: the shipped target)")
    drafts = p.add_mutually_exclusive_group()
    drafts.add_argument("--draft", metavar="PATH|none", help="a draft model's folder or hub id (config.json only); default: the shipped draft with "
                             "the shipped target, none with another target")
    drafts.add_argument("--early-exit", type=int, metavar="N", help="draft with the target's own first N layers")
    p.add_argument("--topology", required=True, metavar="GEN:AxB",
                   help="the TPU slice: v4, v5e, v5p or v6e and its chips, e.g. v5e:1x1, v5e:2x4, v6e:4x4; or one "
                        "host's GPUs: h100, h200, h100x8 (needs jax's CUDA plugin, no GPU)")
    p.add_argument("--batch", type=int, default=None, help="rows decoded together (default 1)")
    p.add_argument("--prompt-len", type=int, default=None, help="the prompts' padded length (default 128)")
    p.add_argument("--max-len", type=int, default=None,
                   help="tokens per row, prompt included (default 2048, or the target's max_position_embeddings "
                        "where that is less)")
    p.add_argument("-k", "--num-draft-tokens", type=int, default=4, help="chain length K (default 4)")
    p.add_argument("--tree", metavar="SHAPE", help="a token tree instead: DEPTH,TOP_K,NODES or JSON rank paths")
    p.add_argument("--mesh", type=flags.ints(2, "--mesh", "2,4"), metavar="DATA,MODEL",
                   help="plan this (data, model) mesh only (default: every one the chips and batch allow)")
    p.add_argument("--quantize", choices=["int8"], default=None, help="int8 weight-only quantisation")
    serving = p.add_argument_group("serving (--serve): the engine's KV pages on one chip")
    serving.add_argument("--serve", action="store_true",
                         help="plan `specjax serve` instead: the tokens of KV pages that fit beside the weights and the "
                              "engine's compiled programs, and the requests they hold against --max-len slots")
    serving.add_argument("--slots", type=int, default=None, help="the engine's slots (default 8, `specjax serve`'s)")
    serving.add_argument("--page-size", type=int, default=None, help="positions per page (default 16)")
    serving.add_argument("--mean-tokens", type=int, default=None,
                         help="a request's mean prompt + output tokens, at most --max-len (default half of it)")
    serving.add_argument("--compile-limit", type=float, default=None, metavar="SECONDS",
                         help="the most seconds each of its three programs may take to compile here (default 60); "
                              "the plan names one stopped and what it leaves out")
    p.set_defaults(run=_plan)

    commands.add_commands(sub)

    args = parser.parse_args(argv)
    if getattr(args, "one_host", None):
        flags.refuse_distributed(args, args.one_host)
    elif flags.start_distributed(args):
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
