"""Hugging Face checkpoint to GGUF: read, calibrate, choose types, write, report.

    report = convert("SmolLM2-135M/", "smollm2.gguf", target_size=80_000_000, calib="calib.txt")
    print(report.format())

Uniform conversions (``qtype="q8_0"``) quantize every matrix alike, with an importance matrix
if calibration text is given. Budgeted ones (``target_size`` or ``target_bpw``) measure each
matrix's error under every type its rows allow and pick the mix with the least estimated error
that fits (``converters/plan.py``).

A conversion of a billion-parameter checkpoint takes minutes; ``progress`` is told where it
stands after each unit of work (a ``Step``: the stage, and how many of its layers or tensors
are done), for a progress bar or log lines. ``log`` gets the notes a user should read.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from time import perf_counter
from typing import Any, Literal

import numpy as np
from gguf import GGMLQuantizationType

from edgeinfer.converters.calibrate import Calibration, calibrate, column_importance, output_klds
from edgeinfer.converters.checkpoint import Checkpoint
from edgeinfer.converters.output import check_output, output_path, scratch_folder, sweep
from edgeinfer.converters.plan import (
    QUALITY_INSISTS,
    UNIFORM_TYPES,
    Choice,
    SpeedTrade,
    budgeted,
    candidate_types,
    check_fits,
    error_sample,
    estimate_errors,
    smallest_bytes,
    stored_bytes,
    uniform,
)
from edgeinfer.converters.quantize import block_size, quantize
from edgeinfer.converters.rows import TOKEN_EMBD, gather_rows
from edgeinfer.converters.type_speed import TypeSpeed, measure_type_speeds
from edgeinfer.converters.vocab import read_vocab
from edgeinfer.converters.writer import header_bytes, write_gguf, write_vocab_only
from edgeinfer.errors import ConversionError
from edgeinfer.evaluate import Report as EvalReport
from edgeinfer.system import peak_rss

QType = GGMLQuantizationType
Sensitivity = Literal["activation", "kld"]
Stage = Literal["reading", "calibrating", "probing", "timing", "measuring", "writing", "evaluating"]
CALIB_TOKENS = 4096  # enough for a stable importance matrix; the reference pass costs ~1 s per 300 tokens
CALIB_CTX = 512
PROBE_TOKENS = 256  # the tokens each tensor's KL divergence is measured on
# Types ggml quantizes without looking at an importance matrix: calibrating for them is wasted.
IMPORTANCE_UNUSED = frozenset({QType.F32, QType.F16, QType.BF16, QType.Q8_0})


@dataclass(frozen=True)
class Step:
    """Where a conversion stands: ``done`` of the ``total`` units (``unit``: layer, tensor, ...) of
    ``stage``. Each stage is announced with ``done`` 0 and ends with ``done == total``; the stages
    come in this order, those a conversion does not need left out:

    * ``reading``: the checkpoint's tokenizer and the calibration text;
    * ``calibrating``: the calibration text through each layer (with ``calib``);
    * ``probing``: each layer's effect on the output distribution, the head last (``sensitivity="kld"``);
    * ``timing``: runs of each type a matrix's rows allow, in llama.cpp here (a budget and ``speed_aware``);
    * ``measuring``: each matrix's error under every type its rows allow (with a budget);
    * ``writing``: each tensor quantized and written;
    * ``evaluating``: perplexity and divergence in llama.cpp (with ``eval_text``).
    """

    stage: Stage
    done: int
    total: int
    unit: str
    work: float | None = None  # the share of the stage's work done, where its units differ in cost

    @property
    def share(self) -> float:
        """The share of the stage's work done, from 0 to 1: what the time left is reckoned from."""
        return self.work if self.work is not None else self.done / self.total


Progress = Callable[[Step], None]


