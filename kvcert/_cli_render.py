"""Rendering of ``kvcert generate`` results: a rich table, or a JSON object."""

from __future__ import annotations

import math

__all__ = ["render_json", "render_text", "layer_rows"]


def _num(x: float, digits: int = 3) -> str:
    if not math.isfinite(x):
        return "inf" if x > 0 else ("nan" if math.isnan(x) else "-inf")
    return f"{x:.{digits}f}"


def _finite(x: float):
    return x if math.isfinite(x) else ("inf" if x > 0 else ("nan" if math.isnan(x) else "-inf"))


def layer_rows(certificates) -> list[dict]:
    """Per layer: min / median / max relative radius over decoding steps and heads, mean kept and mean memory
    (kept + a sketch, :attr:`kvcert.records.Certificates.memory`)."""
    stats = certificates.per_layer()
    return [
        {
            "layer": i,
            "min": float(stats["min"][i]),
            "median": float(stats["median"][i]),
            "max": float(stats["max"][i]),
            "kept": float(stats["kept"][i]),
            "memory": float(stats["memory"][i]),
        }
        for i in range(stats["min"].shape[0])
    ]


def render_json(result, *, full: bool = False) -> dict:
    """JSON-ready dict of a single-prompt :class:`~kvcert.generation.GenerationResult`."""
    out = {
        "text": result.text,
        "token_ids": list(result.token_ids),
        "logprobs": [float(x) for x in result.logprobs],
        **result.summary(),
    }
    for key in ("certificate", "prompt_certificate"):
        if key in out:
            out[key] = {k: _finite(v) if isinstance(v, float) else v for k, v in out[key].items()}
    c = result.certificates
    if c is not None:
        out["per_step_mean_relative_radius"] = [_finite(float(x)) for x in c.per_step()]
        out["per_layer"] = [{k: _finite(v) if isinstance(v, float) else v for k, v in row.items()}
                            for row in layer_rows(c)]
        if full:
            out["certificates"] = c.to_dict()
    return out


def render_text(result, console=None) -> None:
    """Print the answer, then a compact certificate table (rich)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    console.print(result.text, markup=False, highlight=False)
    s = result.summary()
    t = s["timings"]
    console.print(
        f"[dim]{s['press']}[/dim]\n"
        f"prompt {s['prompt_tokens']} tokens, generated {s['generated_tokens']}; "
        f"prefill {t['prefill_s']:.2f} s, decode {t['decode_s']:.2f} s "
        f"({t['decode_tokens_per_s']:.1f} tok/s)",
        highlight=False,
    )
    c = result.certificates
    if c is None:
        return
    cert = s["certificate"]
    if cert["decode_steps"] == 0:
        console.print("no decoding step (one token generated): nothing to certify")
        return
    heads = c.radius.shape[-1]
    console.print(
        f"{cert['kind']} certificates at level {1 - cert['delta']:.2f}: relative radius ||r|| / ||o_hat|| of "
        f"each head's attention output, over {cert['decode_steps']} decoding steps x {heads} query heads",
        highlight=False,
    )
    table = Table()
    for name, justify in (("layer", "right"), ("min", "right"), ("median", "right"), ("max", "right"),
                          ("kept tokens", "right")):
        table.add_column(name, justify=justify)
    for row in layer_rows(c):
        table.add_row(str(row["layer"]), _num(row["min"]), _num(row["median"]), _num(row["max"]),
                      f"{row['kept']:.1f}")
    console.print(table)
    if "prompt_certificate" in s:
        pc = s["prompt_certificate"]
        console.print(
            f"streaming prompt: {pc['prompt_steps']} certified prompt queries after the first chunk, mean "
            f"relative radius {_num(pc['mean_relative_radius'])}, max {_num(pc['max_relative_radius'])}, "
            f"at most {pc['max_kept']} tokens held per head",
            highlight=False,
        )
    console.print(
        f"all layers and heads: median relative radius {_num(cert['median_relative_radius'])}, "
        f"mean {_num(cert['mean_relative_radius'])}, max {_num(cert['max_relative_radius'])}; "
        f"mean kept {cert['mean_kept']:.1f} of {s['prompt_tokens'] + s['generated_tokens'] - 1} tokens"
        + (f" (memory held {cert['mean_memory']:.1f} tokens' worth, the sketch of evicted tokens included)"
           if c.sketch_memory is not None else ""),
        highlight=False,
    )
