"""The session reads a press's capabilities, never its class (kvcert.attention imports no press).

``decides_every_layer`` (the block design: refused on a model with uncompressed sliding-window layers) and
``compresses_at_decode`` (whether the session calls ``decode_event`` after decode steps).
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvcert
from kvcert.presses.base import BasePress


def test_the_capabilities_of_the_presses():
    assert kvcert.BlockPoissonPress().decides_every_layer
    assert not kvcert.PoissonPress(compression_ratio=0.5).decides_every_layer
    assert not kvcert.PoissonPress(compression_ratio=0.5).compresses_at_decode  # BasePress's event does nothing
    assert not kvcert.SnapKVPress(compression_ratio=0.5).compresses_at_decode
    decoding = kvcert.DecodingPress(base_press=kvcert.PoissonPress(compression_ratio=0.5, sketch=None),
                                    compression_interval=8, target_size=64)
    assert decoding.compresses_at_decode


def test_a_press_with_its_own_decode_event_is_called_at_decode():
    """Negative control of the rule: overriding decode_event turns the capability on."""
    class Own(kvcert.PoissonPress):
        def decode_event(self, layer, layer_idx, queries, scale):
            pass

    assert Own(compression_ratio=0.5).compresses_at_decode
    assert isinstance(Own(compression_ratio=0.5), BasePress)


def test_the_attention_module_imports_no_press():
    tree = ast.parse((Path(kvcert.__file__).parent / "attention.py").read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in imported if "presses" in m], imported