@dataclass
class ConversionReport:
    """What was written: every tensor's type and estimated error, the size, and the evaluation."""

    source: str
    output: str
    architecture: str
    tensors: list[Choice]
    file_bytes: int
    n_params: int
    calib_tokens: int
    sensitivity: str | None
    seconds: float
    peak_rss_bytes: int  # the process's peak so far, which includes earlier work in the same process
    evaluation: EvalReport | None = None
    type_speeds: list[TypeSpeed] | None = None  # the kernels timed for a speed-aware mix
    speed_trade: SpeedTrade | None = None

    @property
    def bits_per_weight(self) -> float:
        return 8 * sum(t.nbytes for t in self.tensors) / self.n_params

    def type_mix(self) -> dict[str, int]:
        """Parameters per type."""
        mix: dict[str, int] = {}
        for t in self.tensors:
            mix[t.qtype.name] = mix.get(t.qtype.name, 0) + int(np.prod(t.shape))
        return dict(sorted(mix.items(), key=lambda kv: -kv[1]))

    def to_dict(self) -> dict[str, Any]:
        tensors = [
            {
                "name": t.name,
                "shape": list(t.shape),
                "type": t.qtype.name,
                "bpw": 8 * t.nbytes / int(np.prod(t.shape)),
                "error": t.error,
                "requested": t.requested.name if t.requested else None,
            }
            for t in self.tensors
        ]
        apart = ("tensors", "evaluation", "type_speeds", "speed_trade")
        out = {k: v for k, v in asdict(self).items() if k not in apart}
        out.update(tensors=tensors, bits_per_weight=self.bits_per_weight, type_mix=self.type_mix())
        out["type_speeds"] = (
            None
            if self.type_speeds is None
            else {s.qtype.name: {"prefill_tok_s": s.prefill, "decode_tok_s": s.decode} for s in self.type_speeds}
        )
        trade = self.speed_trade
        out["speed_trade"] = (
            None
            if trade is None
            else {
                "avoided": {t.name: by.name for t, by in trade.avoided.items()},
                # the error ratio without each; null where the mix had no error to compare with
                "kept": {t.name: ratio if math.isfinite(ratio) else None for t, ratio in trade.kept.items()},
                "error_ratio": trade.error_ratio,
                "prefill_speedup": trade.speedup,
            }
        )
        out["evaluation"] = self.evaluation.to_dict() if self.evaluation else None
        return out

    def format(self) -> str:
        width = max(len(t.name) for t in self.tensors)
        lines = [f"{'tensor':<{width}}  {'shape':>13}  {'type':<12} {'bpw':>6}  est. error"]
        for t in self.tensors:
            shape = "×".join(map(str, t.shape))
            kind = t.qtype.name + (f" (for {t.requested.name})" if t.requested else "")
            error = "-" if t.error is None or len(t.shape) == 1 else f"{t.error:.3e}"
            lines.append(f"{t.name:<{width}}  {shape:>13}  {kind:<12} {8 * t.nbytes / np.prod(t.shape):>6.2f}  {error}")
        fallbacks = sorted({(t.requested.name, t.qtype.name) for t in self.tensors if t.requested})
        for asked, got in fallbacks:
            block = block_size(GGMLQuantizationType[asked])
            lines.append(
                f"note: {asked} needs rows of {block}; tensors whose rows are not use {got}, as llama.cpp does"
            )
        mix = ", ".join(f"{name} {n / self.n_params:.0%}" for name, n in self.type_mix().items())
        lines += [
            "",
            f"wrote {self.output}: {self.file_bytes / 1e6:.2f} MB, {self.bits_per_weight:.3f} bits per weight, "
            f"{self.n_params / 1e6:.1f}M parameters ({mix})",
            f"took {self.seconds:.1f} s, peak RSS {self.peak_rss_bytes / 2**20:.0f} MiB"
            + (f"; calibrated on {self.calib_tokens} tokens" if self.calib_tokens else ""),
        ]
        if self.type_speeds is not None:
            lines += ["", *self._format_speeds()]
        if self.evaluation is not None:
            lines += ["", self.evaluation.format()]
        return "\n".join(lines)

    def _format_speeds(self) -> list[str]:
        assert self.type_speeds is not None
        lines = ["llama.cpp here, on a probe of this width (tokens/s):  type  prefill  decode"]
        lines += [f"  {s.qtype.name:<7} {s.prefill:>8.0f} {s.decode:>7.0f}" for s in self.type_speeds]
        trade = self.speed_trade
        if trade is None or not (trade.avoided or trade.kept):
            return lines + ["no type these matrices can take is slower than one no larger that they can take too"]
        notes = [
            f"avoided {t.name} where a faster type no larger fits ({by.name} the fastest)"
            for t, by in trade.avoided.items()
        ]
        notes += [
            f"kept {t.name}: leaving it out as well, {ratio - 1:+.0%} estimated error"
            if math.isfinite(ratio)
            else f"kept {t.name}: leaving it out adds error to a mix that has none"
            for t, ratio in trade.kept.items()
        ]
        return lines + [
            f"slow kernels: {'; '.join(notes)}",
            f"the mix written: {trade.error_ratio - 1:+.0%} estimated error and an estimated {trade.speedup:.2f}x the "
            f"prefill speed of the mix chosen by error alone (a slow type is kept where leaving it out costs more "
            f"than {QUALITY_INSISTS - 1:.0%})",
        ]


