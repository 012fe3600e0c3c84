"""``tokens``: the API's bearer tokens, created, listed (never their secrets) and revoked."""

from __future__ import annotations

import argparse
import sys

from orchestrator.app import Orchestrator
from orchestrator.domain.principals import Scope, name_of
from orchestrator.interfaces.cli.shared import (
    Commands,
    cli_actor,
    on_app,
    print_list,
    tenant,
)
from orchestrator.storage.tokens import TokenInfo


def add_parsers(commands: Commands) -> None:
    tokens = commands.add_parser("tokens", help="API tokens").add_subparsers(
        dest="tokens_command", required=True, metavar="ACTION"
    )
    cmd = tokens.add_parser("create", help="create a token and print it (shown only once)")
    cmd.add_argument("name", help="who or what uses it: the API records it as who acted")
    cmd.add_argument(
        "--scope", dest="scopes", action="append", required=True, type=str.lower,
        choices=[s.value for s in Scope], help="what it may do (repeat for several)",
    )  # fmt: skip
    cmd.add_argument(
        "--tenant", type=tenant, dest="tenants", action="append",
        help="limit it to this tenant's jobs (repeat for several; default: every tenant)",
    )  # fmt: skip
    cmd.set_defaults(handler=cmd_tokens_create)
    cmd = tokens.add_parser("list", help="list tokens (never their secrets)")
    cmd.set_defaults(handler=cmd_tokens_list)
    cmd = tokens.add_parser("revoke", help="revoke a token by name")
    cmd.add_argument("name")
    cmd.set_defaults(handler=cmd_tokens_revoke)


@on_app
async def cmd_tokens_create(args: argparse.Namespace, orc: Orchestrator) -> int:
    token = await orc.stores.tokens.create(
        args.name, [Scope(s) for s in args.scopes], args.tenants, by=cli_actor("tokens")
    )
    print(token.token)
    print(  # the name as stored (its normal form), which `tokens list` and revoke show
        f"token {name_of(args.name)!r} created; this is the only time it is shown",
        file=sys.stderr,
    )
    return 0


@on_app
async def cmd_tokens_list(args: argparse.Namespace, orc: Orchestrator) -> int:
    tokens = await orc.stores.tokens.list_tokens()
    print_list(tokens, _token_line, "no tokens", head=_TOKEN_HEAD)
    return 0


_TOKEN_HEAD = f"{'NAME':<24} {'SCOPES':<28} {'TENANTS':<24} STATE"


def _token_line(t: TokenInfo) -> str:
    tenants = ",".join(t.tenants) if t.tenants is not None else "every tenant"
    state = f"revoked {t.revoked_at:%Y-%m-%d %H:%M}" if t.revoked_at else "live"
    return f"{t.name:<24} {','.join(t.scopes):<28} {tenants:<24} {state}"


@on_app
async def cmd_tokens_revoke(args: argparse.Namespace, orc: Orchestrator) -> int:
    await orc.stores.tokens.revoke(args.name)
    print(f"token {args.name!r} revoked")
    return 0
