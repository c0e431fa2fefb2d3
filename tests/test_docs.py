"""The documents cite what exists, and results.md's hand-written parts are its generator's.

Checked in README.md and every docs/*.md (the research logs under docs/research/ are dated records of
what was tried and are left out):

- a repository file a document cites (a Markdown link, or a path such as ``kvcert/cli.py`` or
  ``tests/test_cli.py::test_name``) exists, and a cited test function is defined in its file; a
  ``pkg/module.py`` path also resolves when ``pkg/module/`` is a package (a module turned package);
  paths under git-ignored run outputs (``paper_repro/out/``) and patterns (``*``, ``<name>``) are not
  checked;
- a dotted name ``kvcert.xxx``, ``kvcert.fast.xxx``, ``kvcert.reference.xxx`` (any depth) or
  ``paper_repro.xxx`` resolves by import and attribute lookup (a dataclass field counts); a name
  whose import needs a package this venv lacks (``kvcert.vllm`` without vLLM) is skipped, not passed;
- a ``kvcert <subcommand> --option`` command line (in code) names a subcommand and options the
  CLI's parser defines; ``python -m paper_repro`` / ``kvcert-repro`` options are the reproduction's,
  and ``python <script>.py --option`` options appear in the script's source;
- a ``make <target>`` (in code) names a target of the Makefile.

Each test collects every failure and reports them all at once.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _rel(doc: Path) -> str:
    return doc.relative_to(ROOT).as_posix() if doc.is_relative_to(ROOT) else doc.name


# ------------------------------------------------------------------ reading Markdown

_FENCE = re.compile(r"^\s*(```|~~~)")
_SPAN = re.compile(r"(`+)(.+?)\1")


def code_segments(text: str) -> list[tuple[int, str]]:
    """(line number, code) for every line of a fenced or indented (4 spaces) block and every inline span."""
    out, fenced = [], False
    for no, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            out.append((no, line))
            continue
        out += [(no, m[2]) for m in _SPAN.finditer(line)]
    return out


_SEPARATORS = re.compile(r"\s*(?:&&|\|\||[;|()]|\$\(|`)\s*")
_PREFIXES = {"$", "time", "sudo", "exec", "then", "do"}
_ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")


def commands(segment: str) -> list[list[str]]:
    """The shell commands of a code segment as token lists, without prompts, ``time``, ``VAR=value`` and
    ``timeout N`` prefixes."""
    out = []
    segment = re.split(r"(?:^|\s)#", segment, maxsplit=1)[0]  # a shell comment
    for part in _SEPARATORS.split(segment):
        tokens = part.split()
        while tokens:
            if tokens[0] in _PREFIXES or _ENV.match(tokens[0]):
                tokens = tokens[1:]
            elif tokens[0] == "timeout" and len(tokens) > 1:
                tokens = tokens[2:]
            else:
                break
        if tokens:
            out.append([t.rstrip(",.") for t in tokens])
    return out


# ------------------------------------------------------------------ file paths

_TOP = ("kvcert", "fast", "reference", "kernels", "tests", "benchmarks", "paper_repro", "docs", "research",
        "figures")
_PATH = re.compile(r"(?<![\w./~$-])((?:%s)/[\w./:*<>{}\[\]-]*)" % "|".join(_TOP))
_ROOT_FILES = re.compile(r"(?<![\w./-])(README\.md|Makefile|pyproject\.toml)(?![\w.-])")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
#: what a command writes, not what the repository holds: the path after --out, --benchmark-json or ">"
_OUTPUT = re.compile(r"(?:--out|--benchmark-json|--json-out|>)[= ]?$")


def _ignored_prefixes() -> list[str]:
    """Run outputs the repository ignores (``.gitignore`` entries with a folder in them)."""
    gitignore = ROOT / ".gitignore"
    lines = gitignore.read_text().splitlines() if gitignore.exists() else []
    return [x.strip().lstrip("/") for x in lines if "/" in x.strip().rstrip("/") and not x.startswith("#")]


def _exists(path: str, doc: Path) -> bool:
    for base in (ROOT, doc.parent):
        p = base / path
        if p.exists():
            return True
        if p.suffix == ".py" and (p.with_suffix("") / "__init__.py").exists():
            return True  # a module that became a package
        if not p.suffix and p.with_suffix(".py").exists():
            return True  # a module named by its path without ".py" (fast/estimators)
    return False


def cited_paths(doc: Path) -> list[tuple[int, str]]:
    out = []
    for no, line in enumerate(doc.read_text().splitlines(), 1):
        for m in _LINK.finditer(line):
            target = m[1].split("#")[0]
            if target and not re.match(r"^[a-z]+:", target):
                out.append((no, target))
        out += [(no, m[1]) for m in _PATH.finditer(line) if not _OUTPUT.search(line[:m.start()])]
        out += [(no, m[1]) for m in _ROOT_FILES.finditer(line)]
    return out


def path_failures(doc: Path) -> list[str]:
    ignored = _ignored_prefixes()
    failures = []
    for no, cited in cited_paths(doc):
        path, _, test = cited.partition("::")
        path = re.sub(r":\d+(-\d+)?$", "", path).rstrip(".,:;")
        if not path or any(ch in path for ch in "*<>{}[]") or any(path.startswith(p) for p in ignored):
            continue
        if not _exists(path, doc):
            failures.append(f"{_rel(doc)}:{no}: {cited!r} does not exist")
            continue
        if test:
            source = next((b / path for b in (ROOT, doc.parent) if (b / path).is_file()), None)
            name = test.split("::")[-1].split("[")[0]
            if source is not None and not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(name)}\b",
                                                    source.read_text(), re.M):
                failures.append(f"{_rel(doc)}:{no}: {cited!r}: no {name} in {path}")
    return failures


# ------------------------------------------------------------------ dotted names

_NAME = re.compile(r"(?<![\w./-])((?:kvcert|paper_repro)(?:\.[A-Za-z_]\w*)+)(?![\w-]|\.[A-Za-z_])")
_NOT_NAMES = {"py", "md", "json", "toml", "txt", "egg", "log", "png"}


class _Missing(Exception):
    """A name whose import needs a package this environment lacks."""


def _raise_if_missing_dependency(name: str, error: ImportError) -> None:
    """:class:`_Missing` when ``error`` is about a third-party package this environment does not have."""
    top = (error.name or "").split(".")[0]
    if not top or top in ("kvcert", "paper_repro"):
        return
    spec = importlib.util.find_spec(top)
    if spec is None or spec.origin is None:  # absent, or only a folder of that name (tests/vllm) on sys.path
        raise _Missing(f"{name} needs {top}") from error


def resolve(name: str):
    """The object a dotted name denotes (import of the longest module prefix, then attributes)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ImportError as e:
            if isinstance(e, ModuleNotFoundError) and e.name is not None and (
                    module == e.name or module.startswith(e.name + ".")):
                continue  # this prefix is not a module: an attribute of a shorter one
            _raise_if_missing_dependency(name, e)
            raise
        for attr in parts[i:]:
            try:
                obj = getattr(obj, attr)
            except ImportError as e:
                _raise_if_missing_dependency(name, e)
                raise
            except AttributeError:
                fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
                if attr in fields or attr in getattr(obj, "__annotations__", {}):
                    obj = None
                    continue
                raise
        return obj
    raise AttributeError(name)


