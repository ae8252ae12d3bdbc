"""The ``edgeinfer`` command: run, chat, serve, info, list, pull, eval, bench.

Output is for people by default and JSON with ``--json``. Every user error is
one line on stderr (``error: ...``) and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from edgeinfer.console import EXIT_INTERRUPTED
from edgeinfer.errors import ContextFull, EdgeInferError
from edgeinfer.kv import DEFAULT_KV_BUDGET, DEFAULT_PROMPT_CACHE_SIZE, MIN_KV_TOKENS, POLICIES
from edgeinfer.models.catalog import DEFAULT_MODEL
from edgeinfer.notes import show_notes
from edgeinfer.sampling import SamplingParams
from edgeinfer.speculative import Speculation

if TYPE_CHECKING:
    from edgeinfer.assemble import Route
    from edgeinfer.converters.convert import Step
    from edgeinfer.models.info import ModelInfo
    from edgeinfer.streams import Stream

_SAMPLING = SamplingParams()
# Every KV type some registered backend supports, written out so that the command starts without
# importing llama.cpp; a backend refuses a type it lacks, naming its own.
KV_TYPES = ("f16", "q8_0", "f32")

F = TypeVar("F", bound=Callable[..., Any])

EXIT_ERROR = 1
EXIT_USAGE = 2


def _fail(message: str, code: int = EXIT_ERROR) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _user_errors(fn: F) -> F:
    """Turn the errors a user can fix into one line on stderr."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except EdgeInferError as exc:
            _fail(str(exc))
        except KeyboardInterrupt:
            click.echo("", err=True)
            sys.exit(EXIT_INTERRUPTED)
        except BrokenPipeError:  # `edgeinfer run ... | head`: the reader has all it wants
            # Point stdout at /dev/null so the interpreter's final flush does not fail again.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(0)
        except Exception as exc:
            if isinstance(exc, OSError) and exc.filename is None:  # stdout: a full disk, a closed descriptor
                _fail(f"cannot write the output: {exc.strerror or exc}")
            # A bug, not a user error: still one line; EDGEINFER_DEBUG=1 shows the traceback.
            if os.environ.get("EDGEINFER_DEBUG"):
                raise
            _fail(f"internal error ({type(exc).__name__}: {' '.join(str(exc).split())}); "
                  "rerun with EDGEINFER_DEBUG=1 and report the traceback")  # fmt: skip

    return wrapper  # type: ignore[return-value]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="edgeinfer")
def cli() -> None:
    """Run small GGUF language models on this machine."""
    show_notes()


def _placement_options(fn: F) -> F:
    """``--device`` and ``--gpu-layers``, for the commands that load a model to answer with."""
    fn = click.option(
        "--gpu-layers",
        type=click.IntRange(min=-1),
        default=-1,
        show_default=True,
        help="Layers placed on --device when it is a GPU (-1: all of them).",
    )(fn)
    return click.option(
        "--device",
        "--onnx-provider",
        "--opencl-device",
        "device",
        default="cpu",
        show_default=True,
        help="Where the model runs: cpu (the backend's default: the first Vulkan device for vulkan), or a device "
        "its backend offers, by name, by its index after the default, or by a part of its name or description; "
        "for vulkan, e.g. vulkan1; for the onnxruntime backend, an execution provider, e.g. CUDAExecutionProvider "
        "or cuda; for opencl, a platform:device index such as 0:1, or pocl (an unknown name lists them; "
        "`edgeinfer info` too).",
    )(fn)


# Options several commands take, each written once (click builds a new Option every time one is applied).
_model_option = click.option(
    "--model", "-m", default=DEFAULT_MODEL, show_default=True, help=".gguf path, catalog alias or hf:ORG/REPO/FILE.gguf"
)
_backend_option = click.option(
    "--backend", default="auto", show_default=True, help="Backend name (see `edgeinfer info`)."
)


def _kv_options(fn: F) -> F:
    """``--kv-budget``, ``--kv-policy`` and ``--kv-type``."""
    for option in reversed((
        click.option("--kv-budget", default=DEFAULT_KV_BUDGET, show_default=True,
                     help="KV cache cap: bytes ('64MB') or tokens ('512tok'); one total across all answers."),
        click.option("--kv-policy", type=click.Choice(POLICIES),
                     help="What to do when the KV cache fills (default: sinks; error for a model whose cache "
                     "cannot drop tokens)."),
        click.option("--kv-type", type=click.Choice(KV_TYPES),
                     help="KV cache element type (default: the backend's own: f16; f32 on onnxruntime, whose CPU "
                     "attention has no fast f16 kernel)."),
    )):  # fmt: skip
        fn = option(fn)
    return fn


def _speculative_options(fn: F) -> F:
    """``--speculative`` and ``--draft-model``."""
    for option in reversed((
        click.option("--speculative", type=click.Choice([s.value for s in Speculation]),
                     help="lookup (the default): draft tokens from the prompt and the answer so far and check them "
                     "in one pass, where that pays (the same text, faster where answers quote their input); draft "
                     "(the default with --draft-model): draft them with a smaller model; off: one token a pass."),
        click.option("--draft-model", help="A smaller model with the same vocabulary to draft with (.gguf path "
                     "or alias)."),
    )):  # fmt: skip
        fn = option(fn)
    return fn


