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
