"""ServerConfig: everything ``engine serve`` needs, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import EngineConfig

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
DEFAULT_REQUEST_BODIES = 256 << 20
SPARE_CONNECTIONS = 64  # connections open beyond the requests held (health checks, metrics)


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    # requests that may wait for a slot beyond the max_num_seqs that run at once; more: 503
    max_pending: int = 256
    log_level: str = "info"
    max_request_body: int = 8 << 20  # bytes; a larger request body gets HTTP 413
    # bytes of the bodies of all requests being handled at once; a request past it gets 503
    # (None: 256 MiB, or max_request_body if that is larger)
    max_request_bodies: int | None = None
    # seconds a request's whole body may take to arrive; a slower one gets HTTP 408 (and
    # a connection whose request head has not arrived whole by then is closed)
    request_body_timeout: float = 60.0
    # seconds a stopping server (SIGTERM, SIGINT) gives the requests in flight to finish
    graceful_shutdown_timeout: float = 5.0
    lmkv_config_file: str | None = None  # LMKV_CONFIG_FILE, read at startup

    def __post_init__(self) -> None:
        _check(bool(self.host), "host", "non-empty")
        _check(0 <= self.port <= 65535, "port", "in [0, 65535]")
        _check(self.max_pending >= 0, "max_pending", ">= 0")
        _check(self.max_request_body >= 1024, "max_request_body", ">= 1KiB")
        _check(self.max_request_bodies is None or self.max_request_bodies >= self.max_request_body,
               "max_request_bodies", f">= max_request_body ({self.max_request_body} bytes)")
        _check(self.request_body_timeout > 0, "request_body_timeout", "> 0 seconds")
        _check(self.graceful_shutdown_timeout >= 1, "graceful_shutdown_timeout", ">= 1 second")
        _check(self.log_level in LOG_LEVELS, "log_level", f"one of {', '.join(LOG_LEVELS)}")

    @property
    def request_bodies_budget(self) -> int:
        """Bytes of request bodies handled at once."""
        if self.max_request_bodies is None:
            return max(DEFAULT_REQUEST_BODIES, self.max_request_body)
        return self.max_request_bodies

    @property
    def max_in_flight(self) -> int:
        """Requests the server holds at once (running, waiting, or being handed over)."""
        return self.engine.max_num_seqs + self.max_pending

    @property
    def max_connections(self) -> int:
        """Connections open at once: one per request held, and SPARE_CONNECTIONS (a request
        past max_in_flight is answered 503 anyway); more are closed as they are accepted."""
        return self.max_in_flight + SPARE_CONNECTIONS


def _check(ok: bool, name: str, want: str) -> None:
    if not ok:
        raise ValueError(f"invalid server setting {name} (--{name.replace('_', '-')}): "
                         f"must be {want}")
