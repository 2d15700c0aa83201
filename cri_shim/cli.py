"""The `cri-shim` command: serve, config, version, images import."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from cri_shim import __version__
from cri_shim.config import (
    Config,
    ConfigError,
    apply_overrides,
    load_config,
)
from cri_shim.host.ssl_on_demand import load_ssl_on_first_use
from cri_shim.logsetup import setup_logging

# Exit statuses a service manager must not restart on: the next start fails the same way.
EXIT_CONFIG = 2
EXIT_DAMAGED_STATE = 3


def _load(args: argparse.Namespace) -> Config:
    cfg = load_config(Path(args.config) if args.config else None)
    return apply_overrides(
        cfg,
        listen=getattr(args, "listen", None),
        root=getattr(args, "root", None),
        run_root=getattr(args, "run_root", None),
        log_level=getattr(args, "log_level", None),
        log_format=getattr(args, "log_format", None),
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cri-shim", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the CRI server in the foreground")
    serve.add_argument("--config", help="TOML config file (default /etc/cri-shim/config.toml)")
    serve.add_argument("--listen", help="unix:///path of the CRI socket")
    serve.add_argument("--root", help="state root directory")
    serve.add_argument("--run-root", dest="run_root", help="runtime state directory")
    serve.add_argument("--log-level", dest="log_level", help="debug, info, warning or error")
    serve.add_argument("--log-format", dest="log_format", help="logfmt, json or text")
    config = sub.add_parser("config", help="print the effective configuration as TOML")
    config.add_argument("--config")
    config.add_argument("--listen")
    config.add_argument("--root")
    config.add_argument("--run-root", dest="run_root")
    config.add_argument("--log-level", dest="log_level")
    config.add_argument("--log-format", dest="log_format")
    config.add_argument(
        "--reference",
        action="store_true",
        help="print the reference of every key as Markdown (docs/configuration.md)",
    )
    config.add_argument(
        "--toml",
        action="store_true",
        help="with --reference: the defaults as commented TOML (contrib/config.toml)",
    )
    sub.add_parser("version", help="print the version")
    images = sub.add_parser("images", help="manage local images")
    images.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["images"]:
        from cri_shim.images.importer import main_import

        if argv[1:2] != ["import"]:
            print(
                "usage: cri-shim images import --config CONFIG PATH [--name REF]", file=sys.stderr
            )
            return 2
        return main_import(argv[2:])
    args = _parser().parse_args(argv)
    if args.command == "version":
        print(f"cri-shim {__version__} (CRI v1)")
        return 0
    if args.command == "config" and args.reference:
        from cri_shim.config.reference import config_reference_markdown, config_reference_toml

        # The reference describes the code, not a file: no config is read for it.
        sys.stdout.write(config_reference_toml() if args.toml else config_reference_markdown())
        return 0
    try:
        cfg = _load(args)
    except ConfigError as exc:
        print(f"cri-shim: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.command == "config":
        from cri_shim.config.reference import config_to_toml

        sys.stdout.write(config_to_toml(cfg))
        return 0
    setup_logging(cfg.log_level, cfg.log_format)
    try:
        # The CRI socket systemd passed is accepted on before the daemon's modules load:
        # a gRPC client waiting on it since the last daemon stopped is answered now.
        from cri_shim.transport.activation import EarlyAcceptor, activated_socket

        activated = activated_socket(cfg.socket_path)
    except ConfigError as exc:
        print(f"cri-shim: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    from cri_shim.host.sd_notify import SystemdNotifier

    systemd = SystemdNotifier()
    # A stop may come from here on, while the modules load (under socket activation the
    # start job ends below): it is kept, and carried out once the daemon can stop
    # gracefully, answering the calls it holds (daemon.serve), rather than ending the
    # process with them unanswered.
    stops: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stops.append(signum))
    acceptor = None
    if activated is not None:
        acceptor = EarlyAcceptor(*activated)
        # Answered from now on: the start job ends here rather than after the modules load
        # and the state is restored (tens of seconds on a slow machine, where a client
        # such as Kubernetes' node e2e suite waits 10 s for it). Nothing sees a
        # half-restored runtime: the calls wait in the relay until the restore is done,
        # and the status then says "serving" (daemon.py).
        systemd.ready("restoring: calls wait until the state is restored")
    # Before asyncio is imported (by what follows): OpenSSL loads with the first TLS
    # connection or image digest, not with asyncio (host/ssl_on_demand.py).
    load_ssl_on_first_use()
    import asyncio

    from cri_shim.daemon import serve
    from cri_shim.state.db import DamagedDatabase

    try:
        asyncio.run(serve(cfg, acceptor, systemd, stopped_early=lambda: bool(stops)))
    except KeyboardInterrupt:
        pass
    except ConfigError as exc:  # found only when serving, e.g. an unsafe socket directory
        print(f"cri-shim: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except DamagedDatabase as exc:
        print(f"cri-shim: {exc}", file=sys.stderr)
        return EXIT_DAMAGED_STATE
    return 0


if __name__ == "__main__":
    sys.exit(main())
