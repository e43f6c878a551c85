"""`cascade-service` command line. Subcommands register themselves in `COMMANDS`."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

from .parser import Parser, UsageError
from ..core.verify import RULES
from ..extras import MissingExtra
from .serve import add_serve_command
from ..config import (
    Config,
    ConfigError,
    GenerationConfig,
    drafter_from_arg,
    load_config,
    make_cascade,
    make_generation,
    make_verification,
    make_adaptive,
    MaGConfig,
    target_from_arg,
    with_stop_threshold,
)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with the cascade, in-process")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="YAML config (see configs/)")
    src.add_argument("--target", help="target model directory (Hugging Face format)")
    p.add_argument("--drafter", action="extend", nargs="+", default=[], metavar="DIR_OR_mag",
                   help="drafters, largest first; 'mag' is the Max-Gram drafter")
    p.add_argument("--k-matrix", help="K-matrix as JSON, e.g. '[[5,3],[0,8]]' (see docs/algorithm.md)")
    p.add_argument("--leniency", type=float, help="leniency of inner reviews (>= 1)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt")
    prompt.add_argument("--prompt-file")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    _add_verify_arguments(p)
    p.add_argument("--adaptive-length", choices=["specdec", "confidence"],
                   help="stop draft blocks early: SpecDec++ (needs --head) or the confidence baseline")
    p.add_argument("--head", help="with --adaptive-length specdec: directory from `cascade-service train-head`")
    p.add_argument("--stop-threshold", type=float,
                   help="specdec: stop when P(a rejection) > h; confidence: when max q < h; in (0, 1)")
    p.add_argument("--adaptive-tier", help="the drafter that stops early (default: the last model drafter that "
                                           "drafts alone); its K-matrix quota stays the cap")
    p.add_argument("--dtype", default="float32", help="with --target: model dtype")
    p.add_argument("--device", default="cpu", help="with --target: cpu, cuda, cuda:N or auto")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run_generate)


def _add_verify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verify", metavar="RULE",
                   help=f"final-verifier rule: {', '.join(RULES)} (exact is the default; docs/lossy.md)")
    p.add_argument("--alpha", type=float, help="the rule's knob (fuzzy: the threshold T); default: strict (exact)")
    p.add_argument("--beta", type=_beta, help="lossy only: residual scale >= 1 - alpha (default 1), or 'tuned'")


def _beta(text: str) -> float | str:
    if text == "tuned":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number or 'tuned', got {text!r}") from None


def _config_from_args(args: argparse.Namespace) -> Config:
    if args.config:
        if args.drafter:
            raise UsageError("--drafter goes with --target, not with --config")
        config = load_config(args.config)
        cascade = config.cascade
        if args.k_matrix is not None or args.leniency is not None:
            cascade = make_cascade(
                cascade.target,
                cascade.drafters,
                args.k_matrix if args.k_matrix is not None else cascade.schedule.to_lists(),
                args.leniency if args.leniency is not None else cascade.leniency,
                cascade.lookup,
            )
        gen = config.generation
    else:
        target = target_from_arg(args.target, args.dtype, args.device)
        drafters = [drafter_from_arg(d, i, args.dtype, args.device) for i, d in enumerate(args.drafter)]
        cascade = make_cascade(target, drafters, args.k_matrix, args.leniency if args.leniency is not None else 1.0)
        gen = GenerationConfig()
    gen = make_generation(gen, {
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
        "top_p": args.top_p, "seed": args.seed, "verification": _verification_from_args(args),
    })
    cascade = _with_adaptive(cascade, args)
    if args.adaptive_length is None and args.stop_threshold is not None:
        try:  # the request's SpecDec++ threshold, at every tier the config gave an acceptance head
            with_stop_threshold(cascade.adaptive, args.stop_threshold)
        except ValueError as exc:
            raise UsageError(f"--{exc}".replace("--stop_threshold", "--stop-threshold")) from None
        gen = replace(gen, stop_threshold=args.stop_threshold)
    return Config(cascade, gen)


def _with_adaptive(cascade, args: argparse.Namespace):
    """--adaptive-length/--head/--stop-threshold/--adaptive-tier -> the cascade's schedule.adaptive."""
    if args.adaptive_length is None:
        if args.head or args.adaptive_tier:
            raise UsageError("--head and --adaptive-tier go with --adaptive-length")
        return cascade  # --stop-threshold alone is the request's threshold (GenerationConfig.stop_threshold)
    if args.stop_threshold is None:
        raise UsageError("--adaptive-length needs --stop-threshold")
    tier = args.adaptive_tier
    if tier is None:
        alone = [d.name for r, d in enumerate(cascade.drafters, 1)
                 if not isinstance(d, MaGConfig) and cascade.schedule.is_leaf(r)]
        if not alone:
            raise UsageError("--adaptive-length: no model drafter drafts alone in this cascade")
        tier = alone[-1]
    raw = {tier: {"rule": args.adaptive_length, "threshold": args.stop_threshold, "head": args.head}}
    try:
        adaptive = make_adaptive(raw, Path("."), "--adaptive-length")
    except ConfigError as exc:
        message = str(exc).replace(f"--adaptive-length.{tier}.threshold", "--stop-threshold")
        raise UsageError(message.replace(f"--adaptive-length.{tier}.head", "--head")) from None
    return make_cascade(cascade.target, cascade.drafters, cascade.schedule.to_lists(), cascade.leniency,
                        cascade.lookup, adaptive)


