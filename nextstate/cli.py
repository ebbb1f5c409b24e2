"""`nextstate serve`, `judge`, `learn`, `keys ...`, `status`, `forget`: each prints what a person
needs next."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from datetime import datetime, timezone

from pydantic import ValidationError

from nextstate import __version__
from nextstate.core.settings import Settings


def _settings() -> Settings:
    try:
        return Settings()
    except ValidationError as exc:
        problems = "; ".join(f"NEXTSTATE_{str(e['loc'][0]).upper()}: {e['msg']}" for e in exc.errors())
        sys.exit(f"nextstate: invalid configuration: {problems}")


LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def _base_url(settings: Settings) -> str:
    """The URL clients on this machine use: loopback when bound to every interface."""
    server = settings.server
    host = "127.0.0.1" if server.host in ("0.0.0.0", "::") else server.host
    return f"http://{host}:{server.port}/v1"


def _listening(settings: Settings) -> str:
    server = settings.server
    if server.host in ("0.0.0.0", "::"):
        return f"http://{server.host}:{server.port}/v1 (every network interface)"
    return f"http://{server.host}:{server.port}/v1"


def banner(settings: Settings) -> tuple[str, str | None]:
    """What `serve` prints, and the warning it prints first when it listens beyond loopback."""
    warning = None
    if settings.server.host not in LOOPBACK:
        warning = (
            f"WARNING: nextstate listens on {settings.server.host}, beyond this machine. API keys and every "
            "conversation travel in clear HTTP unless TLS is in front (deploy/README.md, 'TLS')."
        )
    text = (
        f"nextstate {__version__}: starting an OpenAI-compatible API at {_listening(settings)}\n"
        f"  model:    {settings.engine.model or 'SmolLM2-135M-Instruct (embedded default)'}\n"
        f"  data dir: {settings.data_dir}\n"
        f"  make a key with:  nextstate keys create --user NAME\n"
        f"  then point any OpenAI client at base_url={_base_url(settings)} with that key."
    )
    return text, warning


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from nextstate.engine.default_model import DefaultModelUnavailable
    from nextstate.app import create_app
    from nextstate.assembly import ConfigError, check_no_other_learner, preflight

    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    settings = _settings().with_overrides(**overrides)
    logging.basicConfig(level=settings.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        # Fail before binding the port, and convert the default model (once) in plain view.
        preflight(settings)
        check_no_other_learner(settings)
    except (ConfigError, DefaultModelUnavailable) as exc:
        sys.exit(f"nextstate: {exc}")
    text, warning = banner(settings)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    print(text, flush=True)
    server = settings.server
    # proxy headers are read by the app, from NEXTSTATE_TRUSTED_PROXIES only (proxy/client_address.py)
    uvicorn.run(create_app(settings), host=server.host, port=server.port, log_level=server.log_level,
                proxy_headers=False)
    return 0


def _worker(kind: str) -> int:
    """`nextstate judge` / `nextstate learn`: nextstate/workers.py."""
    from nextstate.assembly import ConfigError
    from nextstate.engine.default_model import DefaultModelUnavailable
    from nextstate.learner.versions import LearnerRunning
    from nextstate.workers import run_judge, run_learner, run_until_signalled

    settings = _settings()
    logging.basicConfig(level=settings.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    where = settings.server.database_url and "the database at NEXTSTATE_DATABASE_URL" or f"the data dir {settings.data_dir}"
    print(f"nextstate {__version__}: {kind} process on {where}; adapters in {settings.adapters_dir}. "
          "Ctrl-C (or SIGTERM) stops it.", flush=True)
    try:
        run_until_signalled(run_judge if kind == "judge" else run_learner, settings)
    except (ConfigError, DefaultModelUnavailable, LearnerRunning) as exc:
        sys.exit(f"nextstate: {exc}")
    return 0


def _keys():
    from nextstate.core.private import DataDirUnusable, prepare_data_dir
    from nextstate.core.stores.opener import Stores

    settings = _settings()
    try:
        prepare_data_dir(settings.data_dir)
    except DataDirUnusable as exc:
        sys.exit(f"nextstate: {exc}")
    return settings, Stores(settings).keys


def cmd_keys_create(args: argparse.Namespace) -> int:
    settings, store = _keys()
    try:
        key, secret = store.create(args.user, admin=args.admin, rpm=args.rpm, tpm=args.tpm)
    except ValueError as exc:
        sys.exit(f"nextstate: {exc}")
    kind = "admin key" if key.admin else "key"
    limits = ", ".join(f"{n} {what} per minute" for n, what in ((key.rpm, "requests"), (key.tpm, "tokens")) if n)
    print(
        f"Created {kind} {key.id} for user '{key.user}'{f' (at most {limits})' if limits else ''}. "
        f"It is shown only this once:\n\n"
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
    print(f"{'ID':<18} {'USER':<20} {'KEY':<14} {'ADMIN':<6} {'RPM':<7} {'TPM':<9} {'CREATED (UTC)':<20} STATUS")
    for k in keys:
        created = datetime.fromtimestamp(k.created_at, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        status = "active" if k.active else "revoked"
        rpm, tpm = k.rpm or "-", k.tpm or "-"
        print(f"{k.id:<18} {k.user:<20} {k.hint:<14} {'yes' if k.admin else 'no':<6} {rpm:<7} {tpm:<9} {created:<20} {status}")
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    _, store = _keys()
    if not store.revoke(args.key_id):
        sys.exit(f"nextstate: no active key with id {args.key_id!r} (see 'nextstate keys list')")
    print(f"Revoked {args.key_id}; requests with it are refused from now on.")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from nextstate.core.stores.opener import Stores
    from nextstate.server_marker import running_server
    from nextstate.learner.versions import AdapterVersions
    from nextstate.progress import progress_report, render_text

    settings = _settings()
    stores = Stores(settings)
    if not settings.server.database_url and not stores.path("samples").is_file():
        print(f"nextstate status: nothing yet in {settings.data_dir} (start the server with 'nextstate serve').")
        return 0
    running = running_server(settings)
    where = f"{settings.data_dir}, " + (f"server running (pid {running['pid']}, port {running['port']})" if running
                                        else "server not running")
    store = stores.samples
    try:
        report = progress_report(store, AdapterVersions(settings.adapters_dir), mode=settings.judge.mode,
                                 per_user=settings.learner.adapter_scope == "user", learner_settings=settings.learner,
                                 fallback="hindsight" if settings.judge.hindsight_fallback else None)
    finally:
        stores.close()
    print(json.dumps(report, indent=1) if args.json else render_text(report, where))
    return 0


def cmd_forget(args: argparse.Namespace) -> int:
    from nextstate.forget import forget_offline
    from nextstate.server_marker import running_server

    settings = _settings()
    running = running_server(settings)
    if running:
        sys.exit(
            f"nextstate: a server is running on this data dir (pid {running['pid']}, port {running['port']}). Stop it "
            f"first, or call DELETE /v1/admin/users/{args.user} on it with an admin key."
        )
    if not args.yes:
        answer = input(f"Delete every key, session, record, sample and own adapter of user '{args.user}'? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("Nothing deleted.")
            return 1
    summary = forget_offline(settings, args.user)
    print(
        f"Forgot user '{args.user}': {summary['keys']} key(s), {summary['sessions']} open session(s), "
        f"{summary['records']} record(s), {summary['samples']} sample(s) and inbox entries"
        + (", their adapter" if summary["adapter_deleted"] else "") + "."
        + (f"\nNote: {summary['note']}." if "note" in summary else "")
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from nextstate.export import NothingToExport, build_export, write_export
    from nextstate.modelio.gguf_lora import CannotExportGguf

    settings = _settings()
    try:
        export = build_export(settings, args.user, args.version, args.format)
        write_export(export, Path(args.dir))
    except (NothingToExport, CannotExportGguf, FileExistsError) as exc:
        sys.exit(f"nextstate export: {exc}")
    how = ("as a PEFT adapter; its README.md says how to serve it with vLLM and SGLang" if args.format == "peft" else
           "as a llama.cpp LoRA adapter (GGUF); its README.md says how to load it in llama.cpp and Ollama")
    print(f"Wrote {args.user}'s adapter (scope {export.scope}, v{export.version}) to {args.dir} {how}.")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nextstate", description="An OpenAI-compatible proxy that learns online.")
    parser.add_argument("--version", action="version", version=f"nextstate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start the server (settings from NEXTSTATE_* variables)")
    serve.add_argument("--host", help="bind address (NEXTSTATE_HOST, default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (NEXTSTATE_PORT, default 8000)")
    serve.set_defaults(func=cmd_serve)

    judge = sub.add_parser("judge", help="judge the transitions serving processes leave in the shared inbox "
                           "(those run with NEXTSTATE_JUDGE_IN_PROCESS=false); several may run at once")
    judge.set_defaults(func=lambda _: _worker("judge"))
    learn = sub.add_parser("learn", help="train and publish adapter versions from the shared samples, in a process "
                           "of its own (serving processes then run with NEXTSTATE_LEARN=false); one at a time")
    learn.set_defaults(func=lambda _: _worker("learn"))

    keys = sub.add_parser("keys", help="manage API keys").add_subparsers(dest="keys_command", required=True)
    create = keys.add_parser("create", help="create a key for a user (printed once)")
    create.add_argument("--user", required=True, help="the user the key belongs to")
    create.add_argument("--admin", action="store_true", help="allow /v1/admin routes")
    create.add_argument("--rpm", type=int, help="at most this many requests per minute (default: no limit)")
    create.add_argument("--tpm", type=int, help="at most this many tokens (prompt and reply) per minute (default: no limit)")
    create.set_defaults(func=cmd_keys_create)
    keys.add_parser("list", help="list keys (never the secrets)").set_defaults(func=cmd_keys_list)
    status = sub.add_parser("status", help="is it learning: versions, samples, rewards, feedback, the judge's check")
    status.add_argument("--json", action="store_true", help="the report as JSON (what /v1/admin/progress serves)")
    status.set_defaults(func=cmd_status)

    forget = sub.add_parser("forget", help="delete one user's keys, sessions, records, samples and own adapter")
    forget.add_argument("--user", required=True, help="the user to forget")
    forget.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    forget.set_defaults(func=cmd_forget)

    export = sub.add_parser("export", help="write a user's adapter as a standard PEFT adapter, to take elsewhere")
    export.add_argument("--user", required=True, help="whose adapter (the shared one in the shared scope)")
    export.add_argument("--version", type=int, help="which version (default: the one serving)")
    export.add_argument("--format", choices=["peft", "gguf"], default="peft",
                        help="peft: adapter_config.json and safetensors (vLLM, SGLang); gguf: a llama.cpp LoRA (llama.cpp, Ollama)")
    export.add_argument("dir", help="an empty or new folder to write it to")
    export.set_defaults(func=cmd_export)

    revoke = keys.add_parser("revoke", help="revoke a key by id")
    revoke.add_argument("key_id")
    revoke.set_defaults(func=cmd_keys_revoke)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `nextstate status | head`: the reader has what it wanted
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
