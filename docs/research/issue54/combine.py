"""One table from measure.py's runs: every variant's quantized rows beside the 16-bit baseline.

Research script. Reads ``results.json`` (the first run: token layout, strict, 16 / 8 / 4 bits) and every
``results_<layout>_<bound>_<bits>.json`` in this folder, and prints one Markdown table with measure.py's
columns and the variant (layout, bound) in front: the 16-bit rows once (from the first file that has them),
then each variant's quantized rows. "vs 16-bit" and "tightness / paper 16" are each run's own (its 16-bit
rows, at its number of draws). The rounding-term columns read B_q for strict rows and sqrt(V_q) for
variance rows (measure.py's docstring).

    .venv/bin/python docs/research/issue54/combine.py [--bits 8]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load() -> list[tuple[str, str, dict]]:
    runs = []
    for path in [HERE / "results.json", *sorted(HERE.glob("results_*.json"))]:
        if path.exists():
            r = json.loads(path.read_text())
            runs.append((r.get("layout", "token"), r.get("bound", "strict"), r))
    return runs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", type=int, default=8, choices=(8, 4))
    args = ap.parse_args(argv)
    runs = load()
    fmt = lambda x: f"{x:.3g}" if x < 1e4 else f"{x:.1e}"  # noqa: E731
    print("| layout | bound | design | M | bits | memory held | mean kept | mean rel err | vs 16-bit | pooled | "
          "worst decile | silent | tightness | tightness / paper 16 | rounding term / norm(o) | "
          "rounding term / rounding's error | rounding's rel err | draws per cell |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    base = next(r for _, _, r in runs if 16 in r.get("bits", [16]))
    paper16 = {s["M"]: s["tightness"] for s in base["summary"] if s["bits"] == 16 and s["design"] == "paper"}
    lines = []
    for s in base["summary"]:
        if s["bits"] == 16:
            lines.append(("-", "-", s, base["draws"]))
    for layout, bound, r in runs:
        for s in r["summary"]:
            if s["bits"] == args.bits:
                lines.append((layout, bound, s, r["draws"]))
    order = {"default": 0, "paper": 1}
    lines.sort(key=lambda x: (order[x[2]["design"]], x[2]["M"], x[2]["bits"] != 16))
    for layout, bound, s, draws in lines:
        term = s.get("term_rel", s["bq_rel"])
        ratio = s["tightness"] / paper16[s["M"]]             # the first run predates the column
        slack = s.get("term_slack", s.get("bq_slack", float("nan")))
        print(f"| {layout} | {bound} | {s['design']} | {s['M']} | {s['bits']} | {s['memory']:.3f} | "
              f"{s['kept']:.0f} | {s['rel_error']:.4f} | {s['error_vs_16']:.2f} | {s['pooled']:.3f} | {s['worst']:.3f} | "
              f"{100 * s['silent']:.2f}% | {fmt(s['tightness'])} | {fmt(s.get('tight_vs_paper16', ratio))} | "
              f"{fmt(term)} | {fmt(slack)} | {s.get('rounding_rel_error', float('nan')):.4f} | {draws} |")


if __name__ == "__main__":
    main()
