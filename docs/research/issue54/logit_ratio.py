"""How far the logit bound eta_i is from the realized logit change, on the held-out slice's keys.

Research script (public API only). Per layer and KV head of tests/data/heldout_slice.npz: the keys of the
1054 tokens quantized by ``kvcert.reference.quantize`` (int8 or int4), the first query of the head's group at
the first offset, eta_i = ``logit_bound`` and the realized |tau q.(k_i - Q(k_i))|. Prints, per head, the median
per-token ratio eta_i / realized and mean(eta) / RMS(realized), and the slice's median |key entry| and mean
per-token key absmax.

    .venv/bin/python docs/research/issue54/logit_ratio.py [--format int4]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from kvcert import reference as R

SLICE = Path(__file__).resolve().parents[3] / "tests" / "data" / "heldout_slice.npz"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="int8", choices=("int8", "int4"))
    args = ap.parse_args(argv)
    z = np.load(SLICE)
    tau = float(z["scaling"])
    for L in z["layers"]:
        k, q = z[f"k{L}"].astype(np.float64), z[f"qt{L}"].astype(np.float64)
        g = q.shape[0] // k.shape[0]
        print(f"layer {L}: median |k| {np.median(np.abs(k)):.3f}, mean per-token absmax "
              f"{np.abs(k).max(axis=-1).mean():.2f}")
        for h in range(k.shape[0]):
            kq = R.quantize(k[h], args.format)
            eta = R.logit_bound(q[g * h, 0], kq, scale=tau)
            real = np.abs(tau * (k[h] - kq.dequantize()) @ q[g * h, 0])
            print(f"  KV head {h}: median eta / realized {np.median(eta / np.maximum(real, 1e-300)):.1f}, "
                  f"mean eta / RMS realized {eta.mean() / np.sqrt(np.mean(real ** 2)):.1f}, "
                  f"mean eta {eta.mean():.3f} nats")


if __name__ == "__main__":
    main()
