"""Run the app under uvicorn on a socket bound here, until SIGTERM or Ctrl-C.

The socket is bound before uvicorn starts, so an address in use is a one-line error and port 0 gives a free
port whose number the ready line prints. On SIGTERM (or the first Ctrl-C) uvicorn stops accepting
connections and gives the requests in flight ``shutdown_timeout`` seconds to finish; then it cancels them
(each answer stops within one decode step) and the engine is closed.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Callable

import uvicorn

from edgeinfer.errors import InvalidOptionError
from edgeinfer.serve.app import ServeConfig, create_app


def run_server(
    config: ServeConfig,
    load: Callable[..., tuple],
    *,
    host: str,
    port: int,
    shutdown_timeout: float,
    ready: Callable[[str], None],
) -> None:
    """Serve until told to stop; ``ready(url)`` once the model has loaded. Raises the load's error, if it failed."""
    sock = _bind(host, port)
    app = create_app(config, load)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,  # request lines would be noise on an edge box; /metrics counts them
            # A backstop: the answers still running at shutdown_timeout are cancelled here first (_stop_in_time),
            # each ending with an error event, before uvicorn would cut their connections.
            timeout_graceful_shutdown=shutdown_timeout + 10,
            lifespan="on",
        )
    )
    # uvicorn re-raises the signal that stopped it once it has shut down: SIGTERM is then a clean exit.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        asyncio.run(_serve(server, app, sock, ready, shutdown_timeout))
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()


async def _serve(
    server: uvicorn.Server, app: object, sock: socket.socket, ready: Callable[[str], None], shutdown_timeout: float
) -> None:
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    if serving.done():
        await serving
        return
    state = app.state.server  # type: ignore[attr-defined]  # set by the app's lifespan
    loaded = asyncio.create_task(state.loaded.wait())
    await asyncio.wait({serving, loaded}, return_when=asyncio.FIRST_COMPLETED)
    if state.loaded.is_set():
        if state.load_error is not None:
            server.should_exit = True
            await serving
            raise state.load_error
        host, port = sock.getsockname()[:2]
        ready(f"http://{f'[{host}]' if ':' in host else host}:{port}/v1")
    loaded.cancel()
    stopper = asyncio.create_task(_stop_in_time(server, state, shutdown_timeout))
    await serving
    stopper.cancel()


async def _stop_in_time(server: uvicorn.Server, state: object, shutdown_timeout: float) -> None:
    """Once uvicorn is told to exit: refuse new answers, and cancel those still running after the timeout."""
    while not server.should_exit:
        await asyncio.sleep(0.05)
    state.stopping = True  # type: ignore[attr-defined]
    await asyncio.sleep(shutdown_timeout)
    state.cancel_all()  # type: ignore[attr-defined]


def _bind(host: str, port: int) -> socket.socket:
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        raise InvalidOptionError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); choose another --port or --host"
        ) from None
    sock.set_inheritable(True)
    return sock
