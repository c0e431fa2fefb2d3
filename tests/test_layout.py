"""Rules of the library's layout that a reader relies on (issue 28): they fail on a change that breaks them."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the folders the length rule covers: the package and its three backends (kvcert.fast, kvcert.kernels,
#: kvcert.reference)
PACKAGES = ("kvcert", "fast", "kernels", "reference")
#: the longest a function or method may be, docstring included
MAX_FUNCTION_LINES = 100
#: functions allowed past MAX_FUNCTION_LINES for their docstring: a numpydoc API reference (the estimator, its
#: variance, every argument and edge case) so long that with the signature it is over the limit before any code.
#: The docstring stays whole; the code after it is split into phases and held to MAX_CODE_LINES_AFTER_A_LONG_DOCSTRING.
#: An entry whose signature and docstring fit the limit, or whose function is gone, fails the test.
LONG_DOCSTRINGS = {
    # the torch backend's token estimator: its formulas, its two paths and the numerics of each output field
    "fast/estimators.py:hajek_attention": "the API reference: signature and docstring alone are over the limit",
    # the Triton decode kernel: the one-pass and Chan-merged moment modes, the tail pass, the launch options
    "kernels/hajek.py:hajek_attention": "the API reference: signature and docstring alone are over the limit",
    # the reference's eviction event: every design, the quantized certificates and their memory accounting
    "reference/sketch.py:evict_and_certify": "the API reference: signature and docstring alone are over the limit",
}
#: the most lines a LONG_DOCSTRINGS function may hold after its docstring
MAX_CODE_LINES_AFTER_A_LONG_DOCSTRING = 40


def _functions(path: Path):
    """(name, first line, lines, lines up to the end of the docstring) of every function and method of a file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0]
            has_doc = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                       and isinstance(first.value.value, str))
            head = (first.end_lineno if has_doc else first.lineno - 1) - node.lineno + 1
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1, head


