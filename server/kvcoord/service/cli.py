"""The ``kvcoord`` command: ``serve`` and ``conformance``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _conformance(args: argparse.Namespace) -> int:
    from kvcoord.conformance import LocalTarget, TraceFormatError, load_trace, replay

    target_factory = LocalTarget
    if args.target:
        from kvcoord.conformance.remote import RemoteTarget

        def target_factory() -> RemoteTarget:  # type: ignore[misc]
            return RemoteTarget(args.target, token=args.token, timeout=args.timeout)

    passed = failed = 0
    for path in args.files:
        try:
            trace = load_trace(path)
        except (OSError, TraceFormatError) as exc:
            print(f"FAIL {path}: cannot read trace: {exc}", flush=True)
            failed += 1
            continue
        result = replay(trace, target_factory())
        if result.passed:
            passed += 1
            print(f"PASS {trace.name} ({result.ops} ops)", flush=True)
        else:
            failed += 1
            print(f"FAIL {trace.name}: {result.mismatch}", flush=True)
    print(f"{passed} passed, {failed} failed", flush=True)
    return 0 if failed == 0 and passed > 0 else 1


def _serve(args: argparse.Namespace) -> int:
    from kvcoord.service.main import serve_from_cli

    return serve_from_cli(args)


def _health(args: argparse.Namespace) -> int:
    from kvcoord.client import KVCoordClient, KVCoordError

    with KVCoordClient(args.target, timeout=args.timeout) as client:
        try:
            status = client.health(args.service)
        except KVCoordError as exc:
            print(f"kvcoord health: {exc}", file=sys.stderr)
            return 1
    print(status)
    return 0 if status == "SERVING" else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcoord", description="Remote KV-cache block allocator.")
    sub = parser.add_subparsers(dest="command", required=True)

    conf = sub.add_parser(
        "conformance",
        help="replay vLLM conformance traces and compare every answer",
        description=(
            "Replay trace files against a fresh pool each (in-process by default, or a "
            "server with --target) and print one line per trace and a closing "
            "'N passed, M failed' line. Exits 1 on any failure."
        ),
    )
    conf.add_argument("files", nargs="+", metavar="FILE", help="trace files (.jsonl)")
    conf.add_argument("--target", metavar="HOST:PORT", help="replay through the gRPC client against a server")
    conf.add_argument("--token", help="bearer token for the server, if it requires one")
    conf.add_argument("--timeout", type=float, default=10.0, help="deadline per RPC in seconds (default 10)")
    conf.set_defaults(func=_conformance)

    health = sub.add_parser("health", help="check a server's gRPC health (exit 0 when SERVING)")
    health.add_argument("--target", default="127.0.0.1:50051", metavar="HOST:PORT")
    health.add_argument("--service", default="", help="service name (default: the whole server)")
    health.add_argument("--timeout", type=float, default=3.0)
    health.set_defaults(func=_health)

    serve = sub.add_parser("serve", help="run the kvcoord gRPC server")
    serve.add_argument("--config", metavar="FILE", help="TOML config file (default: the embedded default)")
    serve.add_argument(
        "--listen", action="append", metavar="ADDR", help="override listeners (host:port or unix:/path)"
    )
    serve.add_argument(
        "--metrics-listen", metavar="HOST:PORT", help="override the Prometheus /metrics address ('' disables)"
    )
    serve.add_argument(
        "--print-default-config", action="store_true", help="print the embedded default config and exit"
    )
    serve.set_defaults(func=_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvcoord`` console script."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
