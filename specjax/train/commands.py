"""The training commands of `specjax`: train (a target from scratch), distill (a draft),
train-medusa, train-eagle and train-mtp (draft heads on a frozen target) and export (a run's latest
checkpoint as a Hugging Face folder): their flags and what they run. cli.py registers them
(`add_commands`); this module knows nothing of generate, bench or datastores.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from specjax import flags


def add_commands(sub):
    """Registers train, distill, train-medusa, train-eagle, train-mtp and export on the command's subparsers."""
    p = sub.add_parser("train", help="train a Llama-family target from scratch on the stdlib")
    _add_train_args(p, steps=1000, lr=1.5e-3)
    flags.add_mesh_args(p)
    _add_model_args(p, hidden=384, layers=6, heads=6, kv_heads=2, intermediate=1024)
    p.add_argument("--vocab", type=int, default=4096, help="byte-level BPE vocabulary size")
    p.set_defaults(run=_train)

    p = sub.add_parser("distill", help="distill a small draft from a target folder")
    p.add_argument("--target", default="checkpoints/target",
                   help="the teacher: the target's folder, with its tokenizer (default: checkpoints/target)")
    _add_train_args(p, steps=1000, lr=3e-3)
    flags.add_mesh_args(p)
    _add_model_args(p, hidden=128, layers=2, heads=2, kv_heads=1, intermediate=384)
    _add_loss_args(p)
    p.add_argument("--ce-weight", type=float, default=0.0,
                   help="weight of a cross-entropy loss on the corpus' next tokens, added to the distillation "
                        "loss (default 0)")
    p.add_argument("--on-policy", type=int, default=0, metavar="N",
                   help="also train on N continuations of training windows written by the target (batches of 64, "
                        "greedy and temperature 1 in turn); 0: the corpus only")
    p.add_argument("--on-policy-repeat", type=int, default=4, metavar="R",
                   help="copies of those continuations in the training stream (their share of the windows)")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="also save the training text's N most frequent tokens beside the export (draft_vocab.json): "
                        "the draft then proposes only those, through their head columns alone")
    p.set_defaults(run=_distill)

    for kind in ("medusa", "eagle"):
        p = sub.add_parser(f"train-{kind}", help=f"train {kind.capitalize()} draft heads on a frozen target "
                                                 f"(self-distillation on the stdlib)")
        p.add_argument("--target", default="checkpoints/target",
                       help="the frozen target's folder, with its tokenizer (default: checkpoints/target)")
        if kind == "medusa":
            _add_train_args(p, steps=1000, lr=1e-3)
        else:  # EAGLE-3's steps each unroll --ttt-steps drafting steps: its recipe takes fewer, larger ones
            _add_train_args(p, steps=None, lr=None, defaults="(default: 1000, or 500 with --eagle3)",
                            lr_defaults="(default: 1e-3, or 1.5e-3 with --eagle3)")
        _add_loss_args(p)
        p.add_argument("--probe-prompts", type=int, default=4,
                       help="held-out prompts on which each evaluation runs the real loop")
        flags.add_mesh_args(p, "; the heads are replicated")
        if kind == "medusa":
            p.add_argument("--heads", type=int, default=4, help="number of heads (the deepest draft)")
            p.add_argument("--head-layers", type=int, default=1, help="residual blocks per head")
        else:
            p.add_argument("--eagle3", action="store_true",
                           help="EAGLE-3: features of three target layers, trained over unrolled drafting steps")
            p.add_argument("--ttt-steps", type=int, default=4, help="EAGLE-3: drafting steps unrolled in training")
            p.add_argument("--feature-layers", type=flags.ints(None, "--feature-layers", "1,3,5"), default=None,
                           metavar="I,J,K", help="EAGLE-3: the target layers (1..L) whose outputs it reads "
                                                 "(default: low, middle, high)")
            p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                           help="EAGLE-3: draft only the corpus' N most frequent tokens, through a head of its "
                                "own (default: the target's whole vocabulary)")
            p.add_argument("--published", action="store_true",
                           help="EAGLE-3: the published architecture (EAGLE's, SpecForge's, speculators'), saved "
                                "in speculators' format, which vLLM serves; --feature-layers then 1..L-1 "
                                "(hidden_states indices, the inputs of those layers)")
        p.set_defaults(run=_train_heads, kind=kind)

    p = sub.add_parser("train-mtp", help="train a multi-token-prediction layer for a frozen target that ships none, "
                                         "written beside a copy of it as DeepSeek-V3 ships one")
    p.add_argument("--target", default="checkpoints/target",
                   help="the frozen target's folder, with its tokenizer (default: checkpoints/target)")
    _add_train_args(p, steps=1000, lr=1e-3)
    _add_loss_args(p)
    p.add_argument("--probe-prompts", type=int, default=4,
                   help="held-out prompts on which each evaluation runs the real loop")
    p.add_argument("--on-policy", type=int, default=0, metavar="N",
                   help="also train on N continuations of training windows written by the target (batches of 64, "
                        "greedy and temperature 1 in turn); 0: the corpus only")
    p.add_argument("--on-policy-repeat", type=int, default=4, metavar="R",
                   help="copies of those continuations in the training stream (their share of the windows)")
    p.add_argument("--random-init", action="store_true",
                   help="start the layer's decoder block from random weights (default: a copy of the target's last "
                        "layer, where that is of the block's kind, dense or experts)")
    flags.add_mesh_args(p, "; the layer is replicated")
    p.set_defaults(run=_train_mtp)

    p = sub.add_parser("export", help="write a run's latest checkpoint as a Hugging Face folder")
    p.add_argument("run_dir", metavar="RUN", help="the run directory (a train, distill or train-* --out)")
    p.add_argument("out", help="the Hugging Face folder to write")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="storage dtype of the weights (default bfloat16)")
    p.set_defaults(run=_export_run)


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

    mesh = flags.mesh(args)
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

    mesh = flags.mesh(args)
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
    from specjax.train import data, heads

    if args.kind == "eagle":
        for flag, value in (("--draft-vocab", args.draft_vocab is not None), ("--published", args.published)):
            if value and not args.eagle3:
                raise ValueError(f"{flag} is EAGLE-3's: pass --eagle3 with it")
        if args.steps is None:
            args.steps = 500 if args.eagle3 else 1000
        if args.lr is None:
            args.lr = 1.5e-3 if args.eagle3 else 1e-3
    mesh = flags.mesh(args)
    target = specjax.load_model(args.target, dtype=jnp.float32, mesh=mesh)
    if getattr(args, "draft_vocab", None) is not None:  # refused before the corpus is prepared
        vocab.check_vocab_size(args.draft_vocab, target.config.vocab_size)
    tokenizer, stream, held, held_modules = _in_turn(lambda: data.prepare(args.out, tokenizer_folder=args.target))
    probe = np.array(data.held_out_prompts(tokenizer, args.probe_prompts, 64, seed=1), np.int32)
    common = dict(record={"held_out_modules": held_modules, "target": str(args.target)}, probe_prompts=probe,
                  mesh=mesh)
    if args.kind == "medusa":
        drafter, metrics = heads.train_medusa(target, args.heads, stream, held, _train_config(args), args.out,
                                              num_layers=args.head_layers, **common)
    elif args.eagle3:
        drafter, metrics = heads.train_eagle3(target, stream, held, _train_config(args), args.out,
                                              steps=args.ttt_steps, feature_layers=args.feature_layers,
                                              draft_vocab=args.draft_vocab, published=args.published, **common)
    else:
        drafter, metrics = heads.train_eagle(target, stream, held, _train_config(args), args.out, **common)
    drafter = drafter.replace(params=specjax.gather(drafter.params))  # whole in every process
    if jax.process_index() == 0:  # one process writes
        out = drafter.replace(signature=dataclasses.replace(drafter.signature, name=str(args.target))).save(
            Path(args.out) / "drafter")
        print(f"saved to {out}; last evaluation: {json.dumps(metrics)}")


