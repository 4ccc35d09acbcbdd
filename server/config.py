"""ServerConfig: every setting of lmkv_server, validated once."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from lmkv.backends.lm_socket import MIN_TIMEOUT
from lmkv.backends.lm_wire import MAX_LENGTH
from lmkv.policy import DEFAULT_POLICY, POLICIES

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
_IPV4_MAPPED = ipaddress.ip_network("::ffff:0:0/96")


def parse_networks(text: str) -> tuple[IPNetwork, ...]:
    """``"10.0.0.0/8,192.168.1.7"`` -> networks; raises ValueError on a bad entry or on
    none at all (an empty list would let anyone in: ``--allow "$NETS"`` with NETS unset).
    IPv4-mapped IPv6 entries (::ffff:a.b.c.d) become the IPv4 networks they name, as the
    peers' addresses do."""
    networks = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            network = ipaddress.ip_network(item, strict=False)
        except ValueError as exc:
            raise ValueError(f"not an address or network: {item!r}") from exc
        if network.version == 6 and network.subnet_of(_IPV4_MAPPED):
            network = ipaddress.ip_network(
                (network.network_address.ipv4_mapped, network.prefixlen - 96))
        networks.append(network)
    if not networks:
        raise ValueError(f"names no address or network: {text!r}")
    return tuple(networks)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# timeouts are kernel timevals and deadlines: finite, at least MIN_TIMEOUT (1 ms)
MAX_TIMEOUT = 7 * 86400.0
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_LEVEL_ALIASES = {"WARN": "WARNING", "FATAL": "CRITICAL"}  # logging's other spellings


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 65432
    # Bound on stored values (whole pages, see page_size); the process adds ~100 MB of
    # Python, per-entry index overhead and one in-flight frame per connection.
    max_memory: int = 1 * GIB  # a laptop-sized first run; production servers set --max-memory
    # Largest payload one PUT may announce; larger frames close that connection.
    max_value_size: int = 256 * MIB
    # Values are stored in pages of this size: a value wastes < one page.
    page_size: int = 256 * KIB
    # Touch all of max_memory at start, so that stores run at memcpy speed from the first
    # byte instead of at page-fault speed.
    prefault: bool = True
    persist_dir: Path | None = None
    admin_port: int | None = None
    # A started frame (header or PUT payload) must complete within this many seconds.
    io_timeout: float = 30.0
    # A connection with no request for this many seconds is closed; 0: never. Off by
    # default: engines hold idle connections between requests and LMCache's client does
    # not reconnect. TCP keepalive finds dead peers either way (docs/server.md).
    idle_timeout: float = 0.0
    # Open client connections (one thread each); more are refused at accept.
    max_connections: int = 1024
    # Client networks allowed to connect (empty: anyone who can reach the port). The
    # protocol itself has no authentication; this is address-based access control.
    allow: tuple[IPNetwork, ...] = ()
    log_level: str = "INFO"
    # What is evicted beyond max_memory: a name in lmkv.policy.POLICIES (every key a root:
    # the protocol carries no prefix parents).
    cache_policy: str = DEFAULT_POLICY

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must not be empty")
        for name in ("port", "admin_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{_flag(name)} {port} outside [0, 65535]")
        if not 4 * KIB <= self.page_size <= 64 * MIB or self.page_size % (4 * KIB):
            raise ValueError("--page-size must be a multiple of 4KiB in [4KiB, 64MiB]")
        if self.max_memory < self.page_size:
            raise ValueError(f"--max-memory {self.max_memory} is below one page "
                             f"(--page-size {self.page_size})")
        if not 0 < self.max_value_size <= MAX_LENGTH:
            raise ValueError(f"--max-value-size must be in (0, {MAX_LENGTH}] (int32 length)")
        if self.max_connections < 1:
            raise ValueError("--max-connections must be at least 1")
        if not MIN_TIMEOUT <= self.io_timeout <= MAX_TIMEOUT:  # (NaN fails too)
            raise ValueError(f"--io-timeout must be in [{MIN_TIMEOUT}, {MAX_TIMEOUT:.0f}] seconds, "
                             f"got {self.io_timeout}")
        if not (self.idle_timeout == 0 or MIN_TIMEOUT <= self.idle_timeout <= MAX_TIMEOUT):
            raise ValueError(f"--idle-timeout must be 0 (never) or in [{MIN_TIMEOUT}, "
                             f"{MAX_TIMEOUT:.0f}] seconds, got {self.idle_timeout}")
        if self.cache_policy not in POLICIES:
            raise ValueError(f"--cache-policy must be one of {', '.join(POLICIES)}, "
                             f"got {self.cache_policy!r}")
        level = _LEVEL_ALIASES.get(self.log_level.upper(), self.log_level.upper())
        if level not in LOG_LEVELS:
            raise ValueError(f"unknown --log-level {self.log_level!r} (one of {', '.join(LOG_LEVELS)})")
        object.__setattr__(self, "log_level", level)  # as uvicorn names it too

    @property
    def num_pages(self) -> int:
        return self.max_memory // self.page_size

    @property
    def loopback_only(self) -> bool:
        return is_loopback(self.host)

    def allows(self, address: str) -> bool:
        """Whether a client at ``address`` may connect."""
        if not self.allow:
            return True
        try:
            ip = ipaddress.ip_address(address.split("%", 1)[0])
        except ValueError:
            return False
        if ip.version == 6 and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip in network for network in self.allow)


def _flag(name: str) -> str:
    """How the command line names a setting: port is positional, the others --flags."""
    return name if name == "port" else "--" + name.replace("_", "-")
