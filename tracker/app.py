"""The HTTP side of the tracker: JSON API, status page, Prometheus metrics.

Handlers only read the monitor's last snapshot and the history store, so they are fast and
cannot be blocked by the DHT. Everything peers publish is untrusted: the page is rendered
with Jinja autoescaping, the script writes data with `textContent` only, and a strict
Content-Security-Policy forbids inline scripts as a second line of defence.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, FileSystemLoader, select_autoescape

from swarm.records import SOFTWARE_VERSION
from tracker import metrics
from tracker.service import SwarmMonitor

logger = logging.getLogger("tracker")

HERE = Path(__file__).resolve().parent
MAX_HISTORY_POINTS = 2000
DEFAULT_HISTORY_POINTS = 300
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


def _templates() -> Environment:
    return Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(default=True))


def human_bytes(n: float | None) -> str:
    if n is None:
        return "–"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"  # pragma: no cover


def create_app(monitor: SwarmMonitor) -> FastAPI:
    """One app per monitor; the CLI wires it to a DHT, tests may wire it to fixed records."""
    manifest = monitor.manifest
    manifest_json = manifest.model_dump(mode="json")
    env = _templates()
    env.filters["bytes"] = human_bytes
    registry = metrics.make_registry(monitor.snapshot, lambda: _stats(monitor))
    app = FastAPI(
        title="protocol-swarm tracker",
        version=SOFTWARE_VERSION,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.monitor = monitor
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    @app.middleware("http")
    async def security_headers(request: Request, call_next):
        response = await call_next(request)
        for name, value in SECURITY_HEADERS.items():
            response.headers.setdefault(name, value)
        return response

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # a bug must not turn into a 500 with a traceback; say it is temporary and log one line
        logger.error("error serving %s: %s: %s", request.url.path, type(exc).__name__, exc)
        return JSONResponse({"detail": "tracker error, try again"}, status_code=503)

    @app.get("/api/v1/run")
    def run() -> dict[str, Any]:
        """What a peer needs before it joins: the manifest (verify run_id from it) and versions."""
        return {
            "run_id": manifest.run_id,
            "manifest": manifest_json,
            "t_fixed_sha256": manifest.t_fixed_sha256,
            "u_sha256": manifest.u_sha256,
            "u_version": monitor.snapshot()["u_version"],
            "software_version": SOFTWARE_VERSION,
        }

    @app.get("/api/v1/bootstrap")
    def bootstrap() -> dict[str, Any]:
        return {"run_id": manifest.run_id, "initial_peers": monitor.bootstrap()}

    @app.get("/api/v1/swarm")
    def swarm(
        history: int = Query(
            DEFAULT_HISTORY_POINTS,
            ge=0,
            le=MAX_HISTORY_POINTS,
            description="at most this many history points",
        ),
        since: float = Query(0.0, ge=0, allow_inf_nan=False, description="history from this unix time on"),
    ) -> dict[str, Any]:
        return {**monitor.snapshot(), "history": monitor.history.read(history, since)}

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        """Liveness of the tracker itself (is it still reading the DHT?), not of the swarm."""
        ok = monitor.alive()
        snapshot = monitor.snapshot()
        return JSONResponse(
            {"ok": ok, "swarm_healthy": snapshot["healthy"], "run_id": manifest.run_id},
            status_code=200 if ok else 503,
        )

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(metrics.render(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/", response_class=HTMLResponse)
    def index() -> HTMLResponse:
        snapshot = monitor.snapshot()
        html = env.get_template("index.html").render(
            manifest=manifest,
            s=snapshot,
            bootstrap=monitor.bootstrap(),
            version=SOFTWARE_VERSION,
        )
        return HTMLResponse(html)

    return app


def _stats(monitor: SwarmMonitor) -> dict[str, float]:
    reference = monitor.last_success if monitor.last_success is not None else monitor.started_at
    return {
        "polls": monitor.polls,
        "poll_failures": monitor.poll_failures,
        "last_poll_age": time.time() - reference,
    }