def convert(
    hf_dir: str | Path,
    output: str | Path,
    *,
    qtype: str | None = None,
    target_size: int | None = None,
    target_bpw: float | None = None,
    calib: str | Path | None = None,
    sensitivity: Sensitivity = "kld",
    eval_text: str | Path | None = None,
    pre_tokenizer: str | None = None,
    speed_aware: bool = True,
    log: Callable[[str], None] = lambda message: None,
    progress: Progress = lambda step: None,
) -> ConversionReport:
    """Convert the checkpoint in ``hf_dir`` to the GGUF file ``output`` and report what was written.

    Give either ``qtype`` (one of ``UNIFORM_TYPES``; ``f16`` when nothing is given) or a budget:
    ``target_size`` in bytes for the whole file, or ``target_bpw`` bits per weight. A budget
    needs ``calib``, a text file like the model's use. ``eval_text`` measures perplexity and
    KL divergence against the unquantized model, with llama.cpp. ``speed_aware`` (with a budget)
    times each type's llama.cpp kernels here and avoids the slow ones unless quality insists
    (``plan.budgeted``): turn it off for a file that will run on another kind of CPU. ``log`` is
    given notes for the user, one line each; ``progress`` a ``Step`` after each unit of work.
    """
    start = perf_counter()
    output = output_path(output)
    budget_given = target_size is not None or target_bpw is not None
    if qtype is not None and budget_given:
        raise ConversionError("give either --type or a budget (--target-size / --target-bpw), not both")
    if target_size is not None and target_bpw is not None:
        raise ConversionError("give --target-size or --target-bpw, not both")
    if qtype is not None and qtype.lower() not in UNIFORM_TYPES:
        raise ConversionError(f"unknown type '{qtype}'; choose one of {', '.join(UNIFORM_TYPES)}")
    if budget_given and calib is None:
        raise ConversionError(
            "a budgeted conversion measures which tensors need precision on text: pass --calib TEXT_FILE "
            "(a few thousand words like the model's use)"
        )
    if sensitivity not in ("activation", "kld"):
        raise ConversionError(f"unknown sensitivity '{sensitivity}'; choose activation or kld")

    held_out = _read_text(eval_text, "--eval") if eval_text is not None else None  # before minutes of work
    ckpt = Checkpoint(hf_dir)
    _claim_output(output, ckpt, calib, eval_text, log)
    progress(Step("reading", 0, 1, "checkpoint"))  # after the checks: a refusal is one line, alone
    hp = ckpt.hparams
    vocab = read_vocab(ckpt.folder, hp.n_vocab, pre=pre_tokenizer)
    for note in vocab.notes:
        log(f"note: {note}")
    if ckpt.config.get("sliding_window") and hp.arch.name == "mistral":
        log("note: llama.cpp runs Mistral with full attention; the sliding window in config.json is not used")
    shapes = ckpt.shapes
    n_params = sum(int(np.prod(s)) for s in shapes.values())
    uniform_type = None if budget_given else UNIFORM_TYPES[(qtype or "f16").lower()]
    if calib is not None and uniform_type in IMPORTANCE_UNUSED:
        log(f"note: {uniform_type.name} does not use an importance matrix; --calib is ignored")
        calib = None

    if held_out is not None:  # the text is checked with the checkpoint's own vocabulary, before minutes of work
        held_out_tokens, bos = _tokenize(ckpt, vocab, held_out, output)
        n_held_out = len(held_out_tokens) + (bos is not None)  # as the evaluation counts them
        if n_held_out < min(CALIB_CTX, hp.n_ctx_train):
            raise ConversionError(
                f"the --eval text has {n_held_out} tokens, fewer than the {min(CALIB_CTX, hp.n_ctx_train)} "
                "of one evaluation chunk; give a longer held-out text"
            )

    budget = 0
    speeds: dict[QType, TypeSpeed] | None = None
    if budget_given:  # an impossible budget is known from the shapes: say so before minutes of calibration
        if target_size is not None:
            budget = target_size - header_bytes(ckpt, vocab, output)
        else:
            budget = int(float(target_bpw or 0) * n_params / 8)
        check_fits(smallest_bytes(shapes), budget)

    calibration: Calibration | None = None
    if calib is not None:
        tokens, bos = _tokenize(ckpt, vocab, _read_text(calib, "--calib"), output)
        if len(tokens) < 64:
            raise ConversionError(f"the calibration text is {len(tokens)} tokens; give at least a few thousand words")
        ctx = min(CALIB_CTX, hp.n_ctx_train)
        tokens = _spread(tokens, CALIB_TOKENS, ctx - (bos is not None))
        progress(Step("reading", 1, 1, "checkpoint"))
        probe = PROBE_TOKENS if budget_given and sensitivity == "kld" else 0
        progress(Step("calibrating", 0, hp.n_layer, "layer"))
        calibration = calibrate(
            ckpt, tokens, ctx, probe, bos, lambda done, _: progress(Step("calibrating", done, hp.n_layer, "layer"))
        )
    else:
        progress(Step("reading", 1, 1, "checkpoint"))

    if budget_given:
        assert calibration is not None
        probe_types = {
            name: min(candidate_types(shape[-1]), key=lambda t: stored_bytes(shape, t))  # the largest effect
            for name, shape in shapes.items()
            if len(shape) == 2
        }
        klds = None
        if calibration.probe is not None:
            steps = hp.n_layer + 1  # the layers, then the head

            def probed(done: int, share: float) -> None:
                progress(Step("probing", done, steps, "layer", share))

            probed(0, 0.0)
            klds = output_klds(ckpt, calibration, probe_types, probed)
        errors_of = _error_model(ckpt, calibration, probe_types, klds)
        measured: list[str] = []

        def errors_counted(name: str, types: list[QType]) -> dict[QType, float]:
            errors = errors_of(name, types)
            measured.append(name)
            progress(Step("measuring", len(measured), len(probe_types), "tensor"))
            return errors

        if speed_aware and importlib.util.find_spec("llama_cpp") is None:
            log("note: llama-cpp-python is not installed, so its kernels cannot be timed: the mix ignores speed")
        elif speed_aware:
            types = sorted({t for name in probe_types for t in candidate_types(shapes[name][-1])}, key=int)
            speeds = measure_type_speeds(
                types, hp, progress=lambda done, total: progress(Step("timing", done, total, "run"))
            )
            untimed = [t.name for t in types if t not in speeds]
            if untimed:
                log(f"note: this llama.cpp build could not load {', '.join(untimed)}: the mix weighs them by error")
        progress(Step("measuring", 0, len(probe_types), "tensor"))
        lookups = frozenset() if hp.tied_embeddings else frozenset({TOKEN_EMBD})
        plan, trade = budgeted(shapes, budget, errors_counted, speeds, lookups)
    else:
        assert uniform_type is not None
        plan, trade = uniform(shapes, uniform_type), None

    written: list[str] = []  # the tensors begun
    values = 0  # the values quantized: what the time taken follows, more than the count of tensors

    def quantize_counted(name: str, rows: np.ndarray, qtype: QType) -> np.ndarray:
        nonlocal values
        raw = quantize(rows, qtype, column_importance(calibration, name, rows.shape[1]))
        if written[-1:] != [name]:
            written.append(name)
        values += rows.size
        progress(Step("writing", len(written) - 1, len(shapes), "tensor", values / n_params))
        return raw

    progress(Step("writing", 0, len(shapes), "tensor", 0.0))
    size = write_gguf(
        output, ckpt, vocab, {n: c.qtype for n, c in plan.items()}, quantize_counted, max_bytes=target_size
    )
    progress(Step("writing", len(shapes), len(shapes), "tensor"))
    report = ConversionReport(
        source=str(ckpt.folder),
        output=str(output),
        architecture=hp.arch.name,
        tensors=list(plan.values()),
        file_bytes=size,
        n_params=n_params,
        calib_tokens=calibration.n_tokens if calibration else 0,
        sensitivity=sensitivity if budget_given else None,
        seconds=perf_counter() - start,
        peak_rss_bytes=peak_rss(),
        type_speeds=None if speeds is None else list(speeds.values()),
        speed_trade=trade,
    )
    if held_out is not None:
        progress(Step("evaluating", 0, 1, "model"))
        report.evaluation = _evaluate(ckpt, vocab, output, held_out)
        progress(Step("evaluating", 1, 1, "model"))
    return report