def cited_names(doc: Path) -> list[tuple[int, str]]:
    out = []
    for no, line in enumerate(doc.read_text().splitlines(), 1):
        out += [(no, m[1]) for m in _NAME.finditer(line) if m[1].rsplit(".", 1)[-1] not in _NOT_NAMES]
    return out


def name_failures(doc: Path, skipped: list[str]) -> list[str]:
    failures = []
    for no, name in cited_names(doc):
        try:
            resolve(name)
        except _Missing as e:
            skipped.append(f"{_rel(doc)}:{no}: {e}")
        except (AttributeError, ImportError) as e:
            failures.append(f"{_rel(doc)}:{no}: {name} does not resolve ({type(e).__name__}: {e})")
    return failures


# ------------------------------------------------------------------ command lines and make targets

def _options(parser) -> set[str]:
    return set(parser._option_string_actions)  # argparse keeps every option string here


def cli_failures(doc: Path) -> list[str]:
    from kvcert import cli
    from paper_repro.__main__ import build_parser as repro_parser

    parser = cli.build_parser()
    subparsers = {name: p for action in parser._subparsers._group_actions for name, p in action.choices.items()}
    repro = _options(repro_parser())
    intercepted = set(re.findall(r"argv\[0\] == \"([\w-]+)\"", inspect.getsource(cli.main)))
    failures = []
    for no, segment in code_segments(doc.read_text()):
        for tokens in commands(segment):
            head, rest = tokens[0], tokens[1:]
            options = [t.split("=")[0] for t in rest if t.startswith("--") and len(t) > 2]
            where = f"{_rel(doc)}:{no}: `{' '.join(tokens)}`"
            if head == "kvcert":
                words = [t for t in rest if not t.startswith("-")]
                if words and not re.fullmatch(r"[a-z][\w-]*", words[0]):
                    continue  # not a command line (kvcert = "..." in TOML, kvcert[hf])
                if words and words[0] in intercepted:
                    continue  # a word main() answers itself (kvcert repro prints where the reproduction is)
                if not words:
                    failures += [f"{where}: kvcert has no option {o}" for o in options
                                 if o not in _options(parser)]
                    continue
                sub = subparsers.get(words[0])
                if sub is None:
                    failures.append(f"{where}: kvcert has no subcommand {words[0]!r} (it has {sorted(subparsers)})")
                    continue
                failures += [f"{where}: kvcert {words[0]} has no option {o}" for o in options
                             if o not in _options(sub) | _options(parser)]
            elif head == "kvcert-repro" or (head.endswith(("python", "python3")) and rest[:2] == ["-m", "paper_repro"]):
                failures += [f"{where}: the reproduction has no option {o}" for o in options if o not in repro]
            elif head.endswith(("python", "python3")) and rest and rest[0].endswith(".py"):
                script = ROOT / rest[0]
                if not script.is_file():
                    failures.append(f"{where}: no script {rest[0]}")
                    continue
                source = script.read_text()
                failures += [f"{where}: {rest[0]} defines no option {o}" for o in options
                             if f'"{o}"' not in source and f"'{o}'" not in source]
    return failures


