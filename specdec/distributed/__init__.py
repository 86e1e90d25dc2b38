"""specdec on Ray: batch generation over engine actors (`generate --ray`) and replicated
serving on Ray Serve (`serve --ray`).

Ray is an optional extra (`pip install -e ".[ray]"`); nothing here imports it at module level,
so the CLI can parse `--ray` and say how to install Ray when it is missing. This package only
fans work out and gathers it: decoding is the engine's, HTTP is `server.app.create_app`'s.
"""

from __future__ import annotations

import os

from ..types import SpecdecError

RAY_INSTALL = 'pip install -e ".[ray]"  (or: pip install "ray[serve]==2.60.0")'


def require_ray():
    """The `ray` module, or one clear error that says how to install it."""
    try:
        import ray
    except ImportError:
        raise SpecdecError(f"--ray needs Ray, which is not installed: {RAY_INSTALL}") from None
    return ray


def add_cluster_args(group) -> None:
    """--ray, --replicas, --address: shared by `generate` and `serve`."""
    from ..argtypes import positive_int

    group.add_argument("--ray", action="store_true",
                       help=f"run on Ray (needs the ray extra: {RAY_INSTALL})")
    group.add_argument("--replicas", type=positive_int, default=None, metavar="N",
                       help="--ray: engines to run, each with --threads threads (default 1). "
                            "Default: the cluster's CPUs divided by --threads")
    group.add_argument("--address", default=None, metavar="ADDR",
                       help="--ray: a running Ray cluster (`ray start --head` prints it; 'auto' finds a local one). "
                            "Default: start a local Ray instance for this run")


def check_cluster_flags(args) -> None:
    """One error for a Ray-only flag given without --ray."""
    if args.ray:
        return
    given = [f for f, v in (("--replicas", args.replicas), ("--address", args.address),
                            ("--out", getattr(args, "out", None) if args.command == "generate" else None), ("--min-replicas", getattr(args, "min_replicas", None)),
                            ("--max-replicas", getattr(args, "max_replicas", None)),
                            ("--target-ongoing", getattr(args, "target_ongoing", None))) if v is not None]
    if given:
        raise SpecdecError(f"{', '.join(given)} only {'applies' if len(given) == 1 else 'apply'} with --ray")


def start_ray(address: str | None, quiet: bool = False) -> bool:
    """Connect to the cluster at `address`, or start a local Ray instance sized to this
    machine (its CPUs, a 512 MiB object store, no dashboard). Returns whether this call
    started (and so must stop) Ray; a caller that already initialised Ray keeps its own."""
    ray = require_ray()
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import logging

    common = dict(logging_level=logging.WARNING, log_to_driver=not quiet)
    if not address:
        ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, object_store_memory=512 * 1024 * 1024,
                 **common)
        return True
    check_reachable(address)
    try:
        ray.init(address=address, **common)
    except (ConnectionError, RuntimeError, TimeoutError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SpecdecError(f"could not join the Ray cluster at --address {address}: {first} (is `ray start --head` "
                           "running there, and is this its address?)") from None
    return True


def check_reachable(address: str) -> None:
    """For a HOST:PORT address, a TCP connection within 5 s, else one clear error (Ray itself
    would retry an unreachable head for minutes). 'auto' and ray:// addresses go to Ray as given."""
    import socket

    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
    except OSError as e:
        raise SpecdecError(f"could not reach the Ray cluster at --address {address} ({e.strerror or e}); is "
                           "`ray start --head` running there, and is this the address it printed?") from None


def engine_threads(args) -> int:
    """Torch threads per engine actor or replica: --threads, else 1 (replicas on one node
    would otherwise each start one thread per core and fight over them)."""
    return args.threads or 1


def replica_count(args, ray) -> int:
    """--replicas, else as many engines as the cluster's CPUs hold at --threads each."""
    if args.replicas:
        return args.replicas
    cpus = int(ray.cluster_resources().get("CPU", 1))
    return max(1, cpus // engine_threads(args))


def add_generate_ray_args(parser) -> None:
    """`generate`'s Ray options (one argument group)."""
    g = parser.add_argument_group("Ray (batch generation over engine actors)")
    add_cluster_args(g)
    g.add_argument("--out", metavar="DIR", default=None,
                   help="--ray: write the results here (DIR/results.jsonl, one object per prompt as --json prints "
                        "them; a part file per finished batch, so a rerun of the same command resumes)")


def add_train_ray_args(parser) -> None:
    """`train draft|eagle`'s Ray options: the target answers the training prompts on actors."""
    g = parser.add_argument_group("Ray (the target answers the training prompts on engine actors)")
    add_cluster_args(g)


def add_serve_ray_args(parser) -> None:
    """`serve`'s Ray options (one argument group): a fixed --replicas N, or autoscaling between
    --min-replicas and --max-replicas on the requests in flight per replica."""
    from ..argtypes import positive_int

    g = parser.add_argument_group("Ray Serve (replicas, each with its own engine and batcher)")
    add_cluster_args(g)
    g.add_argument("--max-replicas", type=positive_int, default=None, metavar="N",
                   help="--ray: autoscale on queue depth, up to N replicas (instead of a fixed --replicas)")
    g.add_argument("--min-replicas", type=positive_int, default=None, metavar="N",
                   help="--ray with --max-replicas: replicas kept however idle. Default: 1")
    g.add_argument("--target-ongoing", type=positive_int, default=None, metavar="R",
                   help="--ray with --max-replicas: requests in flight (running + queued) per replica that "
                        "autoscaling aims at; more add replicas, fewer remove them. Default: --max-batch")


def autoscaling(args) -> dict | None:
    """Ray Serve's autoscaling_config from --min-replicas/--max-replicas/--target-ongoing, or None
    for a fixed number of replicas; one error for flags that do not fit together."""
    lo, hi, target = (getattr(args, k, None) for k in ("min_replicas", "max_replicas", "target_ongoing"))
    if hi is None:
        if lo is not None or target is not None:
            raise SpecdecError("--min-replicas and --target-ongoing tune autoscaling: give --max-replicas N too")
        return None
    if args.replicas is not None:
        raise SpecdecError("give a fixed --replicas N or autoscaling with --max-replicas N, not both")
    lo = 1 if lo is None else lo
    if lo > hi:
        raise SpecdecError(f"--min-replicas {lo} is more than --max-replicas {hi}")
    return {"min_replicas": lo, "initial_replicas": lo, "max_replicas": hi,
            "target_ongoing_requests": target or args.max_batch}


def wants_ray(args) -> bool:
    """Whether the command runs on Ray; refuses Ray-only flags without --ray."""
    check_cluster_flags(args)
    return bool(args.ray)