def _error_model(
    ckpt: Checkpoint,
    calibration: Calibration,
    probe_types: Mapping[str, QType],
    klds: Mapping[str, float] | None,
) -> Callable[[str, list[QType]], dict[QType, float]]:
    """Each matrix's estimated error per type: its expected squared output error, scaled when
    ``klds`` were measured by the output divergence per unit of that error under its probe type."""

    def errors_of(name: str, types: list[QType]) -> dict[QType, float]:
        shape = ckpt.shapes[name]
        importance = column_importance(calibration, name, shape[1])
        errors = estimate_errors(gather_rows(ckpt, name, error_sample(shape)), shape[0], importance, types)
        if name == TOKEN_EMBD and not ckpt.hparams.tied_embeddings:
            # A lookup table: each token reads one row, so a token sees the mean row error, not the sum.
            errors = {t: e / shape[0] for t, e in errors.items()}
        if klds is None:
            return errors
        probe_error = errors[probe_types[name]]
        slope = klds[name] / probe_error if probe_error > 0 else 0.0
        return {t: slope * e for t, e in errors.items()}

    return errors_of


def _spread(tokens: list[int], limit: int, ctx: int) -> list[int]:
    """At most ``limit`` tokens, as whole chunks of ``ctx`` spread evenly over the text, so a long
    calibration file is sampled throughout rather than cut after its opening."""
    if len(tokens) <= limit:
        return tokens
    n_chunks = max(1, limit // ctx)
    starts = np.linspace(0, len(tokens) - ctx, n_chunks).astype(int)
    return [t for start in starts for t in tokens[start : start + ctx]]


def _tokenize(ckpt: Checkpoint, vocab: Any, text: str, output: Path) -> tuple[list[int], int | None]:
    """The text's tokens as llama.cpp will see them from the converted file, and BOS if it adds one."""
    from edgeinfer.tokenizer import Tokenizer

    with scratch_folder(output, "vocab") as tmp:
        path = Path(tmp) / "vocab.gguf"
        write_vocab_only(path, ckpt, vocab)
        tokenizer = Tokenizer(path)
        try:
            tokens = tokenizer.encode(text, add_special=False, parse_special=False)
            bos = tokenizer.bos_id if tokenizer.add_bos and tokenizer.bos_id >= 0 else None
        finally:
            tokenizer.close()
    return tokens, bos


def _evaluate(ckpt: Checkpoint, vocab: Any, output: Path, text: str) -> EvalReport:
    """Perplexity and KL divergence of ``output`` against the unquantized model, both in llama.cpp."""
    from edgeinfer.engine import Engine
    from edgeinfer.evaluate import evaluate

    base_type = QType.F16 if ckpt.source_dtype == "F16" else QType.F32  # exact for F32 and BF16 weights
    ctx = min(CALIB_CTX, ckpt.hparams.n_ctx_train)
    with scratch_folder(output, "base") as tmp:
        base_path = Path(tmp) / f"base-{base_type.name.lower()}.gguf"
        types = {name: choice.qtype for name, choice in uniform(ckpt.shapes, base_type).items()}
        write_gguf(base_path, ckpt, vocab, types, lambda name, rows, qtype: quantize(rows, qtype))
        budget = f"{ctx}tok"
        with (
            Engine(output, backend="llamacpp", kv_budget=budget, batch_size=ctx) as engine,
            Engine(base_path, backend="llamacpp", kv_budget=budget, batch_size=ctx) as base,
        ):
            return evaluate(engine, text, ctx=ctx, base=base)


def _claim_output(
    output: Path,
    ckpt: Checkpoint,
    calib: str | Path | None,
    eval_text: str | Path | None,
    log: Callable[[str], None],
) -> None:
    """Check, before any work, that ``output`` can be written and is none of the files the conversion
    reads; then remove what conversions to it that were killed left beside it."""
    inputs = dict.fromkeys(ckpt.files(), f"part of the checkpoint {ckpt.folder}")
    for path, option in ((calib, "--calib"), (eval_text, "--eval")):
        if path is not None:
            inputs[Path(path)] = f"the {option} text"
    check_output(output, inputs)
    for leftover in sweep(output):
        log(f"note: removed {leftover.name}, left by a conversion that was killed")


def _read_text(path: str | Path, option: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConversionError(f"{option} {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConversionError(f"{option} {path} cannot be read as UTF-8 text ({exc})") from None