def _prompt_cache_options(fn: F) -> F:
    """``--prompt-cache`` and ``--prompt-cache-size``."""
    for option in reversed((
        click.option("--prompt-cache", type=click.Path(file_okay=False, path_type=Path),
                     help="Keep each chat's system prompt's KV state in this folder, and read it from there at "
                     "the next start instead of evaluating it again."),
        click.option("--prompt-cache-size", default=DEFAULT_PROMPT_CACHE_SIZE, show_default=True,
                     help="The most the prompt cache folder holds; the least recently used go first."),
    )):  # fmt: skip
        fn = option(fn)
    return fn


def _route_options(fn: F) -> F:
    """``--route`` and the cloud model's options, for the commands that answer through the router."""
    for option in reversed((
        click.option("--route", type=click.Choice(("auto", "local", "cloud")),
                     help="Where to answer: auto escalates hard prompts to the cloud (default: auto with a cloud "
                     "URL, else local)."),
        click.option("--cloud-url", envvar="EDGEINFER_CLOUD_URL",
                     help="OpenAI-compatible API base, e.g. https://host/v1."),
        click.option("--cloud-model", envvar="EDGEINFER_CLOUD_MODEL",
                     help="The cloud model's name; key: OPENAI_API_KEY."),
        click.option("--route-threshold", type=float,
                     help="Escalation score at which auto goes to the cloud (default 0.64, 1.81 with "
                     "--route-samples; see `edgeinfer router calibrate`)."),
        click.option("--route-samples", type=click.IntRange(min=0), default=0,
                     help="auto: also sample this many short local answers and escalate when they disagree "
                     "(a better judge, slower first token; calibrate with the same --samples)."),
    )):  # fmt: skip
        fn = option(fn)
    return fn


def main(args: list[str] | None = None, prog_name: str = "edgeinfer") -> None:
    """The console entry point: click's usage errors become one line too."""
    try:
        code = cli.main(args=args, prog_name=prog_name, standalone_mode=False)
    except click.UsageError as exc:
        command = exc.ctx.command_path if exc.ctx else prog_name
        _fail(f"{exc.format_message()} (see '{command} --help')", EXIT_USAGE)
    except click.ClickException as exc:
        _fail(exc.format_message())
    except click.Abort:  # Ctrl-C while click itself was reading input
        sys.exit(EXIT_INTERRUPTED)
    sys.exit(code if isinstance(code, int) else 0)


@cli.command()
@click.argument("prompt", required=False)
@_model_option
@_backend_option
@click.option("--system", "system_prompt", help="System prompt.")
@click.option("--max-tokens", type=int, default=_SAMPLING.max_tokens, show_default=True)
@click.option("--temperature", type=float, default=_SAMPLING.temperature, show_default=True, help="0 is greedy.")
@click.option("--top-p", type=float, default=_SAMPLING.top_p, show_default=True)
@click.option("--top-k", type=int, default=_SAMPLING.top_k, show_default=True, help="0 switches it off.")
@click.option("--min-p", type=float, default=_SAMPLING.min_p, show_default=True)
@click.option(
    "--repeat-penalty", type=float, default=_SAMPLING.repetition_penalty, show_default=True, help="1 switches it off."
)
@click.option("--seed", type=int, help="Same seed, same text.")
@click.option("--stop", multiple=True, help="Stop when this text appears (repeatable); it is not printed.")
@_kv_options
@_speculative_options
@_prompt_cache_options
@click.option("--threads", type=int, help="CPU threads (default: the free cores).")
@_placement_options
@_route_options
@click.option("--stats", is_flag=True, help="Print route, timings and KV use to stderr afterwards.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: text, finish reason, metrics.")
@click.option("--no-stream", is_flag=True, help="Print the answer at the end instead of as it is generated.")
@click.option(
    "--raw", is_flag=True, help="Continue PROMPT as plain text, without the chat template (what a base model does)."
)
@click.option("--force", is_flag=True, help="Load even if the model does not seem to fit in RAM.")
@_user_errors
def run(
    prompt: str | None,
    model: str,
    backend: str,
    system_prompt: str | None,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float,
    repeat_penalty: float,
    seed: int | None,
    stop: tuple[str, ...],
    kv_budget: str,
    kv_policy: str | None,
    kv_type: str | None,
    speculative: str | None,
    draft_model: str | None,
    prompt_cache: Path | None,
    prompt_cache_size: str,
    threads: int | None,
    device: str,
    gpu_layers: int,
    route: str | None,
    cloud_url: str | None,
    cloud_model: str | None,
    route_threshold: float | None,
    route_samples: int,
    stats: bool,
    as_json: bool,
    no_stream: bool,
    raw: bool,
    force: bool,
) -> None:
    """Answer PROMPT (or standard input) with a local model, or a cloud model when it is beyond it."""
    from edgeinfer.assemble import close_answerer, open_answerer

    if prompt is None:
        prompt = _read_stdin_prompt()
    if not prompt.strip():
        _fail("the prompt is empty: pass some text as an argument or on standard input")
    for name, text in (("prompt", prompt), ("system prompt", system_prompt or "")):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            _fail(f"the {name} is not valid UTF-8 text; pass UTF-8")
    if sys.stdout is None:
        _fail("standard output is closed: there is nowhere to write the answer")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=repeat_penalty,
        seed=seed,
        stop=stop,
    )
    if raw and system_prompt:
        _fail("--raw continues the prompt as plain text, which has no system prompt: drop --system or --raw")
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": prompt}
    ]
    engine, answerer = open_answerer(
        _chosen_route(route, cloud_url, cloud_model, route_threshold, route_samples),
        model=model,
        backend=backend,
        kv_budget=kv_budget,
        kv_policy=kv_policy,
        kv_type=kv_type,
        speculative=speculative,
        draft=draft_model,
        prompt_cache=prompt_cache,
        prompt_cache_size=prompt_cache_size,
        threads=threads,
        device=device,
        gpu_layers=gpu_layers,
        force=force,
    )
    try:
        stream = answerer.stream(prompt if raw else messages, params)
        _answer(stream, threads=engine.threads, as_json=as_json, no_stream=no_stream, stats=stats)
    finally:
        close_answerer(engine, answerer)


