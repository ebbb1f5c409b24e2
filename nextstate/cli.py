"""`nextstate serve` and `nextstate keys ...`: each prints what a person needs next."""

from __future__ import annotations

import argparse
import logging
import sys
from datetime import datetime, timezone

from pydantic import ValidationError

from nextstate import __version__
from nextstate.settings import Settings


def _settings() -> Settings:
    try:
        return Settings()
    except ValidationError as exc:
        problems = "; ".join(f"NEXTSTATE_{'_'.join(map(str, e['loc'])).upper()}: {e['msg']}" for e in exc.errors())
        sys.exit(f"nextstate: invalid configuration: {problems}")


def _base_url(settings: Settings) -> str:
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    return f"http://{host}:{settings.port}/v1"


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from engine.default_model import DefaultModelUnavailable
    from nextstate.app import ConfigError, create_app, preflight

    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    settings = _settings().model_copy(update=overrides)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        # Fail before binding the port, and convert the default model (once) in plain view.
        preflight(settings)
    except (ConfigError, DefaultModelUnavailable) as exc:
        sys.exit(f"nextstate: {exc}")
    print(
        f"nextstate {__version__}: starting an OpenAI-compatible API at {_base_url(settings)}\n"
        f"  model:    {settings.model or 'SmolLM2-135M-Instruct (embedded default)'}\n"
        f"  data dir: {settings.data_dir}\n"
        f"  make a key with:  nextstate keys create --user NAME\n"
        f"  then point any OpenAI client at base_url={_base_url(settings)} with that key.",
        flush=True,
    )
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level)
    return 0


def _keys():
    from proxy.keys import KeyStore

    settings = _settings()
    return settings, KeyStore(settings.keys_db)


def cmd_keys_create(args: argparse.Namespace) -> int:
    settings, store = _keys()
    try:
        key, secret = store.create(args.user, admin=args.admin)
    except ValueError as exc:
        sys.exit(f"nextstate: {exc}")
    kind = "admin key" if key.admin else "key"
    print(
        f"Created {kind} {key.id} for user '{key.user}'. It is shown only this once:\n\n"
        f"    {secret}\n\n"
        f"Use it with any OpenAI client:\n"
        f"    from openai import OpenAI\n"
        f"    client = OpenAI(base_url=\"{_base_url(settings)}\", api_key=\"{secret}\")\n"
        f"Revoke it with:  nextstate keys revoke {key.id}"
    )
    return 0


def cmd_keys_list(_: argparse.Namespace) -> int:
    _, store = _keys()
    keys = store.list()
    if not keys:
        print("No keys yet. Create one with:  nextstate keys create --user NAME")
        return 0
    print(f"{'ID':<18} {'USER':<20} {'KEY':<14} {'ADMIN':<6} {'CREATED (UTC)':<20} STATUS")
    for k in keys:
        created = datetime.fromtimestamp(k.created_at, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        status = "active" if k.active else "revoked"
        print(f"{k.id:<18} {k.user:<20} {k.hint:<14} {'yes' if k.admin else 'no':<6} {created:<20} {status}")
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    _, store = _keys()
    if not store.revoke(args.key_id):
        sys.exit(f"nextstate: no active key with id {args.key_id!r} (see 'nextstate keys list')")
    print(f"Revoked {args.key_id}; requests with it are refused from now on.")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nextstate", description="An OpenAI-compatible proxy that learns online.")
    parser.add_argument("--version", action="version", version=f"nextstate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start the server (settings from NEXTSTATE_* variables)")
    serve.add_argument("--host", help="bind address (NEXTSTATE_HOST, default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (NEXTSTATE_PORT, default 8000)")
    serve.set_defaults(func=cmd_serve)

    keys = sub.add_parser("keys", help="manage API keys").add_subparsers(dest="keys_command", required=True)
    create = keys.add_parser("create", help="create a key for a user (printed once)")
    create.add_argument("--user", required=True, help="the user the key belongs to")
    create.add_argument("--admin", action="store_true", help="allow /v1/admin routes")
    create.set_defaults(func=cmd_keys_create)
    keys.add_parser("list", help="list keys (never the secrets)").set_defaults(func=cmd_keys_list)
    revoke = keys.add_parser("revoke", help="revoke a key by id")
    revoke.add_argument("key_id")
    revoke.set_defaults(func=cmd_keys_revoke)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
