"""Flags and argparse types that several `specjax` commands share: comma-separated ints,
the device mesh, and joining a jax.distributed job. It knows nothing of what any command
runs."""

from __future__ import annotations

import argparse


def ints(count: int | None, flag: str, example: str):
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


def mesh(args):
    """The (data, model) mesh of --mesh over every process's devices, or None."""
    if args.mesh is None:
        return None
    import specjax

    data, model = args.mesh
    return specjax.make_mesh(data=data, model=model)


def add_mesh_args(p, more: str = "", one_host: bool = False):
    """--mesh, and the flags of a job of several processes (one_host: taken, to be refused
    by `refuse_distributed` in one line, but not listed in --help)."""
    p.add_argument("--mesh", type=ints(2, "--mesh", "2,4"), metavar="DATA,MODEL",
                   help="shard the model over a (data, model) mesh of " + ("this host's devices" if one_host else
                        "every process's devices") + " (rows over data, heads over model)" + more)
    add_distributed_args(p, hidden=one_host)


def add_attention_arg(p):
    p.add_argument("--attention", choices=["auto", "portable", "kernels"], default="auto",
                   help="auto (default): the platform's fused attention kernels where they have been measured "
                        "(a GPU, in bfloat16), jnp elsewhere; kernels: the kernels wherever they apply (Pallas "
                        "prefix kernels, cuDNN, splash; the TPU's not yet run on a TPU); portable: jnp on every "
                        "backend")


def add_distributed_args(p, hidden: bool = False):
    def shown(text: str) -> str:
        return argparse.SUPPRESS if hidden else text

    p.add_argument("--coordinator", metavar="HOST:PORT",
                   help=shown("join a jax.distributed job of several processes (one per host) at this coordinator; "
                              "with --num-processes and --process-id (on TPU pods and SLURM, --distributed finds all "
                              "three)"))
    p.add_argument("--num-processes", type=int, metavar="N", help=shown("the job's processes (with --coordinator)"))
    p.add_argument("--process-id", type=int, metavar="I",
                   help=shown("this process's index in the job, 0..N-1 (with --coordinator)"))
    p.add_argument("--distributed", action="store_true",
                   help=shown("jax.distributed.initialize() with JAX's own detection of the job (TPU pods, SLURM)"))


def start_distributed(args) -> bool:
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


def refuse_distributed(args, command: str):
    """Raises (one line) when the flags of a jax.distributed job are given to a command that
    runs on one host."""
    given = [f"--{name.replace('_', '-')}" for name in ("coordinator", "num_processes", "process_id", "distributed")
             if getattr(args, name, None) not in (None, False)]
    if given:
        raise ValueError(f"{command} runs on one host; several hosts ({', '.join(given)}) are not supported yet")
