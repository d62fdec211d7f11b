"""vLLM servers the ``vllm_server`` engine uses: ``serve`` starts one (keyed), ``refit`` loads new weights into them."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from tasks.batch_fields import field_default
from tasks.cli.context import say
from tasks.cli.flags import AddCommand, key_json_pairs
from tasks.errors import EXIT_FAILED, EXIT_OK, UsageError


def add_serve(add: AddCommand) -> None:
    parser = add(
        "serve",
        "start a vLLM server (engine vllm_server's counterpart) for a model; print its URL; stop it with "
        "Ctrl-C or SIGTERM",
    )
    parser.add_argument("--model", default=field_default("model"), help="model reference or local folder to serve")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (one that is not loopback needs --api-key-file)"
    )
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument(
        "--api-key-file",
        default=None,
        help="file holding the API key every route but /health requires (default: a new key in "
        "<cache>/serve/port-<port>.key, mode 0600; loopback only)",
    )
    parser.add_argument(
        "--engine-option",
        action="append",
        metavar="KEY=JSON",
        help=f"a vllm engine option, repeatable; none given: {json.dumps(field_default('engine_options'))}",
    )
    parser.add_argument("--log", default=None, help="the server's log file (default: in the user cache)")
    parser.set_defaults(run=run_serve)


def add_refit(add: AddCommand) -> None:
    parser = add("refit", "load a model folder into running vLLM servers as a new weight version")
    parser.add_argument("--urls", nargs="+", required=True, help="base URLs of the servers (replicas of one model)")
    parser.add_argument("--folder", required=True, help="the model folder, as the servers' machine sees it")
    parser.add_argument("--version", type=int, default=None, help="the new weight version (default: current + 1)")
    parser.add_argument("--api-key-file", default=None, help="file holding the servers' API key")
    parser.set_defaults(run=run_refit)


def run_serve(args: argparse.Namespace) -> int:
    from tasks.engines.options import read_key_file
    from tasks.engines.startup import engine_log_path
    from tasks.engines.vllm.options import VllmOptions
    from tasks.engines.vllm_server.serving.keys import generated_key_path, is_loopback, write_new_key
    from tasks.engines.vllm_server.serving.launch import VllmServer, port_taken, serve_until_stopped
    from tasks.models.reference import resolve_model_reference

    if args.api_key_file is None and not is_loopback(args.host):
        raise UsageError(
            f"--host {args.host} is not a loopback address: give --api-key-file, the key its clients will send "
            "(serve makes a key of its own only for a loopback server)"
        )
    if port_taken(args.host, args.port):  # checked before a new key replaces the one of a server still there
        raise UsageError(
            f"port {args.port} on {args.host} is in use: stop the server that holds it (a running serve: Ctrl-C "
            "or SIGTERM) or choose another --port"
        )
    folder = resolve_model_reference(args.model)
    options = VllmOptions.from_mapping(
        field_default("engine_options")
        if args.engine_option is None
        else key_json_pairs(args.engine_option, "--engine-option")
    )
    if args.api_key_file is None:
        key_file = generated_key_path(args.port)
        api_key = write_new_key(key_file)
    else:
        key_file = Path(args.api_key_file).expanduser()
        api_key = read_key_file(key_file, what="--api-key-file")
    log_path = Path(args.log) if args.log else engine_log_path("serve", f"port-{args.port}")
    say(f"starting a vLLM server for {args.model} on {args.host}:{args.port} (log: {log_path})")
    say(f"every route but /health requires the API key in {key_file} (clients: --api-key-file / api_key_file)")
    server = VllmServer.start(folder, options, host=args.host, port=args.port, api_key=api_key, log_path=log_path)
    try:
        server.wait_ready(on_wait=_waiting("vLLM server starting"))
    except BaseException:
        server.stop()
        raise
    print(server.url, flush=True)
    say(f"serving {folder} at {server.url}; Ctrl-C or SIGTERM stops it (the server ends with this process)")
    exited = serve_until_stopped(server)
    if exited is not None:
        say(f"the vLLM server exited with {exited}; its log ({log_path}) ends:\n{server.log_tail()}")
        return EXIT_FAILED
    say("vLLM server stopped")
    return EXIT_OK


def run_refit(args: argparse.Namespace) -> int:
    import asyncio

    from tasks.engines.vllm_server.options import VllmServerOptions
    from tasks.engines.vllm_server.refit import refit_urls

    options = VllmServerOptions(urls=args.urls, api_key_file=args.api_key_file)
    urls = options.urls
    refit = asyncio.run(
        refit_urls(urls, args.folder, args.version, api_key=options.api_key(), key_source=options.key_source())
    )
    sha = refit.announced.weights_sha256
    weights = (
        f"weights sha256 {sha} (hashed here)"
        if sha is not None
        else f"weights declared, not verified ({args.folder} is not a folder of weights this machine can read)"
    )
    print(f"refit {len(urls)} server(s) to {args.folder} at weight version {refit.version}: {weights}")
    for verdict in refit.verdicts():  # each server hashed what it loaded: the same sha256, or declared
        print(f"  {verdict}")
    return EXIT_OK


def _waiting(what: str) -> Callable[[float], None]:
    """A callback that tells the terminal every 10 s that ``what`` is still going."""
    said = [0.0]

    def on_wait(seconds: float) -> None:
        if seconds - said[0] >= 10:
            said[0] = seconds
            say(f"{what}: {seconds:.0f} s")

    return on_wait
