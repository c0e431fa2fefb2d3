"""Rules of the library's layout that a reader relies on (issue 28): they fail on a change that breaks them."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the longest a function or method in kvcert/ may be, docstring included
MAX_FUNCTION_LINES = 100


def _functions(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def test_no_function_in_kvcert_is_over_100_lines():
    """Every function of the public package reads in one screen or two: split a longer one (a phase, a
    protocol, a check) rather than let it grow."""
    long = [f"{p.relative_to(ROOT)}:{line} {name} ({n} lines)"
            for p in sorted((ROOT / "kvcert").rglob("*.py")) for name, line, n in _functions(p)
            if n > MAX_FUNCTION_LINES]
    assert not long, "functions over %d lines:\n  " % MAX_FUNCTION_LINES + "\n  ".join(long)


def test_the_rule_sees_a_long_function(tmp_path):
    """Negative control: a 101-line function is found."""
    body = "\n".join(f"    x{i} = {i}" for i in range(100))
    (tmp_path / "m.py").write_text(f"def f():\n{body}\n")
    assert [n for _, _, n in _functions(tmp_path / "m.py")] == [101]


#: the names the operations had before each got one name (docs/architecture.md "Names"): the old public
#: names of kvcert.fast and kvcert.kernels (their RENAMED tables) and the vLLM backend's route functions
RETIRED = {"cluster_hajek_attention", "paged_hajek_attention_compacted", "cluster_step", "compacted_decode",
           "masked_decode", "sketched_decode", "masked_chunks", "MaskedChunk"}


def _retired_uses(paths, root):
    import re

    pattern = re.compile(r"\b(%s)\b(?!\.json)" % "|".join(sorted(RETIRED)))
    hits = []
    for p in paths:
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if pattern.search(line) and "RENAMED" not in line and '"paged_hajek_attention_compacted": ' not in line:
                hits.append(f"{p.relative_to(root)}:{i}: {line.strip()}")
    return hits


def test_each_operation_has_one_name():
    """Library, tests, benchmarks and docs (research records aside) use the operations' current names: token
    ``hajek_attention`` / ``paged_hajek_attention``, block ``block_hajek_attention`` /
    ``paged_block_hajek_attention``, sketch ``sketch_hajek_attention``; in vLLM ``token_decode``,
    ``block_decode``, ``sketch_decode``."""
    paths = [p for d in ("kvcert", "fast", "reference", "kernels", "tests", "benchmarks", "paper_repro")
             for p in sorted((ROOT / d).rglob("*.py")) if p.name != "test_layout.py"]
    paths += sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    hits = _retired_uses(paths, ROOT)
    assert not hits, "retired operation names in use:\n  " + "\n  ".join(hits)


def test_the_name_rule_sees_a_retired_name(tmp_path):
    """Negative control: a call by a retired name is found; a benchmark's recorded file name is not."""
    (tmp_path / "m.py").write_text("x = F.cluster_hajek_attention(q)\ny = 'benchmarks/masked_decode.json'\n")
    assert _retired_uses([tmp_path / "m.py"], tmp_path) == ["m.py:1: x = F.cluster_hajek_attention(q)"]


def test_renamed_names_resolve_with_a_deprecation_warning():
    """The old public names still resolve, to the same object, and warn with the new name."""
    import pytest

    import kvcert.fast as F
    import kvcert.kernels as K

    for module, table in ((F, F.RENAMED), (K, K.RENAMED)):
        for old, new in table.items():
            with pytest.warns(DeprecationWarning, match=new):
                assert getattr(module, old) is getattr(module, new)
