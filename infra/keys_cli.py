"""`sluice keys`: team API keys, limits, batch signing keys and reply topics (against SLUICE_REDIS_URL)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer
from rich.console import Console

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from queue_schemas.names import Names
    from queue_schemas.teams import TeamLimits, TeamRecord

T = TypeVar("T")
keys_app = typer.Typer(no_args_is_help=True, help="Manage team API keys, limits and batch signing keys")
console = Console(stderr=True)

TpmOpt = Annotated[int | None, typer.Option("--tpm", help="team tokens per minute")]
RpmOpt = Annotated[int | None, typer.Option("--rpm", help="team requests per minute")]
DailyOpt = Annotated[int | None, typer.Option("--daily-tokens", help="team token budget per UTC day")]


def with_redis(action: Callable[[aioredis.Redis, Names], Awaitable[T]]) -> T:
    """Run one key-store action against SLUICE_REDIS_URL."""
    from plumbing.clients import redis_client
    from queue_schemas.settings import BusSettings

    settings = BusSettings()

    async def go() -> T:
        redis = redis_client(settings)
        try:
            return await action(redis, settings.names)
        finally:
            await redis.aclose()

    return asyncio.run(go())


def limits_of(tpm: int | None, rpm: int | None, daily: int | None) -> TeamLimits | None:
    from queue_schemas.teams import TeamLimits

    if tpm is None and rpm is None and daily is None:
        return None
    return TeamLimits(tokens_per_minute=tpm, requests_per_minute=rpm, daily_tokens=daily)


@keys_app.command("create")
def keys_create(
    team: Annotated[str, typer.Option(help="team the key belongs to")],
    pool: Annotated[list[str] | None, typer.Option(help="allowed pool (repeatable); default all")] = None,
    adapter: Annotated[
        list[str] | None, typer.Option(help="allowed LoRA adapter (repeatable); default all of its pools'")
    ] = None,
    tpm: TpmOpt = None,
    rpm: RpmOpt = None,
    daily_tokens: DailyOpt = None,
    allow_priority: Annotated[
        bool, typer.Option("--allow-priority", help="requests may ask for service_tier priority")
    ] = False,
) -> None:
    """Create a key (printed once, stored only as its SHA-256 hash); optionally set the team's limits."""
    from infra.keys import create_key, set_team_limits

    limits = limits_of(tpm, rpm, daily_tokens)

    async def go(redis: aioredis.Redis, names: Names) -> str:
        key = await create_key(
            redis,
            names,
            team,
            tuple(pool or ()),
            allow_priority=allow_priority,
            adapters=tuple(adapter or ()),
        )
        if limits is not None:
            await set_team_limits(redis, names, team, limits)
        return key

    try:
        typer.echo(with_redis(go))
    except ValueError as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(1) from None


@keys_app.command("limits")
def keys_limits(
    team: Annotated[str, typer.Option(help="the team")],
    tpm: TpmOpt = None,
    rpm: RpmOpt = None,
    daily_tokens: DailyOpt = None,
    weight: Annotated[
        float | None,
        typer.Option(
            "--weight", min=0.001, max=1000, help="share in the fair order against other teams (default 1)"
        ),
    ] = None,
) -> None:
    """Show a team's limits and weight, or replace the limits when any limit option is given and the
    weight when --weight is."""
    from infra.keys import set_team_limits, set_team_weight, team_record

    limits = limits_of(tpm, rpm, daily_tokens)

    async def go(redis: aioredis.Redis, names: Names) -> TeamRecord:
        if limits is not None:
            await set_team_limits(redis, names, team, limits)
        if weight is not None:
            await set_team_weight(redis, names, team, weight)
        return await team_record(redis, names, team)

    record = with_redis(go)
    current = record.limits
    typer.echo(
        f"{team}\ttpm={current.tokens_per_minute or '-'}\trpm={current.requests_per_minute or '-'}"
        f"\tdaily_tokens={current.daily_tokens or '-'}\tweight={record.weight:g}"
    )


@keys_app.command("list")
def keys_list() -> None:
    """List keys by team (key ids only; keys themselves are never stored): team, key id, pools,
    `adapters=...` where the key is limited to some LoRA adapters, and `priority` where the key may ask
    for the priority service tier."""
    from infra.keys import list_keys

    for _, record in with_redis(list_keys):
        adapters = f"\tadapters={','.join(record.adapters)}" if record.adapters else ""
        tiers = "\tpriority" if record.allow_priority else ""
        typer.echo(f"{record.team}\t{record.key_id}\t{','.join(record.pools) or '*'}{adapters}{tiers}")


@keys_app.command("revoke")
def keys_revoke(key: Annotated[str, typer.Argument(help="the key, or its id from `keys list`")]) -> None:
    """Revoke a key at once."""
    from infra.keys import revoke_key

    removed = with_redis(lambda redis, names: revoke_key(redis, names, key))
    if not removed:
        console.print("no such key")
        raise typer.Exit(1)
    typer.echo(f"revoked {removed}")


@keys_app.command("create-signing")
def keys_create_signing(team: Annotated[str, typer.Option(help="team whose batch records it signs")]) -> None:
    """Make an Ed25519 key pair for signing the team's batch records: the public key is stored, the
    private key (PKCS#8 PEM) is printed once and kept nowhere else."""
    from infra.keys import create_signing_key

    pem, key_id = with_redis(lambda redis, names: create_signing_key(redis, names, team))
    console.print(f"signing key {key_id} registered for team {team}; keep the private key below secret")
    typer.echo(pem, nl=False)


@keys_app.command("revoke-signing")
def keys_revoke_signing(
    team: Annotated[str, typer.Option(help="the team")],
    key_id: Annotated[str, typer.Argument(help="the key id printed when it was made")],
) -> None:
    """Stop accepting records signed with this key, at once."""
    removed = with_redis(lambda redis, names: redis.hdel(names.signing_keys(team), key_id))
    if not removed:
        console.print("no such signing key")
        raise typer.Exit(1)
    typer.echo(f"revoked signing key {key_id}")


@keys_app.command("reply-prefix")
def keys_reply_prefix(
    team: Annotated[str, typer.Option(help="the team")],
    prefix: Annotated[list[str] | None, typer.Argument(help="topic prefixes; none shows them")] = None,
) -> None:
    """Show, or replace, the topic prefixes a team's batch answers may go to (beside its results topic)."""
    from infra.keys import set_reply_prefixes

    try:
        current = with_redis(lambda redis, names: set_reply_prefixes(redis, names, team, prefix))
    except ValueError as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(1) from None
    typer.echo(f"{team}\t{','.join(current) or '-'}")
