"""The `sluice` command: run one service, the whole dev stack, manage keys, or submit batches."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from infra.batch_cli import batch_app
from infra.keys_cli import keys_app

app = typer.Typer(no_args_is_help=True, add_completion=False, help="sluice: LLM serving through queues")
app.add_typer(keys_app, name="keys")
app.add_typer(batch_app, name="batch")
console = Console(stderr=True)

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", help="pool file (TOML); default: one simulated pool")
]


@app.command()
def dev(
    config: Annotated[
        Path | None, typer.Option("--config", help="pool file (TOML); default: SmolLM2 on vLLM and `sim`")
    ] = None,
    engine: Annotated[
        str, typer.Option(help="without --config: `vllm` (SmolLM2 and sim) or `simulated` (sim only)")
    ] = "vllm",
    port: Annotated[int, typer.Option(help="ingress port, if free")] = 8000,
    workdir: Annotated[Path, typer.Option(help="logs and dev.env")] = Path(".sluice"),
    models_dir: Annotated[Path, typer.Option(help="where SmolLM2 is prepared and kept")] = Path(
        ".sluice/models"
    ),
    ingress: Annotated[int, typer.Option(min=1, help="ingress processes, on consecutive ports")] = 1,
    dispatchers: Annotated[int, typer.Option(min=1, help="dispatchers per pool")] = 2,
    redis_cluster: Annotated[
        int,
        typer.Option(min=0, help="run a local Redis Cluster of this many primaries (each with a replica)"),
    ] = 0,
    exit_on_failure: Annotated[
        bool,
        typer.Option(
            "--exit-on-failure", help="stop the whole stack when any process exits, instead of restarting it"
        ),
    ] = False,
) -> None:
    """Start the embedded stack (broker, Redis, every service) and keep it up until Ctrl-C. A service
    that exits is restarted with a back-off, as compose's restart policy would (`--exit-on-failure`:
    the stack stops instead); the broker or Redis exiting stops it, since what they held is gone."""
    from infra.devstack import DevStack, InfraLost, default_dev_config

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if config is None and engine == "vllm":
        console.print("preparing SmolLM2-135M-Instruct (first run only) ...")
        config = default_dev_config(workdir, models_dir)
    elif config is None and engine != "simulated":
        console.print(f"[red]--engine must be vllm or simulated, not {engine!r}[/]")
        raise typer.Exit(2)
    stack = DevStack(
        workdir,
        config,
        ingress_port=port,
        ingresses=ingress,
        dispatchers=dispatchers,
        redis_cluster=redis_cluster,
        # Each request's spans are kept for the dashboard's timeline; OTEL_* variables add an exporter.
        extra_env={"SLUICE_TRACE_TIMELINE": os.environ.get("SLUICE_TRACE_TIMELINE", "1")},
    )
    console.print("[bold]starting sluice dev stack[/] ...")
    try:
        endpoints = stack.start()
    except (RuntimeError, TimeoutError) as exc:
        console.print(f"[red]dev stack failed to start:[/] {exc}")
        raise typer.Exit(1) from None
    model = stack.config.pools[0].model
    for line in endpoints.env_lines():
        typer.echo(line)
    if len(stack.ingress_urls) > 1:
        typer.echo(f"# ingress processes: {' '.join(stack.ingress_urls)}")
    typer.echo(f"# written to {workdir / 'dev.env'}; logs in {stack.log_dir}")
    typer.echo("# try:")
    typer.echo(endpoints.curl(model))
    exit_code = 0
    try:
        while not stop.wait(0.5):
            if not exit_on_failure:
                try:
                    for line in stack.supervise(time.monotonic()):
                        console.print(f"[yellow]{line}[/]")
                except InfraLost as exc:
                    console.print(f"[red]{exc}[/]")
                    exit_code = 1
                    break
                except OSError as exc:  # a restart that could not be made is tried again next round
                    console.print(f"[red]supervising: {exc}[/]")
                continue
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


topics_app = typer.Typer(no_args_is_help=True, help="Manage the Kafka topics of the configured pools")
app.add_typer(topics_app, name="topics")


@topics_app.command("create")
def topics_create(
    replication: Annotated[int, typer.Option(min=1, help="replication factor (3 in production)")] = 1,
    team: Annotated[list[str] | None, typer.Option(help="also create its batch results topic")] = None,
) -> None:
    """Create the requests, batch and dead-letter topics of every configured pool (existing ones are kept)."""
    from infra.topics import create_topics
    from queue_schemas.settings import BusSettings

    for name, created in asyncio.run(create_topics(BusSettings(), replication, team or [])):
        typer.echo(f"{'created' if created else 'exists '} {name}")


@topics_app.command("acls")
def topics_acls(
    team: Annotated[list[str] | None, typer.Option(help="also grant this batch-submitting team")] = None,
) -> None:
    """Print the broker ACLs (kafka-acls.sh commands): one principal per service, one per team."""
    from infra.acls import acl_script
    from queue_schemas.settings import BusSettings

    typer.echo(acl_script(BusSettings().names, team or []), nl=False)


@app.command("lag")
def lag_command(
    scaler_url: Annotated[
        str, typer.Option("--scaler", envvar="SLUICE_SCALER_URL", help="the scaler's base URL")
    ] = "http://127.0.0.1:8010",
    interval: Annotated[float, typer.Option(min=0.2, help="seconds between redraws")] = 1.0,
    once: Annotated[bool, typer.Option("--once", help="print the tables once and exit")] = False,
) -> None:
    """Consumer lag, replicas and workers of every pool, live in the terminal (the dashboard's numbers)."""
    import httpx

    from infra.lag_cli import watch

    try:
        watch(scaler_url, interval, once)
    except httpx.HTTPError as exc:
        console.print(f"[red]the scaler at {scaler_url} does not answer: {exc}[/red]")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


@app.command("usage")
def usage_command(
    team: Annotated[str, typer.Option(help="the team whose usage to sum")],
    since: Annotated[str, typer.Option(help="a date (2026-11-30), an ISO time, or a span back (7d, 12h)")],
    by: Annotated[str, typer.Option(help="rows per `day`, per `model`, or one `total`")] = "day",
) -> None:
    """Requests, tokens and what was charged, from the usage topic (one record per ended request)."""
    import datetime as dt

    from infra.usage_cli import parse_since, read_usage
    from infra.usage_report import aggregate, usage_table
    from queue_schemas.settings import BusSettings

    if by not in ("day", "model", "total"):
        console.print("[red]--by must be day, model or total[/red]")
        raise typer.Exit(2)
    try:
        start = parse_since(since, dt.datetime.now(dt.UTC))
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    events = asyncio.run(read_usage(BusSettings()))
    rows = aggregate(events, team, start, by)  # type: ignore[arg-type]
    if not rows:
        typer.echo(
            f"no usage for team {team!r} since {dt.datetime.fromtimestamp(start, dt.UTC):%Y-%m-%d %H:%M} UTC"
        )
        return
    typer.echo(usage_table(rows, by))


@app.command("plan")
def plan_command(
    model: Annotated[str, typer.Option(help="model preset: llama-70b, qwen-32b, llama-8b")] = "llama-70b",
    gpu: Annotated[str, typer.Option(help="GPU preset: h100, h200")] = "h100",
    tp: Annotated[int, typer.Option(help="GPUs per replica (tensor parallel)")] = 4,
    prompt_tokens: Annotated[int, typer.Option()] = 2000,
    output_tokens: Annotated[int, typer.Option()] = 300,
    peak: Annotated[float, typer.Option(help="peak requests per second")] = 20.0,
    headroom: Annotated[float, typer.Option(help="provision this factor above the peak")] = 1.3,
    decode_tps: Annotated[float, typer.Option(help="decode tokens/s per sequence at full batch")] = 25.0,
    ttft: Annotated[float, typer.Option(help="time to first token, seconds")] = 0.8,
    price: Annotated[float | None, typer.Option(help="price per GPU-hour (default: the preset's)")] = None,
    memory_utilization: Annotated[float, typer.Option()] = 0.90,
    overhead_gib: Annotated[float, typer.Option(help="activations and runtime per GPU, GiB")] = 3.0,
    max_num_seqs: Annotated[int, typer.Option(help="the engine's cap on concurrent sequences")] = 256,
    max_loras: Annotated[int, typer.Option(help="LoRA adapter slots per replica (0: no adapters)")] = 0,
    lora_rank: Annotated[int, typer.Option(help="the largest adapter rank (vLLM's max_lora_rank)")] = 16,
    lora_modules: Annotated[
        str, typer.Option(help="comma-separated target modules; `all`: the seven vLLM allocates slots for")
    ] = "all",
    open_streams: Annotated[
        int | None, typer.Option(help="control plane: streams open at once (default: peak x request time)")
    ] = None,
    requests_per_s: Annotated[
        float | None, typer.Option(help="control plane: requests per second (default: the peak)")
    ] = None,
    tokens_per_stream_s: Annotated[
        float, typer.Option(min=0, help="control plane: tokens a second a stream receives")
    ] = 20.0,
    requests_per_worker: Annotated[
        int,
        typer.Option(min=1, help="control plane: requests running at each worker (its coalescing window)"),
    ] = 128,
    pools: Annotated[int, typer.Option(min=1, help="control plane: pools sharing the traffic")] = 1,
) -> None:
    """Capacity arithmetic, step by step: KV bytes per token to replicas, GPUs and cost at peak; then the
    control plane for the same traffic (or --open-streams and --requests-per-s): Redis shards, Kafka
    partitions, ingress and dispatcher replicas, from the per-unit figures in docs/scale.md."""
    from dataclasses import replace

    from rich.table import Table

    from scaler.plan import (
        GPUS,
        LORA_MODULES,
        MODELS,
        ControlTraffic,
        Deployment,
        Workload,
        control_plan,
        plan,
    )

    if model not in MODELS or gpu not in GPUS:
        console.print(f"unknown preset; models: {', '.join(MODELS)}; GPUs: {', '.join(GPUS)}")
        raise typer.Exit(2)
    chosen_gpu = GPUS[gpu] if price is None else replace(GPUS[gpu], price_per_hour=price)
    workload = Workload(prompt_tokens, output_tokens, peak, headroom, decode_tps, ttft)
    try:
        modules = (
            LORA_MODULES if lora_modules == "all" else tuple(m.strip() for m in lora_modules.split(",") if m)
        )
        deployment = Deployment(
            tp, memory_utilization, overhead_gib, max_num_seqs, max_loras, lora_rank, modules
        )
        result = plan(MODELS[model], chosen_gpu, workload, deployment)
    except ValueError as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(1) from None
    rate = requests_per_s if requests_per_s is not None else peak
    streams = open_streams if open_streams is not None else round(rate * result.request_seconds)
    try:
        traffic = ControlTraffic(streams, rate, tokens_per_stream_s, requests_per_worker, pools=pools)
        control = control_plan(traffic)
    except ValueError as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(1) from None
    for title, steps in (
        (f"{model} on {tp} x {chosen_gpu.name}", result.steps()),
        (f"control plane: {streams:,} open streams, {rate:,.0f} requests/s", control.steps()),
    ):
        table = Table(title=title)
        for column in ("quantity", "value", "how"):
            table.add_column(column)
        for row in steps:
            table.add_row(*row)
        Console().print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
