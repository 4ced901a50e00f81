"""The `specjax` command. It parses arguments and calls the public API; no logic of its own."""

from __future__ import annotations

import argparse
import json
import sys


def _info(args):
    import specjax

    model = specjax.load_model(args.path)
    c = model.config
    print(json.dumps({"model_type": c.model_type, "params": c.num_params(), "dtype": str(model.dtype),
                      "layers": c.num_layers, "hidden": c.hidden_size, "heads": c.num_heads,
                      "kv_heads": c.num_kv_heads, "vocab": c.vocab_size}, indent=2))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="specjax", description="Speculative decoding in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="describe a Hugging Face checkpoint folder")
    info.add_argument("path")
    info.set_defaults(run=_info)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