def _verification_from_args(args: argparse.Namespace):
    """--verify/--alpha/--beta -> a Verification, or None to keep the config's."""
    if args.verify is None:
        if args.alpha is not None or args.beta is not None:
            raise UsageError("--alpha and --beta go with --verify RULE")
        return None
    raw: dict = {"rule": args.verify, "alpha": args.alpha}
    if args.beta is not None:
        raw["beta"] = args.beta
    try:
        return make_verification(raw, "--verify")
    except ConfigError as exc:
        raise UsageError(str(exc).replace("--verify.alpha", "--alpha").replace("--verify.beta", "--beta")
                         .replace("--verify.rule", "--verify")) from None


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    try:
        return Path(args.prompt_file).read_text()
    except OSError as exc:
        raise UsageError(f"--prompt-file: cannot read {args.prompt_file}: {exc.strerror}") from None


def _run_generate(args: argparse.Namespace) -> int:
    from ..engine import Engine  # heavy (torch, transformers): only when needed

    config = _config_from_args(args)
    prompt = _read_prompt(args)
    if not prompt:
        raise UsageError("the prompt is empty")
    engine = Engine(config.cascade)
    prompt_ids = engine.encode(prompt)
    result = engine.generate(prompt_ids, config.generation)
    text = engine.decode_text(result.token_ids)
    stats = result.stats.to_dict(engine.swi_costs())
    if args.json:
        print(json.dumps({"text": text, "token_ids": result.token_ids, "stats": stats}))
    else:
        print(text)
        print(
            f"[{stats['generated_tokens']} tokens in {stats['wall_s']:.2f}s, "
            f"{stats['target_calls']} target calls, mean accepted length "
            f"{stats['mean_accepted_length']:.2f}, SWI {stats['swi']}; verification {stats['verification']}: "
            f"{stats['off_target_tokens']} off-target tokens, TV deviation {stats['tv_deviation']:.3f}]",
            file=sys.stderr,
        )
    return 0


def _add_zoo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("zoo", help="build the model zoo (offline)")
    zoo_sub = p.add_subparsers(dest="zoo_command", required=True, parser_class=Parser)
    build = zoo_sub.add_parser("build", help="build a model family into $CASCADE_SERVICE_HOME/zoo/<preset>")
    build.add_argument("--preset", default="demo", choices=["demo", "test", "tiny"],
                       help="demo: trained family (<= 10 min); test: trained, tiny (<= 60 s); "
                            "tiny: random weights (seconds)")
    build.add_argument("--out", help="output directory (default: $CASCADE_SERVICE_HOME/zoo/<preset>)")
    build.set_defaults(run=_run_zoo_build)


def _run_zoo_build(args: argparse.Namespace) -> int:
    from ..paths import zoo_dir

    out = args.out or zoo_dir(args.preset)
    if args.preset == "tiny":
        from ..zoo.tiny import build_family

        paths = build_family(out)
    else:
        from ..zoo.build import build_zoo

        paths = build_zoo(args.preset, out)
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the main job: build the zoo if missing, decode prompts, print speeds")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=4, help="how many held-out prompts to decode")
    p.add_argument("--preset", default="demo", choices=["demo", "test"], help="which zoo to use")
    p.add_argument("--passes", type=int, default=3, help="timed passes over the prompts (after one warm-up)")
    p.add_argument("--layout", default="embedded", choices=["embedded", "separate"],
                   help="embedded: large in the coordinator, base+small one deployment; separate: one per tier")
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from ..demo import run_demo  # heavy imports only when needed

    return run_demo(args.max_new_tokens, args.prompts, args.preset, args.layout, args.passes)


