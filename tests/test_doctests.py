"""The docstring examples of the reference backend (and of kvcert.fast.sketch) run and give what they show."""

import doctest

import pytest

from kvcert.fast import sketch as fast_sketch
from kvcert.reference import certificates, design, estimators, quantized


@pytest.mark.parametrize("module", [design, estimators, certificates, quantized, fast_sketch], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
