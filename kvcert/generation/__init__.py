"""``kvcert.generate`` and its protocols: text generation under a press, with per-step certificates.

Two protocols (the names are kvpress's evaluation settings), one module each,
beside the shared exact prefill and what they all share:

- **query-aware** (:mod:`.query_aware`, :func:`generate` with a prompt): one
  prefill over the whole prompt, question included (exact attention; the
  press compresses each layer right after it), then one forward per
  generated token over the compressed cache with the Hajek-corrected
  attention;
- **query-agnostic** (:mod:`.query_agnostic`, :func:`compress_context`, then
  :func:`answer` or ``generate(..., context=...)``): kvpress's
  ``kv-press-text-generation`` pipeline. The context alone is prefilled and
  compressed once; each question (with the chat template's end of turn and
  an optional answer prefix) is then prefilled over the compressed context,
  never compressed, and answered greedily, every question from the same
  compressed context;
- the shared exact prefill (:mod:`.prefilled`, :func:`prefill` and
  :class:`Prefill`; :func:`prefill_context` for a context): one prefill
  reused under several presses;
- :mod:`.calibrate`: :func:`calibrate`, an escalation policy calibrated on a
  user's prompts (:mod:`kvcert.calibration`);
- :mod:`.common`: the result type :class:`GenerationResult`, prompt encoding
  (:func:`encode_prompts`) and the decode loop.

Every forward over a compressed cache records a certificate per layer and
query head (:class:`kvcert.attention.Certificates`).
"""

from __future__ import annotations

from .calibrate import CalibrationRecord, calibrate
from .common import QUERY_AGNOSTIC, QUERY_AWARE, GenerationResult, encode_prompts
from .prefilled import Prefill, prefill
from .query_agnostic import CompressedContext, answer, answer_certificates, compress_context, prefill_context
from .query_aware import generate

__all__ = ["GenerationResult", "Prefill", "CompressedContext", "generate", "prefill", "compress_context", "answer",
           "answer_certificates", "encode_prompts", "prefill_context", "QUERY_AWARE", "QUERY_AGNOSTIC", "calibrate",
           "CalibrationRecord"]
