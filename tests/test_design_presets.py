"""Named token designs (kvcert.fast.TOKEN_DESIGNS): one name, the same design in the press and in the engine.

A preset fills the fields a caller does not name, in ``PoissonPress(preset=...)``, ``KVCertConfig(preset=...)``
and the request option ``kvcert_preset``; the budget and the seed are always the caller's. Checked: for every
registered name the press and the engine hold equal ``TokenDesign`` objects (so they draw the same tokens:
tests/vllm/test_vllm_token.py checks that equal designs do), a named field wins over the preset, and the
registry refuses what a preset must not set.
"""

from __future__ import annotations

import dataclasses

import pytest

import kvcert
from kvcert.fast import TOKEN_DESIGNS, RECOMMENDED_FIELDS, TokenDesign, preset_fields, register_design
from kvcert.vllm.config import KVCertConfig, request_options


@pytest.mark.parametrize("name", sorted(TOKEN_DESIGNS))
def test_a_preset_is_the_same_design_in_the_press_the_engine_and_a_request(name):
    press = kvcert.PoissonPress(compression_ratio=0.4, seed=7, preset=name)
    engine = KVCertConfig(compression_ratio=0.4, seed=7, preset=name)
    want = dataclasses.replace(TOKEN_DESIGNS[name], compression_ratio=0.4, seed=7)
    assert press.design == want
    assert engine.design == want
    default = KVCertConfig(compression_ratio=0.4, seed=7)
    per_request = dataclasses.replace(default, **request_options(default, {"kvcert_preset": name}))
    assert per_request.design == want


def test_the_presets_are_the_paper_and_the_recommended_design():
    assert TOKEN_DESIGNS["paper"] == TokenDesign()
    assert TOKEN_DESIGNS["recommended"] == TokenDesign(**RECOMMENDED_FIELDS)
    # what names no design runs is the recommended one (the press's and the engine's "auto")
    assert kvcert.PoissonPress(compression_ratio=0.4).design == kvcert.PoissonPress(compression_ratio=0.4,
                                                                                   preset="recommended").design
    assert KVCertConfig(compression_ratio=0.4).design == KVCertConfig(compression_ratio=0.4,
                                                                      preset="recommended").design


def test_a_named_field_wins_over_the_preset():
    press = kvcert.PoissonPress(compression_ratio=0.4, preset="recommended", sampling="poisson", window=8)
    assert (press.sampling, press.window, press.kind) == ("poisson", 8, "tilted_hull")
    engine = KVCertConfig(compression_ratio=0.4, preset="recommended", sampling="poisson", window=8)
    assert engine.design == press.design
    # negative control: without the named fields the designs differ, so the comparison can fail
    assert kvcert.PoissonPress(compression_ratio=0.4, preset="recommended").design != press.design
    request = request_options(KVCertConfig(compression_ratio=0.4), {"kvcert_preset": "paper",
                                                                     "kvcert_sampling": "systematic"})
    assert (request["sampling"], request["kind"], request["sketch"]) == ("systematic", "chebyshev", None)


def test_replace_keeps_the_resolved_fields():
    press = kvcert.PoissonPress(compression_ratio=0.4, preset="paper")
    again = dataclasses.replace(press, seed=3)
    assert again.design == dataclasses.replace(press.design, seed=3)


def test_presets_are_refused_by_name():
    with pytest.raises(ValueError, match="preset must be one of"):
        kvcert.PoissonPress(compression_ratio=0.4, preset="nope")
    with pytest.raises(ValueError, match="preset must be one of"):
        KVCertConfig(preset="nope")
    with pytest.raises(ValueError, match="kvcert_preset='nope'"):
        request_options(KVCertConfig(), {"kvcert_preset": "nope"})
    with pytest.raises(ValueError, match="granularity='block'"):
        KVCertConfig(granularity="block", preset="paper")
    with pytest.raises(ValueError, match="already registered"):
        register_design("paper", TokenDesign())
    with pytest.raises(ValueError, match="compression_ratio"):
        register_design("half", TokenDesign(compression_ratio=0.5))
    with pytest.raises(TypeError, match="TokenDesign"):
        register_design("dict", {"floor": 1.0})
    assert "seed" not in preset_fields("paper") and "compression_ratio" not in preset_fields("paper")
