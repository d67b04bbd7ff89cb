"""`sluice batch submit | status`: OpenAI batch files through Kafka, with progress and resumable runs."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

batch_app = typer.Typer(no_args_is_help=True, help="Submit OpenAI batch files through Kafka")
console = Console(stderr=True)


def default_output(input_path: Path) -> Path:
    return input_path.with_name(input_path.stem + ".output.jsonl")


@batch_app.command("submit")
def submit(
    input_path: Annotated[
        Path, typer.Argument(help="OpenAI batch input (JSONL: custom_id, method, url, body)")
    ],
    team: Annotated[str, typer.Option(help="the team the batch is charged to")],
    output: Annotated[Path | None, typer.Option(help="answers (JSONL); default <input>.output.jsonl")] = None,
    reply_topic: Annotated[str | None, typer.Option(help="default: <prefix>.results.<team>")] = None,
    window: Annotated[float | None, typer.Option(help="completion window, seconds; default 24 h")] = None,
    signing_key: Annotated[
        Path | None,
        typer.Option(
            envvar="SLUICE_SIGNING_KEY_FILE",
            help="the team's private signing key (PEM, from `sluice keys create-signing`)",
        ),
    ] = None,
) -> None:
    """Submit (or resume) a batch and collect every answer; Ctrl-C stops, and the same command resumes."""
    from infra.batch_run import BatchInputError, prepare, run_batch
    from queue_schemas.settings import BusSettings
    from queue_schemas.signing import load_private_key

    settings = BusSettings()
    out = output or default_output(input_path)
    try:
        if signing_key is None:
            raise BatchInputError("a signing key is required: --signing-key or SLUICE_SIGNING_KEY_FILE")
        signer = load_private_key(signing_key.read_text())
        state, lines, tally = prepare(settings, input_path, out, team, reply_topic, window)
    except (BatchInputError, OSError, ValueError) as exc:
        console.print(f"sluice batch: {exc}")
        raise typer.Exit(2) from None
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )
    task = bar.add_task("answered", total=state.total)

    def show(run_state: object, t: object) -> None:
        bar.update(
            task, completed=len(tally.answered),
            description=f"submitted {state.submitted}/{state.total}  completed {tally.completed}  "
            f"failed {tally.failed}",
        )  # fmt: skip

    async def go() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run_batch(settings, out, state, lines, tally, show, stop, signer)

    with bar:
        asyncio.run(go())
    pending = state.total - len(tally.answered)
    typer.echo(f"{out}: {tally.completed} completed, {tally.failed} failed, {pending} pending")
    if pending:
        typer.echo(f"interrupted; run the same command again to resume ({state.batch_id})")
        raise typer.Exit(130)


@batch_app.command("status")
def status(
    output: Annotated[Path, typer.Argument(help="the output file of a `sluice batch submit` run")],
) -> None:
    """Show how far a batch got: lines submitted, completed, failed and still pending."""
    from infra.batch_file import load_state, load_tally

    state = load_state(output)
    if state is None:
        console.print(f"sluice batch: no batch state beside {output}")
        raise typer.Exit(2)
    tally = load_tally(output)
    pending = state.total - len(tally.answered)
    typer.echo(
        f"{state.batch_id}\tinput={state.input}\tteam={state.team}\treply_topic={state.reply_topic}\n"
        f"total={state.total}\tsubmitted={state.submitted}\tcompleted={tally.completed}"
        f"\tfailed={tally.failed}\tpending={pending}"
    )