def _long_functions(root: Path, folders, allowed: dict) -> list:
    """The functions of ``folders`` over MAX_FUNCTION_LINES but those ``allowed`` names whose signature and
    docstring alone are over it and whose code after the docstring is short; and the stale entries of
    ``allowed``."""
    found, bad = set(), []
    for p in sorted(p for d in folders for p in (root / d).rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        for name, line, n, head in _functions(p):
            if n <= MAX_FUNCTION_LINES:
                continue
            if f"{rel}:{name}" not in allowed or head <= MAX_FUNCTION_LINES:
                bad.append(f"{rel}:{line} {name} ({n} lines)")
            elif n - head > MAX_CODE_LINES_AFTER_A_LONG_DOCSTRING:
                bad.append(f"{rel}:{line} {name} ({n - head} lines after its docstring, allowed "
                           f"{MAX_CODE_LINES_AFTER_A_LONG_DOCSTRING})")
            found.add(f"{rel}:{name}")
    bad += [f"{key}: no function over {MAX_FUNCTION_LINES} lines (drop it from LONG_DOCSTRINGS)"
            for key in allowed if key not in found]
    return bad


def test_no_function_is_over_100_lines():
    """Every function of the package and of its backends reads in one screen or two: split a longer one (a
    phase, a protocol, a check) rather than let it grow; only a docstring that is the API reference may make
    it longer (LONG_DOCSTRINGS)."""
    long = _long_functions(ROOT, PACKAGES, LONG_DOCSTRINGS)
    assert not long, "functions over %d lines:\n  " % MAX_FUNCTION_LINES + "\n  ".join(long)


def test_the_rule_sees_a_long_function(tmp_path):
    """Negative control: a 101-line function is found."""
    body = "\n".join(f"    x{i} = {i}" for i in range(100))
    (tmp_path / "m.py").write_text(f"def f():\n{body}\n")
    assert [n for _, _, n, _ in _functions(tmp_path / "m.py")] == [101]
    assert _long_functions(tmp_path, (".",), {}) == ["m.py:1 f (101 lines)"]


def test_the_rule_allows_only_a_long_docstring(tmp_path):
    """Negative controls of LONG_DOCSTRINGS: a listed function over the limit by its docstring alone passes; a
    listed one with long code after it fails, so does one whose docstring fits the limit, and an entry
    naming a short function."""
    def f(name, doc, code):
        return f'def {name}():\n    """' + "\n".join(["Doc."] * doc) + '"""\n' + "".join(
            f"    x{i} = {i}\n" for i in range(code)) + "\n\n"

    (tmp_path / "m.py").write_text(f("ok", 101, 10) + f("code", 101, 41) + f("doc", 90, 20) + f("short", 1, 1))
    allowed = dict.fromkeys(("m.py:ok", "m.py:code", "m.py:doc", "m.py:short"), "docstring")
    assert _long_functions(tmp_path, (".",), allowed) == [
        "m.py:115 code (41 lines after its docstring, allowed 40)", "m.py:260 doc (111 lines)",
        "m.py:short: no function over 100 lines (drop it from LONG_DOCSTRINGS)"]


#: the names the operations had before each got one name (docs/architecture.md "Names"): the old public
#: names of kvcert.fast and kvcert.kernels (their RENAMED tables) and the vLLM backend's route functions
RETIRED = {"cluster_hajek_attention", "paged_hajek_attention_compacted", "cluster_step", "compacted_decode",
           "masked_decode", "sketched_decode", "masked_chunks", "MaskedChunk"}


def _retired_uses(paths, root):
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


# ---------------------------------------------------------------------------------------------
# the dependency diagram of docs/architecture.md is the code's (issue 51 item 8)
# ---------------------------------------------------------------------------------------------
#: where each source folder is imported from
IMPORT_ROOTS = {"reference": "kvcert.reference", "fast": "kvcert.fast", "kernels": "kvcert.kernels",
                "kvcert": "kvcert", "paper_repro": "paper_repro"}
#: the diagram's components, most specific first: a module belongs to the first whose name prefixes its own
COMPONENTS = ("kvcert.reference", "kvcert.fast", "kvcert.kernels.cpu", "kvcert.kernels", "kvcert.records",
              "kvcert.cache", "kvcert.dispatch", "kvcert.escalation", "kvcert.calibration", "kvcert.models",
              "kvcert.attention", "kvcert.presses", "kvcert.generation", "kvcert.vllm", "paper_repro", "kvcert")
#: the fenced block of docs/architecture.md that draws the components' imports
DIAGRAM = ROOT / "docs" / "architecture.md"


def _module_names(root: Path) -> dict:
    """Import name -> file of every module of the library and paper_repro under ``root``."""
    names = {}
    for folder, top in IMPORT_ROOTS.items():
        for p in sorted((root / folder).rglob("*.py")):
            rel = p.relative_to(root / folder).with_suffix("").parts
            if folder == "kvcert" and rel[0] in ("fast", "kernels", "reference"):
                continue
            rel = rel[:-1] if rel[-1] == "__init__" else rel
            names[".".join((top, *rel))] = p
    return names


def _imported(node, module: str, is_package: bool, names: dict) -> list:
    """The modules an import statement of ``module`` names (``from X import y`` names X.y when that is a
    module; relative imports resolved)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.Call):  # importlib.import_module("a.b") with a literal name
        return [node.args[0].value]
    base = node.module or ""
    if node.level:
        parts = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
        base = ".".join(parts + ([node.module] if node.module else []))
    found = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in names]
    return found or [base]


def _literal_import_module(node) -> bool:
    """Whether ``node`` is a call ``import_module("literal")`` (``importlib.import_module``)."""
    return (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and len(node.args) >= 1 and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str))


def _component(module: str):
    return next((c for c in COMPONENTS if module == c or module.startswith(c + ".")), None)


def import_graph(root: Path) -> set:
    """The component-level import edges (a, b) of the tree at ``root``, a != b, every import counted (a
    function's lazy import, ``importlib.import_module`` of a literal name); imports of modules outside the
    library are not edges, nor is the package's lazy table of public names (``kvcert.__getattr__``)."""
    names = _module_names(root)
    edges = set()
    for module, path in names.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) and not _literal_import_module(node):
                continue
            for target in _imported(node, module, path.name == "__init__.py", names):
                a, b = _component(module), _component(target)
                if b is not None and a != b:
                    edges.add((a, b))
    return edges


def diagram(edges: set) -> str:
    """The mermaid block that draws ``edges`` (a --> b: a imports b), as docs/architecture.md holds it."""
    nodes = sorted({n for e in edges for n in e})
    ident = {n: "face" if n == "kvcert" else n.replace(".", "_") for n in nodes}  # no line opens with "kvcert "
    lines = ["```mermaid", "%% imports: generated by tests/test_layout.py (import_graph); a --> b: a imports b",
             "graph TD"]
    lines += [f'    {ident[n]}["{n}"]' for n in nodes]
    lines += [f"    {ident[a]} --> {ident[b]}" for a, b in sorted(edges)]
    return "\n".join(lines + ["```"])


def _cycles(edges: set) -> list:
    """The components on a cycle of ``edges`` (empty when the graph is layered)."""
    graph = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    state, on_cycle = {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                on_cycle.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return on_cycle


def test_the_architecture_diagram_is_the_code():
    """docs/architecture.md's import diagram draws exactly the code's component-level import edges, and they form
    layers (no cycle). On a mismatch the message prints the block to paste."""
    code = import_graph(ROOT)
    block = diagram(code)
    assert block in DIAGRAM.read_text(), f"docs/architecture.md's import diagram is not the code's; paste:\n{block}"
    assert not _cycles(code), _cycles(code)


def test_the_diagram_rule_sees_an_undrawn_import_and_a_cycle(tmp_path):
    """Negative control: a lazy import the diagram does not draw is an edge of the code, and an upward import
    closes a cycle."""
    for folder in IMPORT_ROOTS:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "fast" / "design.py").write_text("import numpy\nfrom . import estimators\n")
    (tmp_path / "fast" / "estimators.py").write_text("def f():\n    from kvcert import dispatch\n")
    (tmp_path / "kvcert" / "cache.py").write_text("import importlib\nM = importlib.import_module('kvcert.records')\n")
    (tmp_path / "kvcert" / "dispatch.py").write_text("from kvcert.fast.design import x\n")
    edges = import_graph(tmp_path)
    assert edges == {("kvcert.fast", "kvcert.dispatch"), ("kvcert.dispatch", "kvcert.fast"),
                     ("kvcert.cache", "kvcert.records")}
    assert _cycles(edges) and not _cycles({("kvcert.dispatch", "kvcert.fast")})
    drawn = diagram({("kvcert.dispatch", "kvcert.fast"), ("kvcert.cache", "kvcert.records")})
    assert drawn not in diagram(edges) and diagram(edges) != drawn


#: characters no source or document here holds: what a LaTeX escape becomes when it is written through a
#: non-raw Python string (\f of \frac -> form feed, \b of \beta / \big -> backspace, \t of \tau -> tab, \r of
#: \rho -> carriage return, \a -> bell, \v -> vertical tab)
CONTROL = re.compile("[\x07\x08\x0b\x0c\r\t]")
TEXT_FOLDERS = ("kvcert", "fast", "kernels", "reference", "paper_repro", "benchmarks", "tests", "docs")


def _control_characters(root: Path, folders) -> list:
    """``path:line`` of every .py and .md file under ``folders`` with a CONTROL character."""
    bad = []
    for p in sorted(p for d in folders for p in (root / d).rglob("*") if p.suffix in (".py", ".md")):
        for i, line in enumerate(p.read_text(errors="replace").split("\n"), 1):
            if CONTROL.search(line):
                bad.append(f"{p.relative_to(root).as_posix()}:{i}: {line[:60]!r}")
    return bad


def test_no_escape_became_a_control_character():
    bad = _control_characters(ROOT, TEXT_FOLDERS)
    assert not bad, f"control characters (a LaTeX escape written through a non-raw string?): {bad[:5]}"


def test_the_control_character_rule_sees_a_form_feed(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("ok\n$\x0crac12$\n")
    assert _control_characters(tmp_path, ("docs",)) == ["docs/a.md:2: '$\\x0crac12$'"]
