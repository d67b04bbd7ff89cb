"""The `sluice` command: run one service, the whole dev stack, or manage keys."""

from __future__ import annotations

import asyncio
import signal
import threading
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(no_args_is_help=True, add_completion=False, help="sluice: LLM serving through queues")
keys_app = typer.Typer(no_args_is_help=True, help="Manage team API keys")
app.add_typer(keys_app, name="keys")
console = Console(stderr=True)

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", help="pool file (TOML); default: one simulated pool")
]


@app.command()
def dev(
    config: ConfigOpt = None,
    port: Annotated[int, typer.Option(help="ingress port, if free")] = 8000,
    workdir: Annotated[Path, typer.Option(help="logs and dev.env")] = Path(".sluice"),
) -> None:
    """Start the embedded stack (broker, Redis, every service) and keep it up until Ctrl-C."""
    from infra.devstack import DevStack

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stack = DevStack(workdir, config, ingress_port=port)
    console.print("[bold]starting sluice dev stack[/] ...")
    try:
        endpoints = stack.start()
    except (RuntimeError, TimeoutError) as exc:
        console.print(f"[red]dev stack failed to start:[/] {exc}")
        raise typer.Exit(1) from None
    model = stack.config.pools[0].model
    for line in endpoints.env_lines():
        typer.echo(line)
    typer.echo(f"# written to {workdir / 'dev.env'}; logs in {stack.log_dir}")
    typer.echo("# try:")
    typer.echo(endpoints.curl(model))
    exit_code = 0
    try:
        while not stop.wait(0.5):
            dead = stack.dead()
            if dead:
                for proc in dead:
                    console.print(f"[red]{proc.name} exited ({proc.popen.returncode}):[/]\n{proc.log_tail()}")
                exit_code = 1
                break
    finally:
        console.print("stopping ...")
        stack.stop()
        console.print("stopped")
    raise typer.Exit(exit_code)


@app.command()
def ingress(
    port: Annotated[int | None, typer.Option()] = None, host: Annotated[str | None, typer.Option()] = None
) -> None:
    """Run the OpenAI-compatible HTTP front end."""
    from ingress.main import run
    from ingress.settings import IngressSettings

    overrides = {k: v for k, v in {"port": port, "host": host}.items() if v is not None}
    run(IngressSettings(**overrides))  # type: ignore[arg-type]


@app.command()
def dispatcher(pool: Annotated[str | None, typer.Option()] = None) -> None:
    """Run the dispatcher of one pool."""
    from dispatcher.main import run
    from dispatcher.settings import DispatcherSettings

    run(DispatcherSettings(**({"pool": pool} if pool else {})))  # type: ignore[arg-type]


@app.command()
def worker(
    pool: Annotated[str | None, typer.Option()] = None,
    worker_id: Annotated[str | None, typer.Option("--worker-id")] = None,
) -> None:
    """Run one worker of a pool."""
    from gpu_workers.main import run
    from gpu_workers.settings import WorkerSettings

    overrides = {k: v for k, v in {"pool": pool, "worker_id": worker_id}.items() if v is not None}
    run(WorkerSettings(**overrides))  # type: ignore[arg-type]


@app.command()
def scaler(port: Annotated[int | None, typer.Option()] = None) -> None:
    """Run the scaler (lag exporter)."""
    from scaler.main import run
    from scaler.settings import ScalerSettings

    run(ScalerSettings(**({"port": port} if port is not None else {})))  # type: ignore[arg-type]


@keys_app.command("create")
def keys_create(
    team: Annotated[str, typer.Option(help="team the key belongs to")],
    pool: Annotated[list[str] | None, typer.Option(help="allowed pool (repeatable); default all")] = None,
) -> None:
    """Create a key; it is printed once and stored only as its SHA-256 hash."""
    from infra.keys import create_key
    from queue_schemas.clients import redis_client
    from queue_schemas.settings import BusSettings

    settings = BusSettings()

    async def go() -> str:
        redis = redis_client(settings)
        try:
            return await create_key(redis, settings.names, team, tuple(pool or ()))
        finally:
            await redis.aclose()

    typer.echo(asyncio.run(go()))


@keys_app.command("list")
def keys_list() -> None:
    """List keys by team (key ids only; keys themselves are never stored)."""
    from infra.keys import list_keys
    from queue_schemas.clients import redis_client
    from queue_schemas.settings import BusSettings

    settings = BusSettings()

    async def go() -> None:
        redis = redis_client(settings)
        try:
            for _, record in await list_keys(redis, settings.names):
                typer.echo(f"{record.team}\t{record.key_id}\t{','.join(record.pools) or '*'}")
        finally:
            await redis.aclose()

    asyncio.run(go())


@keys_app.command("revoke")
def keys_revoke(key: Annotated[str, typer.Argument(help="the key, or its id from `keys list`")]) -> None:
    """Revoke a key at once."""
    from infra.keys import revoke_key
    from queue_schemas.clients import redis_client
    from queue_schemas.settings import BusSettings

    settings = BusSettings()

    async def go() -> int:
        redis = redis_client(settings)
        try:
            return await revoke_key(redis, settings.names, key)
        finally:
            await redis.aclose()

    removed = asyncio.run(go())
    if not removed:
        console.print("no such key")
        raise typer.Exit(1)
    typer.echo(f"revoked {removed}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
