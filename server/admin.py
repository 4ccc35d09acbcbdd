"""The admin HTTP app: /health, /metrics (Prometheus text), /stats (JSON)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from .config import ServerConfig
from .persistence import Persister
from .protocol import Traffic
from .store import Store


def build_admin_app(
    config: ServerConfig,
    store: Store,
    traffic: Callable[[], Traffic],
    persister: Persister | None,
    registry: CollectorRegistry,
) -> FastAPI:
    app = FastAPI(title="lmkv_server admin", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        body: dict[str, Any] = dataclasses.asdict(store.stats())
        body["max_value_size"] = config.max_value_size
        body["traffic"] = dataclasses.asdict(traffic())
        if persister is not None:
            body["persist"] = {
                "directory": str(persister.directory),
                "pending": persister.pending,
                "files_written": persister.files_written,
                "files_deleted": persister.files_deleted,
                "errors": persister.errors,
            }
        return body

    return app