def _train_mtp(args):
    """train-mtp: the layer trained on the frozen target, then `RUN/hf`: a copy of the target's
    folder with the layer written into it (`Mtp.save`), which `load_drafter` reads back."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import specjax
    from specjax.folders import resolve
    from specjax.train import data, heads

    mesh = flags.mesh(args)
    target = specjax.load_model(args.target, dtype=jnp.float32, mesh=mesh)
    tokenizer, stream, held, held_modules = _in_turn(lambda: data.prepare(args.out, tokenizer_folder=args.target))
    if args.on_policy:
        stream = _with_continuations(args, target, tokenizer, stream, mesh)
    probe = np.array(data.held_out_prompts(tokenizer, args.probe_prompts, 64, seed=1), np.int32)
    drafter, metrics = heads.train_mtp(target, stream, held, _train_config(args), args.out,
                                       record={"held_out_modules": held_modules, "target": str(args.target)},
                                       probe_prompts=probe, mesh=mesh, from_last_layer=not args.random_init)
    drafter = drafter.replace(params=specjax.gather(drafter.params))  # whole in every process
    if jax.process_index() == 0:  # one process writes
        out = Path(args.out) / "hf"
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(resolve(args.target), out)  # (a hub cache's links copied as files)
        drafter.save(out)
        print(f"saved the target with its MTP layer to {out}; last evaluation: {json.dumps(metrics)}")


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
    """The new model's shape (a Llama with a tied head)."""
    p.add_argument("--hidden", type=int, default=hidden, help=f"hidden size (default {hidden})")
    p.add_argument("--layers", type=int, default=layers, help=f"decoder layers (default {layers})")
    p.add_argument("--heads", type=int, default=heads, help=f"attention heads (default {heads})")
    p.add_argument("--kv-heads", type=int, default=kv_heads, help=f"key/value heads (default {kv_heads})")
    p.add_argument("--intermediate", type=int, default=intermediate, help=f"MLP width (default {intermediate})")
    p.add_argument("--max-positions", type=int, default=1024, help="max_position_embeddings (default 1024)")
    p.add_argument("--init-seed", type=int, default=0, help="seed of the initial weights (default 0)")


def _add_loss_args(p):
    p.add_argument("--loss", default="kl", choices=["kl", "tv"],
                   help="kl: forward KL(p || q) from the target's distribution p; tv: the total variation "
                        "distance, exactly 1 - the acceptance rate (default kl)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="the temperature at which both distributions are compared (default 1)")


def _add_train_args(p, steps, lr, defaults=None, lr_defaults=None):
    p.add_argument("--out", required=True, help="run directory (checkpoints, data, export)")
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps " + (defaults or f"(default {steps})"))
    p.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--lr", type=float, default=lr, help="peak learning rate " + (lr_defaults or f"(default {lr})"))
    p.add_argument("--warmup", type=int, default=50, help="learning-rate warmup steps (default 50)")
    p.add_argument("--seed", type=int, default=0, help="data order")
    p.add_argument("--eval-every", type=int, default=100, help="steps between held-out evaluations (default 100)")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints (default 50)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="storage dtype of the exported Hugging Face folder")
