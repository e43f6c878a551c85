"""`cascade-service client ...`: the SDK from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..core.policy import SPECULATION
from .generate import add_verify_arguments, read_prompt
from .parser import Parser, UsageError


def add_client(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("client", help="talk to a running service over gRPC")
    client_sub = p.add_subparsers(dest="client_command", required=True, parser_class=Parser)
    for name, help_text in (("generate", "one request, printed when done"), ("stream", "print text as it arrives")):
        c = client_sub.add_parser(name, help=help_text)
        c.add_argument("--target", required=True, help="HOST:PORT of the service")
        _add_client_access(c)
        source = c.add_mutually_exclusive_group(required=True)
        source.add_argument("--prompt")
        source.add_argument("--prompt-file")
        c.add_argument("--max-new-tokens", type=int)
        c.add_argument("--temperature", type=float)
        c.add_argument("--top-p", type=float)
        c.add_argument("--top-k", type=int, help="keep the k most likely tokens (0: all)")
        c.add_argument("--min-p", type=float, help="drop tokens below min_p x the most likely's")
        c.add_argument("--seed", type=int)
        c.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
        c.add_argument("--session-id")
        add_verify_arguments(c)
        c.add_argument(
            "--stop-threshold",
            type=float,
            help="SpecDec++ threshold h in (0, 1) for this request, at every tier with an acceptance head",
        )
        c.add_argument(
            "--speculation",
            choices=SPECULATION,
            help="auto (the server's way), fixed (its K-matrix always) or off (plain decoding); same output",
        )
        c.add_argument("--timeout-s", type=float, default=120.0)
        c.add_argument("--json", action="store_true", help="print one JSON object (generate) or one per chunk")
        c.set_defaults(run=run_client)
    for name in ("create", "get", "delete"):
        c = client_sub.add_parser(f"session-{name}", help=f"{name} a session")
        c.add_argument("--target", required=True)
        _add_client_access(c)
        c.add_argument("--session-id", required=name != "create")
        if name == "create":
            c.add_argument("--prompt", default="")
        c.set_defaults(run=run_client)


def _add_client_access(c: argparse.ArgumentParser) -> None:
    # The API key comes from the environment only: a flag would show it in `ps` and shell history.
    c.add_argument("--tls", action="store_true", help="connect with TLS (the API key: $CASCADE_API_KEY)")
    c.add_argument("--root-cert", default=None, metavar="FILE", help="PEM root certificates for --tls")


def run_client(args: argparse.Namespace) -> int:
    from ..client import CascadeClient, errors

    command = args.client_command
    try:
        import os

        if args.root_cert and not args.tls:
            raise UsageError("--root-cert goes with --tls")
        roots = Path(args.root_cert).read_bytes() if args.root_cert else None
        with CascadeClient(
            args.target,
            timeout_s=getattr(args, "timeout_s", 120.0),
            api_key=os.environ.get("CASCADE_API_KEY") or None,
            tls=args.tls,
            root_certificates=roots,
        ) as client:
            if command.startswith("session-"):
                if command == "session-delete":
                    print(json.dumps({"deleted": client.delete_session(args.session_id)}))
                    return 0
                info = (
                    client.create_session(prompt=args.prompt or None, session_id=args.session_id)
                    if command == "session-create"
                    else client.get_session(args.session_id)
                )
                print(
                    json.dumps(
                        {
                            "session_id": info.session_id,
                            "version": info.version,
                            "token_ids": list(info.token_ids),
                            "text": info.text,
                        }
                    )
                )
                return 0
            if args.verify is None and (args.alpha is not None or args.beta is not None):
                raise UsageError("--alpha and --beta go with --verify RULE")
            request = dict(
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                min_p=args.min_p,
                seed=args.seed,
                stop=args.stop,
                session_id=args.session_id,
                verification=args.verify,
                alpha=args.alpha,
                beta=args.beta,
                stop_threshold=args.stop_threshold,
                speculation=args.speculation,
            )
            prompt = read_prompt(args)
            if command == "generate":
                r = client.generate(prompt, **request)
                if args.json:
                    print(
                        json.dumps(
                            {
                                "text": r.text,
                                "token_ids": r.token_ids,
                                "finish_reason": r.finish_reason,
                                "stats": r.stats,
                                "session_length": r.session_length,
                            }
                        )
                    )
                else:
                    print(r.text)
                return 0
            for chunk in client.stream(prompt, **request):
                if args.json:
                    print(
                        json.dumps(
                            {
                                "text": chunk.text,
                                "token_ids": chunk.token_ids,
                                "finish_reason": chunk.finish_reason,
                                "stats": chunk.stats,
                            }
                        ),
                        flush=True,
                    )
                else:
                    print(chunk.text, end="", flush=True)
            if not args.json:
                print()
            return 0
    except errors.CascadeError as exc:
        print(f"cascade-service client: {exc.code.name}: {exc.details}", file=sys.stderr)
        return 1
