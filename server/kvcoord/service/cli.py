"""The ``kvcoord`` command: ``serve`` and ``conformance``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcoord.client import TLSOptions

__all__ = ["main"]


def _tls(args: argparse.Namespace) -> TLSOptions | None:
    """TLS options from --tls-* flags; None (plaintext) when none is given."""
    from kvcoord.client import TLSOptions

    if not (args.tls or args.tls_ca or args.tls_cert or args.tls_key or args.tls_server_name):
        return None
    return TLSOptions(
        ca_file=args.tls_ca,
        cert_file=args.tls_cert,
        key_file=args.tls_key,
        server_name_override=args.tls_server_name,
    )


def _add_tls_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("TLS (any of these turns it on)")
    group.add_argument(
        "--tls", action="store_true", help="use TLS, verifying the server with the system roots"
    )
    group.add_argument("--tls-ca", metavar="FILE", help="PEM CA certificates that verify the server")
    group.add_argument("--tls-cert", metavar="FILE", help="client certificate (PEM) for mutual TLS")
    group.add_argument("--tls-key", metavar="FILE", help="unencrypted PEM key of --tls-cert")
    group.add_argument("--tls-server-name", metavar="NAME", help="verify the server certificate for NAME")


def _conformance(args: argparse.Namespace) -> int:
    from kvcoord.conformance import LocalTarget, TraceFormatError, load_trace, replay

    target_factory = LocalTarget
    if args.target:
        from kvcoord.conformance.remote import RemoteTarget

        def target_factory() -> RemoteTarget:  # type: ignore[misc]
            return RemoteTarget(args.target, token=args.token, timeout=args.timeout, tls=tls)

    try:
        tls = _tls(args)
    except ValueError as exc:
        print(f"kvcoord conformance: {exc}", file=sys.stderr)
        return 2
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

    try:
        tls = _tls(args)
        client = KVCoordClient(args.target, timeout=args.timeout, tls=tls)
    except ValueError as exc:
        print(f"kvcoord health: {exc}", file=sys.stderr)
        return 2
    with client:
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
    _add_tls_flags(conf)
    conf.set_defaults(func=_conformance)

    health = sub.add_parser("health", help="check a server's gRPC health (exit 0 when SERVING)")
    health.add_argument("--target", default="127.0.0.1:50051", metavar="HOST:PORT")
    health.add_argument("--service", default="", help="service name (default: the whole server)")
    health.add_argument("--timeout", type=float, default=3.0)
    _add_tls_flags(health)
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
        "--start-empty",
        action="store_true",
        help=(
            "accept a lost journal (missing or empty while journal.progress names committed records): "
            "move the evidence aside, start empty and hand out no block for max_session_lease_seconds"
        ),
    )
    serve.add_argument(
        "--restored",
        action="store_true",
        help=(
            "the data directory was restored from a copy (a volume snapshot, cp -a): end every "
            "session and fence it holds, empty the prefix caches and hand out no block for "
            "max_session_lease_seconds (a grace that survives restarts)"
        ),
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
