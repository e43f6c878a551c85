"""`cascade-service generate`: one request in process, from a config or from model directories on the
command line; and the request arguments (`--verify`, the prompt) the client command shares."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from ..config import (
    Config,
    ConfigError,
    GenerationConfig,
    StatisticalConfig,
    drafter_from_arg,
    load_config,
    make_adaptive,
    make_cascade,
    make_generation,
    make_verification,
    target_from_arg,
)
from ..core.verify import RULES
from ..intake import with_stop_threshold
from .parser import UsageError


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with the cascade, in-process")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="YAML config (see configs/)")
    src.add_argument("--target", help="target model directory (Hugging Face format)")
    p.add_argument(
        "--drafter",
        action="extend",
        nargs="+",
        default=[],
        metavar="DIR_OR_mag",
        help="drafters, largest first; 'mag' is the Max-Gram drafter",
    )
    p.add_argument("--k-matrix", help="K-matrix as JSON, e.g. '[[5,3],[0,8]]' (see docs/algorithm.md)")
    p.add_argument("--leniency", type=float, help="leniency of inner reviews (>= 1)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt")
    prompt.add_argument("--prompt-file")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    add_verify_arguments(p)
    p.add_argument(
        "--adaptive-length",
        choices=["specdec", "confidence"],
        help="stop draft blocks early: SpecDec++ (needs --head) or the confidence baseline",
    )
    p.add_argument("--head", help="with --adaptive-length specdec: directory from `cascade-service train-head`")
    p.add_argument(
        "--stop-threshold",
        type=float,
        help="specdec: stop when P(a rejection) > h; confidence: when max q < h; in (0, 1)",
    )
    p.add_argument(
        "--adaptive-tier",
        help="the drafter that stops early (default: the last model drafter that "
        "drafts alone); its K-matrix quota stays the cap",
    )
    p.add_argument("--dtype", default="float32", help="with --target: model dtype")
    p.add_argument("--device", default="cpu", help="with --target: cpu, cuda, cuda:N or auto")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run_generate)


def add_verify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--verify",
        metavar="RULE",
        help=f"final-verifier rule: {', '.join(RULES)} (exact is the default; docs/lossy.md)",
    )
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
                fill=cascade.schedule.fill.name,
            )
        gen = config.generation
    else:
        target = target_from_arg(args.target, args.dtype, args.device)
        drafters = [drafter_from_arg(d, i, args.dtype, args.device) for i, d in enumerate(args.drafter)]
        cascade = make_cascade(target, drafters, args.k_matrix, args.leniency if args.leniency is not None else 1.0)
        gen = GenerationConfig()
    gen = make_generation(
        gen,
        {
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "seed": args.seed,
            "verification": verification_from_args(args),
        },
    )
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
        alone = [
            d.name
            for r, d in enumerate(cascade.drafters, 1)
            if not isinstance(d, StatisticalConfig) and cascade.schedule.is_leaf(r)
        ]
        if not alone:
            raise UsageError("--adaptive-length: no model drafter drafts alone in this cascade")
        tier = alone[-1]
    raw = {tier: {"rule": args.adaptive_length, "threshold": args.stop_threshold, "head": args.head}}
    try:
        adaptive = make_adaptive(raw, Path("."), "--adaptive-length")
    except ConfigError as exc:
        message = str(exc).replace(f"--adaptive-length.{tier}.threshold", "--stop-threshold")
        raise UsageError(message.replace(f"--adaptive-length.{tier}.head", "--head")) from None
    schedule = cascade.schedule
    return make_cascade(
        cascade.target,
        cascade.drafters,
        schedule.to_lists(),
        cascade.leniency,
        cascade.lookup,
        adaptive,
        schedule.fill.name,
    )


def verification_from_args(args: argparse.Namespace):
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
        raise UsageError(
            str(exc)
            .replace("--verify.alpha", "--alpha")
            .replace("--verify.beta", "--beta")
            .replace("--verify.rule", "--verify")
        ) from None


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    try:
        return Path(args.prompt_file).read_text()
    except OSError as exc:
        raise UsageError(f"--prompt-file: cannot read {args.prompt_file}: {exc.strerror}") from None


def _run_generate(args: argparse.Namespace) -> int:
    from ..inprocess import InProcess  # heavy (torch, transformers): only when needed

    config = _config_from_args(args)
    prompt = read_prompt(args)
    if not prompt:
        raise UsageError("the prompt is empty")
    engine = InProcess(config.cascade, tier_client=config.serving.tier_client)
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