def _add_tune(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="choose the K-matrix and leniency from measured acceptance and cost")
    p.add_argument("--config", required=True)
    p.add_argument("--prompts", required=True, help='JSON lines {"prompt": "..."}')
    p.add_argument("--out", required=True, help="where to write the tuned config (YAML)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--objective", default="tokens_per_s", help="tokens_per_s, swi_params or swi_measured")
    p.set_defaults(run=_run_tune)


def _run_tune(args: argparse.Namespace) -> int:
    from ..tune import tune

    tune(args.config, args.prompts, args.out, args.max_new_tokens, args.objective)
    return 0


def _add_train_head(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-head", help="train a SpecDec++ acceptance head for a zoo drafter (offline)")
    from ..zoo.train_head import add_arguments  # argparse types only; training imports stay lazy

    add_arguments(p)
    p.set_defaults(run=_run_train_head)


def _run_train_head(args: argparse.Namespace) -> int:
    from ..zoo.train_head import run

    return run(args)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from ..bench.cli import add_bench_command

    add_bench_command(sub, Parser)


def _add_client(sub: argparse._SubParsersAction) -> None:
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
        c.add_argument("--seed", type=int)
        c.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
        c.add_argument("--session-id")
        _add_verify_arguments(c)
        c.add_argument("--stop-threshold", type=float,
                       help="SpecDec++ threshold h in (0, 1) for this request, at every tier with an acceptance head")
        c.add_argument("--timeout-s", type=float, default=120.0)
        c.add_argument("--json", action="store_true", help="print one JSON object (generate) or one per chunk")
        c.set_defaults(run=_run_client)
    for name in ("create", "get", "delete"):
        c = client_sub.add_parser(f"session-{name}", help=f"{name} a session")
        c.add_argument("--target", required=True)
        _add_client_access(c)
        c.add_argument("--session-id", required=name != "create")
        if name == "create":
            c.add_argument("--prompt", default="")
        c.set_defaults(run=_run_client)


def _add_client_access(c: argparse.ArgumentParser) -> None:
    # The API key comes from the environment only: a flag would show it in `ps` and shell history.
    c.add_argument("--tls", action="store_true", help="connect with TLS (the API key: $CASCADE_API_KEY)")
    c.add_argument("--root-cert", default=None, metavar="FILE", help="PEM root certificates for --tls")


def _run_client(args: argparse.Namespace) -> int:
    from ..client import CascadeClient, errors

    command = args.client_command
    try:
        import os

        if args.root_cert and not args.tls:
            raise UsageError("--root-cert goes with --tls")
        roots = Path(args.root_cert).read_bytes() if args.root_cert else None
        with CascadeClient(args.target, timeout_s=getattr(args, "timeout_s", 120.0),
                           api_key=os.environ.get("CASCADE_API_KEY") or None, tls=args.tls,
                           root_certificates=roots) as client:
            if command.startswith("session-"):
                if command == "session-delete":
                    print(json.dumps({"deleted": client.delete_session(args.session_id)}))
                    return 0
                info = (client.create_session(prompt=args.prompt or None, session_id=args.session_id)
                        if command == "session-create" else client.get_session(args.session_id))
                print(json.dumps({"session_id": info.session_id, "version": info.version,
                                  "token_ids": list(info.token_ids), "text": info.text}))
                return 0
            if args.verify is None and (args.alpha is not None or args.beta is not None):
                raise UsageError("--alpha and --beta go with --verify RULE")
            request = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                           seed=args.seed, stop=args.stop, session_id=args.session_id, verification=args.verify,
                           alpha=args.alpha, beta=args.beta, stop_threshold=args.stop_threshold)
            prompt = _read_prompt(args)
            if command == "generate":
                r = client.generate(prompt, **request)
                if args.json:
                    print(json.dumps({"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
                                      "stats": r.stats, "session_length": r.session_length}))
                else:
                    print(r.text)
                return 0
            for chunk in client.stream(prompt, **request):
                if args.json:
                    print(json.dumps({"text": chunk.text, "token_ids": chunk.token_ids,
                                      "finish_reason": chunk.finish_reason, "stats": chunk.stats}), flush=True)
                else:
                    print(chunk.text, end="", flush=True)
            if not args.json:
                print()
            return 0
    except errors.CascadeError as exc:
        print(f"cascade-service client: {exc.code.name}: {exc.details}", file=sys.stderr)
        return 1


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_generate, _add_zoo, _add_demo, _add_tune, _add_train_head, _add_bench, add_serve_command, _add_client]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="cascade-service", description="Cascade Speculative Drafting service")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except (UsageError, ConfigError, FileNotFoundError, ValueError, MissingExtra) as exc:
        prog = getattr(exc, "prog", "cascade-service")
        print(f"{prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
