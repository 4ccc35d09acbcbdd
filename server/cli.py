"""``lmkv_server HOST PORT [options]``: parse flags into a ServerConfig and serve."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from lmkv.policy import POLICIES
from lmkv.sizes import size

from .app import ListenError, run
from .config import ServerConfig, parse_networks

_DEFAULTS = ServerConfig()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmkv_server",
        description="KV-cache server speaking LMCache's lm:// protocol, with bounded memory.",
    )
    p.add_argument("host", help="address to bind (non-loopback: no auth, see docs/server.md)")
    p.add_argument("port", type=int)
    p.add_argument(
        "--max-memory",
        type=size,
        default=_DEFAULTS.max_memory,
        help="bound on stored values, e.g. 16GiB, 512MB (default 1GiB, touched at start: see "
        "--no-prefault); eviction by --cache-policy beyond",
    )
    p.add_argument(
        "--cache-policy",
        choices=list(POLICIES),
        default=_DEFAULTS.cache_policy,
        help=f"what is evicted beyond --max-memory (default {_DEFAULTS.cache_policy}; "
        "docs/operations.md)",
    )
    p.add_argument(
        "--max-value-size",
        type=size,
        default=_DEFAULTS.max_value_size,
        help="largest PUT accepted; larger frames close the connection (default 256MiB)",
    )
    p.add_argument(
        "--page-size", type=size, default=_DEFAULTS.page_size, help="default 256KiB"
    )
    p.add_argument(
        "--no-prefault",
        dest="prefault",
        action="store_false",
        help="do not touch all of --max-memory at start (faster start, slower first fill)",
    )
    p.add_argument("--persist-dir", type=Path, help="mirror values here; reload on start")
    p.add_argument("--admin-port", type=int, help="serve /health, /metrics, /stats here")
    p.add_argument(
        "--io-timeout",
        type=float,
        default=_DEFAULTS.io_timeout,
        help="seconds a started frame may take (default 30)",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=_DEFAULTS.idle_timeout,
        help="close a connection with no request for this many seconds (default 0: never; "
        "TCP keepalive finds dead clients either way)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=_DEFAULTS.max_connections,
        help="open connections (one thread each) before new ones are refused (default 1024)",
    )
    p.add_argument(
        "--allow",
        type=_networks,
        default=(),
        help="comma-separated client addresses/networks allowed to connect, "
        "e.g. 10.0.0.0/8,192.168.1.7 (default: any)",
    )
    p.add_argument("--log-level", default=_DEFAULTS.log_level, help="DEBUG, INFO, WARNING...")
    return p


def _networks(text: str):
    try:
        return parse_networks(text)
    except ValueError as e:  # (argparse would say only "invalid value")
        raise argparse.ArgumentTypeError(str(e)) from e


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = ServerConfig(
            host=args.host,
            port=args.port,
            max_memory=args.max_memory,
            max_value_size=args.max_value_size,
            page_size=args.page_size,
            prefault=args.prefault,
            persist_dir=args.persist_dir,
            admin_port=args.admin_port,
            io_timeout=args.io_timeout,
            idle_timeout=args.idle_timeout,
            max_connections=args.max_connections,
            allow=args.allow,
            log_level=args.log_level.upper(),
            cache_policy=args.cache_policy,
        )
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        run(config)
    except ListenError as e:
        print(f"lmkv_server: error: {e}", file=sys.stderr)
        return 1
    return 0