@cli.command()
@_model_option
@_backend_option
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="Where to listen (0.0.0.0: all networks; use --api-key)."
)
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="0: any free port.")
@click.option("--parallel", type=click.IntRange(min=1), default=4, show_default=True, help="Requests decoded together.")
@click.option(
    "--max-queue",
    type=click.IntRange(min=0),
    default=16,
    show_default=True,
    help="Requests waiting for a slot; beyond them a request gets 429 with Retry-After.",
)
@click.option("--max-body", default="1MB", show_default=True, help="Largest request body accepted.")
@click.option("--api-key", envvar="EDGEINFER_API_KEY", help="Require 'Authorization: Bearer KEY' [EDGEINFER_API_KEY].")
@click.option(
    "--shutdown-timeout",
    type=click.FloatRange(min=0),
    default=10.0,
    show_default=True,
    help="On SIGTERM or Ctrl-C: seconds the requests in flight get to finish before they are cancelled.",
)
@_kv_options
@_speculative_options
@_prompt_cache_options
@click.option("--threads", type=int, help="CPU threads (default: the free cores).")
@_placement_options
@_route_options
@click.option("--force", is_flag=True, help="Load even if the model does not seem to fit in RAM.")
@_user_errors
def serve(
    model: str,
    backend: str,
    host: str,
    port: int,
    parallel: int,
    max_queue: int,
    max_body: str,
    api_key: str | None,
    shutdown_timeout: float,
    kv_budget: str,
    kv_policy: str | None,
    kv_type: str | None,
    speculative: str | None,
    draft_model: str | None,
    prompt_cache: Path | None,
    prompt_cache_size: str,
    threads: int | None,
    device: str,
    gpu_layers: int,
    route: str | None,
    cloud_url: str | None,
    cloud_model: str | None,
    route_threshold: float | None,
    route_samples: int,
    force: bool,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models,
    /health, /metrics), decoding up to --parallel requests together."""
    from functools import partial

    from edgeinfer.assemble import open_answerer
    from edgeinfer.kv import KVBudget, KVPolicy
    from edgeinfer.models.catalog import resolve_model
    from edgeinfer.sizes import parse_size

    try:
        from edgeinfer.serve.app import ServeConfig
        from edgeinfer.serve.runner import run_server
    except ImportError as exc:
        _fail(f"edgeinfer serve needs {exc.name}: pip install 'edgeinfer[serve]'")
    if api_key is not None and not api_key.strip():
        _fail("--api-key is empty; give a key, or leave the option out to serve without one")
    KVBudget.parse(kv_budget)
    KVPolicy.parse(kv_policy or "sinks")
    chosen = _chosen_route(route, cloud_url, cloud_model, route_threshold, route_samples)
    chosen.check()
    path = resolve_model(model)  # a missing model is one line now, not after the server has started
    config = ServeConfig(
        model_id=model if model == DEFAULT_MODEL or "/" not in model and not model.endswith(".gguf") else path.stem,
        parallel=parallel,
        max_queue=max_queue,
        max_body_bytes=parse_size(max_body, "--max-body"),
        api_key=api_key,
    )
    load = partial(
        open_answerer,
        chosen,
        model=str(path),
        backend=backend,
        kv_budget=kv_budget,
        kv_policy=kv_policy,
        kv_type=kv_type,
        speculative=speculative,
        draft=draft_model,
        prompt_cache=prompt_cache,
        prompt_cache_size=prompt_cache_size,
        threads=threads,
        # A slot for each request decoding, and as many again for the prompts they leave cached.
        sequences=2 * parallel,
        device=device,
        gpu_layers=gpu_layers,
        force=force,
    )
    click.echo(f"edgeinfer serve: loading {path.name} ...", err=True)

    def ready(url: str) -> None:
        click.echo(f"edgeinfer serve: ready at {url} ({config.model_id}, {parallel} parallel, route {chosen.mode})")
        sys.stdout.flush()

    run_server(config, load, host=host, port=port, shutdown_timeout=shutdown_timeout, ready=ready)


def _chosen_route(
    route: str | None, cloud_url: str | None, cloud_model: str | None, threshold: float | None, samples: int
) -> Route:
    """The route ``_route_options`` ask for; without ``--route``, auto where a cloud URL is given, else local."""
    from edgeinfer.assemble import Route

    return Route(route or ("auto" if cloud_url else "local"), cloud_url, cloud_model, threshold, samples)


def _answer(stream: Stream, *, threads: int, as_json: bool, no_stream: bool, stats: bool) -> None:
    """Print ``stream``'s answer as ``run`` was asked to, and its stats (``threads``: the engine's) on stderr."""
    with stream:
        try:
            if as_json or no_stream:
                for _ in stream:
                    pass
            else:
                for piece in stream:
                    click.echo(piece, nl=False)
                    sys.stdout.flush()
        except ContextFull as full:
            # What was generated before the cache filled is the user's: print it, then the error.
            if as_json:
                click.echo(json.dumps({"text": full.partial, "finish_reason": "context_full", "error": str(full)}))
            else:
                click.echo("" if not no_stream else full.partial)
            raise
        result = stream.result
        assert result is not None
        if as_json:
            click.echo(json.dumps(result.to_dict(), ensure_ascii=False))
        elif no_stream:
            click.echo(result.text)
        else:
            click.echo()  # the streamed answer's line ended before the warning: on a terminal they share a screen
        if result.metrics.prompt_cut:
            kept = result.metrics.prompt_tokens
            click.echo(
                f"warning: the prompt was {kept + result.metrics.prompt_cut} tokens; {kept} of them, its start and "
                f"end, fit the KV budget and were answered (raise --kv-budget to keep all)",
                err=True,
            )
        if stats:
            local = "" if result.backend == "cloud" else f" ({threads} threads)"  # none ran for a cloud answer
            click.echo(f"{'model':>12}: {result.model} on {result.backend}{local}", err=True)
            click.echo(
                f"{'route':>12}: {result.route}{' (degraded)' if getattr(result, 'degraded', False) else ''}", err=True
            )
            if getattr(result, "reason", ""):
                click.echo(f"{'reason':>12}: {result.reason}", err=True)
            if result.backend == "cloud":
                usage = result.cloud_usage  # type: ignore[attr-defined]
                click.echo(
                    f"{'cloud':>12}: {usage.prompt_tokens} prompt + {usage.completion_tokens} output tokens"
                    f"{' (counted here)' if usage.estimated else ''}, estimated cost {result.cloud_cost:.4f}",  # type: ignore[attr-defined]
                    err=True,
                )
            click.echo(f"{'finish':>12}: {result.finish_reason}", err=True)
            click.echo(result.metrics.format(), err=True)


def _read_stdin_prompt() -> str:
    """The prompt from standard input, read no further than the limit (`yes | edgeinfer run` never ends)."""
    from edgeinfer.chat import MAX_CONTENT_CHARS

    if sys.stdin is None:
        _fail("no prompt: pass it as an argument or on standard input (standard input is closed)")
    if sys.stdin.isatty():
        _fail("no prompt: pass it as an argument or on standard input")
    try:
        prompt = sys.stdin.read(MAX_CONTENT_CHARS + 1)
    except UnicodeDecodeError:
        _fail("the prompt on standard input is not valid UTF-8 text; pass UTF-8")
    if len(prompt) > MAX_CONTENT_CHARS:
        _fail(f"the prompt on standard input is over {MAX_CONTENT_CHARS:,} characters; pass a shorter one")
    return prompt


@cli.group()
def router() -> None:
    """Route prompts between this machine and a cloud model."""


@router.command()
@click.option("--questions", required=True, type=click.Path(dir_okay=False), help="JSON Lines: question, answers.")
@click.option("--cloud-share", type=float, default=0.3, show_default=True, help="Target share of cloud calls (0-1).")
@_model_option
@click.option("--system", "system_prompt", help="System prompt, as you will use it with `run`.")
@click.option("--max-tokens", type=int, default=48, show_default=True, help="Tokens per local answer.")
@click.option("--kv-budget", default=DEFAULT_KV_BUDGET, show_default=True)
@click.option("--threads", type=int, help="CPU threads (default: the free cores).")
@click.option(
    "--fit-weights",
    is_flag=True,
    help="Also fit the signals' weights to the graded answers (for another model; wants a few hundred questions).",
)
@click.option(
    "--samples",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Short local answers sampled per question for the disagreement signal, as `run --route-samples`.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_user_errors
def calibrate(
    questions: str,
    cloud_share: float,
    model: str,
    system_prompt: str | None,
    max_tokens: int,
    kv_budget: str,
    threads: int | None,
    fit_weights: bool,
    samples: int,
    as_json: bool,
) -> None:
    """Pick the auto threshold that sends --cloud-share of the questions to the cloud.

    The local model answers every question (greedy); the threshold is the escalation score
    above which that share of them lies. The accepted answers grade the local replies, to
    show how much quality the threshold would win back with a cloud that is always right.
    With --fit-weights, the weights of the signals are fitted to those grades first (a
    logistic regression; see edgeinfer/routing/calibration.py) and the threshold is for them.
    """
    import numpy as np

    from edgeinfer.chat import Message
    from edgeinfer.engine import Engine
    from edgeinfer.routing import calibration
    from edgeinfer.routing.calibration import auroc, is_correct, load_questions, recovery_curve, threshold_for_share
    from edgeinfer.routing.router import Policy, assess
    from edgeinfer.routing.signals import SCORED, WEIGHTS, escalation_score

    if not 0.0 <= cloud_share <= 1.0:
        _fail(f"--cloud-share must be between 0 and 1, got {cloud_share}")
    labelled = load_questions(questions)
    signals, correct = [], []
    with Engine(model, kv_budget=kv_budget, threads=threads) as engine:
        for i, q in enumerate(labelled, 1):
            system: list[Message] = [{"role": "system", "content": system_prompt}] if system_prompt else []
            found = assess(
                engine,
                [*system, {"role": "user", "content": q.question}],
                policy=Policy(samples=samples),
                temperature=0,
                max_tokens=max_tokens,
            )
            signals.append(found.signals)
            correct.append(is_correct(found.result.text, q.answers))
            click.echo(f"\r{i}/{len(labelled)} questions", nl=False, err=True)
    click.echo("", err=True)
    weights = dict(WEIGHTS)
    if fit_weights:
        weights = calibration.fit_weights(signals, [not c for c in correct], SCORED)
    scores = [escalation_score(s, weights) for s in signals]
    threshold = threshold_for_share(scores, cloud_share)
    share = float(np.mean(np.asarray(scores) >= threshold))
    shares, recovered = recovery_curve(scores, correct)
    report = {
        "threshold": round(threshold, 4),
        "questions": len(labelled),
        "cloud_share": share,
        "local_accuracy": float(np.mean(correct)),
        "gap_recovered": float(np.interp(share, shares, recovered)),
        "auroc": auroc(scores, [not c for c in correct]),
        "weights": weights,
        "samples": samples,
    }
    if as_json:
        click.echo(json.dumps(report))
        return
    click.echo(f"threshold {report['threshold']}: {share:.0%} of {len(labelled)} questions go to the cloud")
    click.echo(
        f"local accuracy {report['local_accuracy']:.1%}; with an always-right cloud this threshold wins back "
        f"{report['gap_recovered']:.0%} of the gap (random routing: {share:.0%}); AUROC {report['auroc']:.2f}"
    )
    if fit_weights:
        click.echo(f"weights fitted to these answers: {weights}")
        click.echo(f"use them: Policy('auto', threshold={report['threshold']}, weights={weights}, samples={samples})")
    else:
        with_samples = f" --route-samples {samples}" if samples else ""
        click.echo(f"use it: edgeinfer run --route auto --route-threshold {report['threshold']}{with_samples} ...")


@cli.command()
@_model_option
@_backend_option
@click.option("--system", "system_prompt", default="", help="System prompt.")
@click.option(
    "--route",
    type=click.Choice(("local", "auto", "cloud")),
    default="local",
    show_default=True,
    help="Where answers come from; auto and cloud need --cloud-url and --cloud-model (or their variables).",
)
@click.option("--cloud-url", envvar="EDGEINFER_CLOUD_URL", help="OpenAI-compatible base URL [EDGEINFER_CLOUD_URL].")
@click.option("--cloud-model", envvar="EDGEINFER_CLOUD_MODEL", help="The cloud model's name [EDGEINFER_CLOUD_MODEL].")
@click.option("--temperature", type=float, default=_SAMPLING.temperature, show_default=True, help="0 is greedy.")
@click.option("--max-tokens", type=int, default=_SAMPLING.max_tokens, show_default=True)
@click.option("--kv-budget", default=DEFAULT_KV_BUDGET, show_default=True, help="KV cache cap: '64MB' or '512tok'.")
@click.option(
    "--kv-policy",
    type=click.Choice(POLICIES),
    help="What to do when the KV cache fills (default: sinks; error for a model whose cache cannot drop tokens).",
)
@_speculative_options
@click.option("--threads", type=int, help="CPU threads for the model (default: the free cores but one, for the UI).")
@_placement_options
@_user_errors
def chat(
    model: str,
    backend: str,
    system_prompt: str,
    route: str,
    cloud_url: str | None,
    cloud_model: str | None,
    temperature: float,
    max_tokens: int,
    kv_budget: str,
    kv_policy: str | None,
    speculative: str | None,
    draft_model: str | None,
    threads: int | None,
    device: str,
    gpu_layers: int,
) -> None:
    """Chat with a model in the terminal (/help inside lists the commands)."""
    from edgeinfer.tui.app import ChatApp
    from edgeinfer.tui.settings import ChatSettings

    settings = ChatSettings(
        model=model,
        backend=backend,
        system=system_prompt,
        route=route,
        cloud_url=cloud_url,
        cloud_model=cloud_model,
        temperature=temperature,
        max_tokens=max_tokens,
        kv_budget=kv_budget,
        kv_policy=kv_policy,
        speculative=speculative,
        draft_model=draft_model,
        threads=threads,
        device=device,
        gpu_layers=gpu_layers,
    )
    settings.check()  # a bad option is one line now; a model that fails to load is shown in the chat
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        _fail("edgeinfer chat needs a terminal; in scripts and pipes use `edgeinfer run`")
    ChatApp(settings).run()


@cli.command()
@click.argument("model", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_user_errors
def info(model: str | None, as_json: bool) -> None:
    """This machine (CPU features, RAM, backends) and, given MODEL, its metadata and the backends that run it."""
    from edgeinfer.backends import AVAILABLE, backend_status
    from edgeinfer.models.catalog import resolve_model
    from edgeinfer.models.info import load_model_info
    from edgeinfer.system import available_ram, cpu_features, free_cores, usable_cores

    report: dict[str, Any] = {
        "cpu_features": cpu_features(),
        "cores": usable_cores(),
        "free_cores": free_cores(),
        "ram_available_bytes": available_ram(),
        "backends": backend_status(),
        "devices": _devices(),
        "llama_cpp_build": _llama_cpp_build(),
        "llama_cpp_devices": _llama_cpp_devices(),
    }
    if model is not None:
        meta = load_model_info(resolve_model(model, download=False))
        hp = meta.hparams
        report["model"] = {
            "path": str(meta.path),
            "name": meta.name,
            "architecture": meta.architecture,
            "file_size_bytes": meta.file_size,
            "layers": hp.n_layer,
            "embedding": hp.n_embd,
            "heads": hp.n_head,
            "kv_heads": hp.n_head_kv,
            "head_dim": hp.head_dim,
            "context_length": hp.n_ctx_train,
            "vocab_size": hp.n_vocab,
            "rope_base": hp.rope_base,
            # Layers attending within a window of sliding_window positions (Gemma 3's local layers).
            "sliding_window": hp.sliding_window,
            "sliding_window_layers": sum(hp.swa_layers),
            "recurrent": hp.recurrent,
            "reference_implements": hp.arch.reference,
            "tensor_types": meta.tensor_types,
            # Two bytes a value: the f16 cache every backend keeps (Backend.kv_bytes_per_token for others).
            "kv_bytes_per_token_f16": meta.kv_values_per_token * 2,
            "chat_template": "built in"
            if meta.chat_template
            else "none (ChatML, or a User:/Assistant: transcript where the vocabulary lacks ChatML's tokens)",
            "backends": backend_status(meta),  # each: "available", or why it skips this model
            "auto_backend": _auto_choice(meta),  # None where no backend runs it
        }
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    mib = 2**20
    click.echo(f"CPU features:  {' '.join(report['cpu_features']) or 'unknown'}")
    click.echo(f"cores:         {report['cores']} usable, {report['free_cores']} free now")
    click.echo(f"RAM available: {report['ram_available_bytes'] / mib:,.0f} MiB")
    click.echo(f"llama.cpp:     {report['llama_cpp_build']}")
    for device in report["llama_cpp_devices"]:
        click.echo(
            f"  ggml device {device['name']} ({device['type']}, {device['registry']}): {device['description']}; "
            f"{device['free_bytes'] / mib:,.0f} of {device['total_bytes'] / mib:,.0f} MiB free; "
            f"--backend {device['backend']}"
        )
    for name, state in report["backends"].items():
        click.echo(f"backend {name}: {state}")
        for device in report["devices"].get(name, []):
            emulated = " (a GPU emulated on the CPU: auto passes it over)" if device["emulated"] else ""
            click.echo(f"  device {device['name']}: {device['description']}{emulated}")
    if model is not None:
        m = report["model"]
        click.echo(f"\nmodel:         {m['name']} ({m['architecture']})")
        click.echo(f"file:          {m['path']} ({m['file_size_bytes'] / mib:,.1f} MiB)")
        click.echo(
            f"shape:         {m['layers']} layers, hidden {m['embedding']}, {m['heads']} heads, "
            f"{m['kv_heads']} KV heads, head dim {m['head_dim']}, vocab {m['vocab_size']:,}"
        )
        click.echo(
            f"context:       {m['context_length']:,} tokens; KV {m['kv_bytes_per_token_f16']:,.0f} bytes/token (f16)"
        )
        if m["sliding_window"]:
            click.echo(
                f"attention:     {m['sliding_window_layers']} of {m['layers']} layers within a sliding window of "
                f"{m['sliding_window']:,} positions"
            )
        if m["recurrent"]:
            click.echo("attention:     recurrent layers: the cache cannot drop old tokens (KV policy error)")
        click.echo(f"tensor types:  {', '.join(f'{k} x{v}' for k, v in sorted(m['tensor_types'].items()))}")
        click.echo(f"chat template: {m['chat_template']}")
        for i, (name, state) in enumerate(m["backends"].items()):
            chosen = " (auto's choice)" if name == m["auto_backend"] else ""
            verdict = "supports it" + chosen if state == AVAILABLE else state
            click.echo(f"{'backends:' if i == 0 else '':<15}{name}: {verdict}")


def _devices() -> dict[str, list[dict[str, Any]]]:
    """Where each backend that loads here can run: the names --device takes (ONNX Runtime's providers, OpenCL's
    platform:device indices too), each with what it is."""
    from edgeinfer.backends import BACKENDS, backend_class
    from edgeinfer.errors import BackendUnavailableError

    found = {}
    for name in BACKENDS:
        try:
            found[name] = [
                {"name": d.name, "description": d.description, "emulated": d.emulated}
                for d in backend_class(name).devices()
            ]
        except BackendUnavailableError:
            continue
    return found


def _auto_choice(info: ModelInfo) -> str | None:
    """The backend ``--backend auto`` runs ``info`` on, with the smallest cache; None where none can."""
    from edgeinfer.backends import choose_backend
    from edgeinfer.errors import BackendUnavailableError

    try:
        return choose_backend("auto", info).name
    except BackendUnavailableError:
        return None


def _llama_cpp_devices() -> list[dict[str, Any]]:
    """The devices of the installed llama.cpp build, as ggml lists them, with the backend serving each."""
    from edgeinfer.errors import NATIVE_LOAD_ERRORS

    try:
        from edgeinfer.backends.llamacpp import VULKAN_REGISTRY, ggml_devices
    except NATIVE_LOAD_ERRORS:
        return []
    return [
        {
            "name": d.name,
            "type": d.kind,
            "registry": d.registry,
            "description": d.description,
            "free_bytes": d.free_bytes,
            "total_bytes": d.total_bytes,
            "backend": "vulkan" if d.registry == VULKAN_REGISTRY else "llamacpp",
        }
        for d in ggml_devices().all()
    ]


def _llama_cpp_build() -> str:
    from edgeinfer.errors import NATIVE_LOAD_ERRORS

    try:
        from edgeinfer.backends.llamacpp import build_info
    except NATIVE_LOAD_ERRORS as exc:
        return f"cannot be loaded ({exc})"
    return build_info()


@cli.command(name="list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@_user_errors
def list_(as_json: bool) -> None:
    """The model catalog and the models already on disk."""
    from edgeinfer.models.catalog import list_models

    listings = list_models()
    if as_json:
        rows = [
            {
                "name": m.name,
                "description": m.description,
                "path": str(m.path) if m.path else None,
                "size_bytes": m.size_bytes,
                "in_catalog": m.in_catalog,
            }
            for m in listings
        ]
        click.echo(json.dumps(rows, indent=2))
        return
    sizes = [f"{m.size_bytes / 2**20:,.1f} MiB" if m.size_bytes else "?" for m in listings]
    name_width = max((len(m.name) for m in listings), default=4)
    size_width = max((len(s) for s in sizes), default=4)
    click.echo(f"{'NAME':<{name_width}}  {'SIZE':>{size_width}}  {'ON DISK':<7}  DESCRIPTION")
    for m, size in zip(listings, sizes, strict=True):
        click.echo(f"{m.name:<{name_width}}  {size:>{size_width}}  {'yes' if m.path else 'no':<7}  {m.description}")


@cli.command()
@click.argument("model")
@_user_errors
def pull(model: str) -> None:
    """Download MODEL (catalog alias or hf:ORG/REPO/FILE.gguf) into the Hugging Face cache."""
    from edgeinfer.models.catalog import pull as pull_model
    from edgeinfer.models.info import load_model_info

    path = pull_model(model)
    load_model_info(path)  # a download that is not a usable GGUF is reported now, not at first use
    click.echo(str(path))


@cli.command(name="eval")
@click.argument("model")
@click.option(
    "--text", "text_file", required=True, type=click.Path(exists=True, dir_okay=False), help="UTF-8 text to score."
)
@click.option(
    "--ctx",
    type=click.IntRange(MIN_KV_TOKENS),
    default=512,
    show_default=True,
    help="Chunk length; its second half is scored.",
)
@click.option("--base", help="Compare with this model's distributions (KLD, top-1 agreement, Δ perplexity).")
@click.option("--backend", default="auto", show_default=True, help="Backend for MODEL.")
@click.option("--base-backend", help="Backend for --base (default: --backend).")
@click.option("--threads", type=int, help="CPU threads (default: the free cores).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_user_errors
def eval_(
    model: str,
    text_file: str,
    ctx: int,
    base: str | None,
    backend: str,
    base_backend: str | None,
    threads: int | None,
    as_json: bool,
) -> None:
    """Perplexity of MODEL on a text (llama-perplexity's convention), and its divergence from --base."""
    from edgeinfer.engine import Engine
    from edgeinfer.evaluate import evaluate
    from edgeinfer.models.catalog import resolve_model
    from edgeinfer.models.info import load_model_info

    try:
        with open(text_file, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        _fail(f"{text_file} is not UTF-8 text; convert it to UTF-8")
    for path in dict.fromkeys(resolve_model(m) for m in (model, base) if m is not None):
        context = load_model_info(path).hparams.n_ctx_train  # before loading: --ctx is the cache's budget too
        if ctx > context:
            _fail(f"--ctx {ctx} is more than {path.name}'s context of {context} tokens; give at most {context}")
    budget = f"{ctx}tok"
    with Engine(model, backend=backend, kv_budget=budget, batch_size=ctx, threads=threads) as engine:
        if base is None and base_backend is None:
            report = evaluate(engine, text, ctx)
        else:
            base_engine = Engine(
                base or model, backend=base_backend or backend, kv_budget=budget, batch_size=ctx, threads=threads
            )
            with base_engine:
                report = evaluate(engine, text, ctx, base=base_engine)
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else report.format())


class _ConversionProgress:
    """A conversion's stages on stderr (stdout keeps the report alone). On a terminal, a bar per
    stage with its count, time taken and time left (rich), notes printed above. Anywhere else (a
    CI log, a pipe) plain lines: one as each stage begins and ends, one every ``PLAIN_EVERY_S``
    between, each with the time left."""

    PLAIN_EVERY_S = 30.0

    def __init__(self) -> None:
        from rich.console import Console

        self.console = Console(stderr=True, highlight=False)
        self.bars: Any = None  # rich's Progress, on a terminal
        self.stage = ""
        self.task: Any = None
        self.started = self.printed = 0.0

    def __enter__(self) -> _ConversionProgress:
        if self.console.is_interactive:  # a terminal that redraws (not TERM=dumb)
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self.bars = Progress(
                TextColumn("{task.description:<11}"),
                BarColumn(),
                TextColumn("{task.fields[count]:<14}"),
                TimeElapsedColumn(),
                TextColumn("·"),
                TimeRemainingColumn(),
                TextColumn("left"),
                console=self.console,
            )
            self.bars.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bars is not None:
            self.bars.stop()

    def note(self, message: str) -> None:
        if self.bars is not None:
            self.console.print(message, markup=False)
        else:
            click.echo(message, err=True)

    def step(self, step: Step) -> None:
        now = time.monotonic()
        new_stage = step.stage != self.stage
        if new_stage:
            self.stage, self.started = step.stage, now
        count = f"{step.unit} {step.done} of {step.total}"
        if self.bars is not None:  # the bar and the time left follow the work done, not the count
            if new_stage:
                self.task = self.bars.add_task(step.stage, total=1.0, count=count)
            self.bars.update(self.task, completed=step.share, count=count)
            return
        finished = step.done == step.total
        if not (new_stage or finished or now - self.printed >= self.PLAIN_EVERY_S):
            return
        self.printed = now
        elapsed = now - self.started
        line = f"{step.stage}: {count}"
        if finished:
            line += f", done in {_clock(elapsed)}"
        elif step.share > 0:
            line += f", {_clock(elapsed)} so far, about {_clock(elapsed * (1 - step.share) / step.share)} left"
        click.echo(line, err=True)


def _clock(seconds: float) -> str:
    """A duration to read at a glance: 45s, 3m12s, 1h05m."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


@cli.command()
@click.argument("hf_dir", type=click.Path(file_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="The GGUF file to write.")
@click.option(
    "--type",
    "qtype",
    type=click.Choice(["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q4_k", "q5_k", "q6_k"]),
    help="One type for every matrix [default: f16 unless a budget is given].",
)
@click.option("--target-size", help="Budgeted mixed precision: the whole file's size, e.g. '80MB'.")
@click.option("--target-bpw", type=click.FloatRange(1, 32), help="Budgeted mixed precision: bits per weight.")
@click.option(
    "--calib", type=click.Path(dir_okay=False), help="Calibration text: what the tensors' sensitivity is measured on."
)
@click.option(
    "--sensitivity",
    type=click.Choice(["activation", "kld"]),
    default="kld",
    show_default=True,
    help="kld: each tensor's measured effect on the output (better); activation: importance-weighted error (faster).",
)
@click.option(
    "--speed-aware/--no-speed-aware",
    default=True,
    show_default=True,
    help="With a budget: time each type's llama.cpp kernels here and avoid slow ones unless quality insists "
    "(turn off for a file that will run on another kind of CPU).",
)
@click.option("--eval", "eval_text", type=click.Path(dir_okay=False), help="Held-out text: perplexity and KLD.")
@click.option("--pre-tokenizer", help="llama.cpp pre-tokenizer name, where it cannot be identified.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@_user_errors
def convert(
    hf_dir: str,
    output: str,
    qtype: str | None,
    target_size: str | None,
    target_bpw: float | None,
    calib: str | None,
    sensitivity: str,
    speed_aware: bool,
    eval_text: str | None,
    pre_tokenizer: str | None,
    as_json: bool,
) -> None:
    """Convert a Hugging Face checkpoint folder to GGUF, uniform or within a size budget."""
    from edgeinfer.converters.convert import convert as run_conversion
    from edgeinfer.converters.interrupt import Terminated, terminating_raises
    from edgeinfer.sizes import parse_size

    size = None if target_size is None else parse_size(target_size, "--target-size")
    try:
        with terminating_raises(), _ConversionProgress() as display:
            report = run_conversion(
                hf_dir,
                output,
                qtype=qtype,
                target_size=size,
                target_bpw=target_bpw,
                calib=calib,
                sensitivity="activation" if sensitivity == "activation" else "kld",
                speed_aware=speed_aware,
                eval_text=eval_text,
                pre_tokenizer=pre_tokenizer,
                log=display.note,
                progress=display.step,
            )
        click.echo(json.dumps(report.to_dict(), indent=2) if as_json else report.format())
    except Terminated as stop:  # its temporary files are gone: the conversion unwound as from Ctrl-C
        _fail(f"interrupted by {stop}", 128 + stop.signum)


@cli.command(name="bench")
@click.argument("models", nargs=-1, metavar="[MODEL]...")
@click.option(
    "--backend", "backends", multiple=True, help="Backend to run every MODEL on; repeat to compare.  [default: auto]"
)
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=128, show_default=True, help="Prompt length.")
@click.option("--gen-tokens", type=click.IntRange(min=2), default=128, show_default=True, help="Tokens per answer.")
@click.option("--runs", type=click.IntRange(min=1), default=5, show_default=True, help="Timed runs after a warm-up.")
@click.option("--threads", type=int, help="CPU threads (default: the free cores).")
@_placement_options
@click.option(
    "--speculative",
    type=click.Choice([Speculation.LOOKUP.value, Speculation.OFF.value]),
    default=Speculation.LOOKUP.value,
    show_default=True,
    help="lookup (an engine's default): draft tokens from the prompt and the answer so far (the bench's prompt "
    "repeats, so most drafts are kept); off: one token a pass, each backend's own decode speed.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object, with every run's figures.")
@click.option(
    "--plot", type=click.Path(dir_okay=False, path_type=Path), help="Also draw the results into this PNG (matplotlib)."
)
@_user_errors
def bench_command(
    models: tuple[str, ...],
    backends: tuple[str, ...],
    prompt_tokens: int,
    gen_tokens: int,
    runs: int,
    threads: int | None,
    device: str,
    gpu_layers: int,
    speculative: str,
    as_json: bool,
    plot: Path | None,
) -> None:
    """Measure MODELs (default: the default model) on each backend, side by side.

    Load time, cold start, TTFT, time per output token (P50/P95/P99), prefill and
    decode tokens/s, peak memory and where each run's time goes. Each model/backend
    pair runs in a fresh process; ratios are to the first pair.
    """
    from edgeinfer.bench.report import check_plot_possible
    from edgeinfer.bench.runner import bench

    if plot is not None:
        check_plot_possible(plot)
    report = bench(
        models or (DEFAULT_MODEL,),
        backends,
        prompt_tokens=prompt_tokens,
        gen_tokens=gen_tokens,
        runs=runs,
        threads=threads,
        device=device,
        gpu_layers=gpu_layers,
        speculative=Speculation(speculative),
        progress=lambda line: click.echo(f"bench: {line}", err=True),
    )
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else report.format())
    if plot is not None:  # after the figures are out, so a failed plot loses none of them
        report.plot(plot)