def make_targets() -> set[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\- ]+?)\s*:(?![=:])", line)
        if m:
            targets.update(m[1].split())
        if line.startswith(".PHONY:"):
            targets.update(line.split(":", 1)[1].split())
    return targets - {".PHONY"}


def make_failures(doc: Path) -> list[str]:
    targets = make_targets()
    failures = []
    for no, segment in code_segments(doc.read_text()):
        for tokens in commands(segment):
            if tokens[0] != "make":
                continue
            for t in tokens[1:]:
                if t.startswith("-") or "=" in t:
                    continue
                if t not in targets:
                    failures.append(f"{_rel(doc)}:{no}: make has no target {t!r} (Makefile: {sorted(targets)})")
    return failures


# ------------------------------------------------------------------ the tests

@pytest.fixture(scope="module", autouse=True)
def _interpreted_kernels():
    """kvcert.kernels imports Triton, which needs the interpreter on a machine without a GPU."""
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _report(failures: list[str]) -> str:
    return f"{len(failures)} stale citation(s):\n" + "\n".join(failures)


def test_cited_files_exist():
    failures = [f for doc in DOC_FILES for f in path_failures(doc)]
    assert not failures, _report(failures)


def test_cited_names_resolve():
    skipped: list[str] = []
    failures = [f for doc in DOC_FILES for f in name_failures(doc, skipped)]
    if skipped:
        print("not checked here (a package this venv lacks):\n" + "\n".join(skipped))
    assert not failures, _report(failures)


def test_cited_command_lines_exist():
    failures = [f for doc in DOC_FILES for f in cli_failures(doc)]
    assert not failures, _report(failures)


def test_cited_make_targets_exist():
    failures = [f for doc in DOC_FILES for f in make_failures(doc)]
    assert not failures, _report(failures)


# the checker itself: each kind of stale citation is caught (a checker that passes everything passes here too)

