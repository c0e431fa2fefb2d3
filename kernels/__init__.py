"""kvcert.kernels: Triton kernels. See docs/gpu.md.

:func:`hajek_attention` is the fused decode kernel: one pass over the
compressed K/V cache returns the Hajek output, the log-normalizer, the
per-coordinate survey variance, its trace and the effective sample size.
:func:`paged_hajek_attention` is its paged twin for the token design (the
compacted slots of a vLLM-style paged cache, read through the block table);
:func:`paged_block_hajek_attention` is the block design's: it skips evicted
blocks and returns the cluster-sampling variance in the same pass.
:func:`sketch_hajek_attention` is the sketched design's decode step
with its one pass over the kept K/V in a kernel (kvcert.fast's twin).
Triton is imported on first use of a kernel name (so ``kvcert.kernels.cpu`` works
without Triton); on a machine without a GPU set ``TRITON_INTERPRET=1`` before
that first use to run the kernels on CPU tensors.

Name shadowing
--------------
This folder is installed as ``kvcert.kernels`` (pyproject's package-dir
mapping). When Python runs from the repository root (``python -c``,
``python -m pytest``), the root is on ``sys.path`` and the same folder is also
found under the top-level name ``kernels``, the name of Hugging Face's
``kernels`` package (PyPI ``kernels``), which transformers imports (a
dependency from transformers 5.25). Imported under that name
(``__name__ == "kernels"``) this file therefore defines nothing of kvcert's:

- it searches ``sys.path`` without the repository root for the installed
  ``kernels`` package, executes it and puts it in ``sys.modules["kernels"]``,
  so the import statement returns Hugging Face's package (the import system
  returns what ``sys.modules`` holds once the module's code has run);
- without that package it stays an empty stand-in with no ``__file__`` and
  no ``__version__``, which is what Python makes of a bare folder on
  ``sys.path`` (a namespace package): availability probes then report the
  package missing (transformers' ``is_kernels_available()`` imports the name
  when no distribution metadata is found, and takes a module without
  ``__file__`` for such a folder; raising at import would break that probe),
  and every name imported from it raises ``ImportError`` naming the cause.

Imported as ``kvcert.kernels`` it is kvcert's package below, untouched.
"""

if __name__ == "kernels":
    def _load_installed_kernels():
        """Replace this module in ``sys.modules`` with the installed ``kernels`` package."""
        import importlib.machinery
        import importlib.util
        import os
        import sys

        here = os.path.dirname(os.path.realpath(__file__))
        root = os.path.dirname(here)

        def _shadowing(entry):
            try:
                return os.path.realpath(entry or os.getcwd()) == root
            except (OSError, TypeError, ValueError):
                return False

        def _is_this_folder(spec):
            locations = list(spec.submodule_search_locations or [])
            if spec.origin not in (None, "namespace", "built-in", "frozen"):
                locations.append(os.path.dirname(spec.origin))
            return any(os.path.realpath(loc) == here for loc in locations)

        path = [entry for entry in sys.path if isinstance(entry, str) and not _shadowing(entry)]
        spec = None
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            is_path_finder = finder is importlib.machinery.PathFinder or (
                isinstance(finder, type) and issubclass(finder, importlib.machinery.PathFinder))
            candidate = find_spec("kernels", path if is_path_finder else None)
            if candidate is not None and candidate.loader is not None and not _is_this_folder(candidate):
                spec = candidate
                break
        if spec is None:
            return False
        module = importlib.util.module_from_spec(spec)
        sys.modules["kernels"] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            if sys.modules.get("kernels") is module:
                del sys.modules["kernels"]
            raise
        return True

    if not _load_installed_kernels():
        # the stand-in for a bare folder (see the module docstring)
        __file__ = None
        __path__ = []
        __all__ = []

        def __getattr__(name):
            if name.startswith("__"):
                raise AttributeError(name)
            raise ImportError(
                f"cannot import name {name!r} from 'kernels': Hugging Face's `kernels` package (PyPI `kernels`) "
                f"is not installed; the folder kernels/ of the kvcert source tree, found on sys.path under "
                f"this name, is kvcert.kernels and stands in for nothing", name="kernels")
    del _load_installed_kernels
else:
    # The Triton kernels are imported on first use of one of their names, so that the compiled CPU op
    # (kvcert.kernels.cpu) is importable where Triton is not installed (``pip install kvcert[hf]``).
    _TRITON_NAMES = {
        "INTERPRETED": ".hajek", "SUPPORTED_DTYPES": ".hajek", "default_config": ".hajek",
        "default_moments": ".hajek", "hajek_attention": ".hajek",
        "kv_cache_views": ".paged", "paged_block_hajek_attention": ".paged", "paged_hajek_attention": ".paged",
        "sketch_hajek_attention": ".sketch",
    }
    __all__ = sorted(_TRITON_NAMES)
    #: names of earlier releases (docs/architecture.md "Names"), resolved with a DeprecationWarning.
    #: ``paged_hajek_attention`` was the block design's kernel before it became the token design's
    #: (its old calls, with ``log_pi_blocks`` and no ``prompt_lens``, now fail on the missing argument)
    RENAMED = {"cluster_hajek_attention": "sketch_hajek_attention",
               "paged_hajek_attention_compacted": "paged_hajek_attention"}

    def __getattr__(name):
        if name in RENAMED:
            import warnings

            warnings.warn(f"kvcert.kernels.{name} is renamed kvcert.kernels.{RENAMED[name]}", DeprecationWarning,
                          stacklevel=2)
            return __getattr__(RENAMED[name])
        module = _TRITON_NAMES.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        import importlib

        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value
        return value

    def __dir__():
        return sorted(set(globals()) | set(_TRITON_NAMES))
