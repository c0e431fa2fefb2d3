"""The compiled CPU op's first-use build is announced, with progress, never silent (kvcert.kernels.cpu)."""

from __future__ import annotations

import shutil
import time

import pytest

from kvcert.kernels import cpu


@pytest.fixture
def fake_build(monkeypatch, tmp_path):
    """``_build`` with cpp_extension.load replaced by a 0.35 s sleep into a temporary build folder, the progress
    tick at 0.1 s; returns the folder."""
    from torch.utils import cpp_extension

    folder = tmp_path / "kvcert_cpu_test"
    monkeypatch.setattr(cpu, "build_directory", lambda: folder)
    monkeypatch.setattr(cpu, "_TICK", 0.1)
    monkeypatch.setattr(cpu, "_ninja_on_path", lambda: None)
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/c++")
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: time.sleep(0.35))
    return folder


def test_a_build_is_announced_with_progress(fake_build, capsys):
    """A build (no library in the folder yet) says where, about how long, how to build ahead or skip it, a
    progress line while it runs and how long it took."""
    cpu._build(False)
    err = capsys.readouterr().err
    assert "building the compiled CPU decode op for this torch install, once" in err and str(fake_build) in err
    assert "'kvcert build-op' builds it ahead" in err and f"{cpu.ENV_VAR}=0 skips it" in err
    assert "still building the CPU decode op" in err
    assert "CPU decode op built in" in err


def test_a_built_op_loads_silently(fake_build, capsys):
    """Negative control: with the library already in the folder nothing is announced (only a load)."""
    fake_build.mkdir(parents=True)
    (fake_build / f"{fake_build.name}.so").write_bytes(b"")
    assert cpu.is_built()
    cpu._build(False)
    assert capsys.readouterr().err == ""


def test_a_failed_build_says_so(fake_build, monkeypatch, capsys):
    """A build that fails ends with a line saying so (and load's error names the cause)."""
    from torch.utils import cpp_extension

    def broken(**kw):
        raise RuntimeError("Error building extension 'kvcert_cpu_test': error: bad code")

    monkeypatch.setattr(cpp_extension, "load", broken)
    with pytest.raises(cpu.CPUOpUnavailable, match="the build failed"):
        cpu._build(False)
    assert "the CPU decode op's build failed after" in capsys.readouterr().err