def test_checker_catches_each_kind_of_stale_citation(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("\n".join([
        "See [the CLI](../kvcert/no_such_module.py), `tests/test_cli.py::test_no_such_test` and kvcert/cli.py.",
        "Call `kvcert.no_such_function(x)` or `kvcert.fast.no_such_name`; `kvcert.generate` exists.",
        "    kvcert generate --prompt hi --no-such-option",
        "    kvcert no-such-subcommand --prompt hi",
        "    python -m paper_repro --quick --no-such-flag",
        "Then `make no-such-target` (or `make test`).",
        "```bash",
        "python benchmarks/bench_generate.py --tokens 2000 --no-such-script-option",
        "```",
    ]))
    paths = path_failures(doc)
    assert len(paths) == 2 and "no_such_module.py" in paths[0] and "no test_no_such_test" in paths[1], paths
    names = name_failures(doc, [])
    assert [f.split(": ")[1].split()[0] for f in names] == ["kvcert.no_such_function", "kvcert.fast.no_such_name"]
    cli = cli_failures(doc)
    assert len(cli) == 4, cli
    for bad in ("--no-such-option", "'no-such-subcommand'", "--no-such-flag", "--no-such-script-option"):
        assert sum(bad in f for f in cli) == 1, (bad, cli)
    make = make_failures(doc)
    assert len(make) == 1 and "'no-such-target'" in make[0], make


def test_checker_accepts_a_module_turned_package(tmp_path):
    """``pkg/module.py`` cited while the module is now ``pkg/module/`` (a package) still resolves."""
    packages = [p for p in (ROOT / "kvcert").iterdir() if (p / "__init__.py").exists()]
    assert packages, "kvcert has no subpackage to try this on"
    doc = tmp_path / "doc.md"
    doc.write_text(f"The code is in kvcert/{packages[0].name}.py and kvcert/no_such_thing.py.")
    failures = path_failures(doc)
    assert len(failures) == 1 and "no_such_thing" in failures[0], failures


# ------------------------------------------------------------------ results.md against its generator

def _static_results(report, cfg) -> str:
    """What the generator writes before the run's numbers: the title, the setting, the design paragraph and
    the changes (up to the headline table), with the run's own sentence normalized."""
    text = report.results_markdown({}, {"seconds": {"total": 0.0}}, cfg, day="DAY", commit="COMMIT")
    return text[:text.index("## Headline figures")]


def test_results_md_hand_written_parts_are_the_generators():
    """docs/results.md says "do not edit by hand": each part its generator writes from committed inputs
    (the setting, the changes, the quoted sketch table with its provenance note, the sketched-design
    section's text) is exactly what paper_repro/report.py writes now. Regenerate with `make repro` (or
    edit paper_repro/report.py, not results.md) when this fails."""
    from paper_repro import report
    from paper_repro.common import Config

    doc = (ROOT / "docs" / "results.md").read_text()
    assert report.LAST_RUN.search(doc), "results.md lost its 'Last run: ... s in all.' sentence"
    normalize = lambda text: report.LAST_RUN.sub("Last run: <run>.", text)  # noqa: E731
    expected = normalize(_static_results(report, Config(quick=True, progress=False)))
    got = normalize(doc)[:len(expected)]
    if got != expected:
        diff = next(i for i, (a, b) in enumerate(zip(got.splitlines(), expected.splitlines())) if a != b)
        pytest.fail(f"results.md line {diff + 1} differs from paper_repro/report.py's:\n"
                    f"  results.md: {got.splitlines()[diff][:300]}\n  generator:  {expected.splitlines()[diff][:300]}")
    section = "\n".join(report._sketch_section())
    assert section, "the sketch goal table's source is missing"
    assert section in doc, "the quoted sketch goal table (and its note) differ from what the generator quotes"
    note = report._sketch_section()[-2]
    assert "hull cap" in note and "before it" in note, "the quote no longer says which rows carry the hull cap"
    payoff = report._sketch_payoff({"sketch_t3": {f"acc_poisson_{name}": 0.0 for name in report.SKETCHES}})
    prose = [line for line in payoff if line and not line.startswith("|")]
    assert prose and all(line in doc for line in prose), "the sketched-design section's text differs"


def test_results_md_check_catches_a_hand_edit(monkeypatch):
    """The comparison above fails when a hand-written part changes: the generator's own text, edited."""
    from paper_repro import report
    from paper_repro.common import Config

    cfg = Config(quick=True, progress=False)
    before = _static_results(report, cfg)
    monkeypatch.setattr(report, "CHANGES", [*report.CHANGES[:-1], report.CHANGES[-1] + " (edited)"])
    assert _static_results(report, cfg) != before
