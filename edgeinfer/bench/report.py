"""What a benchmark measured, and how it is shown: a table for people, JSON, a plot."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgeinfer.backends.base import CPU
from edgeinfer.errors import EdgeInferError, InvalidOptionError
from edgeinfer.files import atomic_path
from edgeinfer.metrics import Metrics, percentile
from edgeinfer.speculative import Speculation

STAGES = ("tokenize", "prefill", "decode", "sample", "detokenize")
_Note = Callable[[dict[str, float], str], str]  # a remark after a table cell, from its column's summary


@dataclass(frozen=True)
class Config:
    """One column of the report: a model on a backend."""

    model: str  # as the user named it
    path: Path
    backend: str  # a registered name, "auto" already resolved

    @property
    def model_label(self) -> str:
        return Path(self.model).stem if self.model.endswith(".gguf") else self.model


@dataclass
class Outcome:
    """What one configuration measured."""

    config: Config
    threads: int = 0
    load_s: float = 0.0
    cold_start_s: float = 0.0
    peak_rss_bytes: int = 0
    runs: list[Metrics] = field(default_factory=list)
    bytes_per_token: int | None = None  # what a decode step reads; None where it cannot be told
    read_bandwidth: float | None = None  # bytes/s

    def summary(self) -> dict[str, float]:
        """The headline figures: medians over runs, TPOT percentiles over every token of every run, and the share
        of drafted tokens kept over every run (where any were drafted)."""
        runs = self.runs
        gaps = [gap for m in runs for gap in m.token_gaps_s]
        out = {
            "load_s": self.load_s,
            "cold_start_s": self.cold_start_s,
            "ttft_s": statistics.median(m.ttft_s for m in runs),
            "tpot_p50_s": percentile(gaps, 50),
            "tpot_p95_s": percentile(gaps, 95),
            "tpot_p99_s": percentile(gaps, 99),
            "prefill_tokens_per_s": statistics.median(m.prefill_tokens_per_s for m in runs),
            "decode_tokens_per_s": statistics.median(m.tokens_per_s for m in runs),
            "peak_rss_bytes": self.peak_rss_bytes,
            "total_s": statistics.median(m.total_s for m in runs),
        }
        drafted = sum(m.drafted_tokens for m in runs)
        if drafted:  # over every run's drafts, not a median: a run may draft a handful
            out["acceptance_rate"] = sum(m.accepted_tokens for m in runs) / drafted
        for stage in STAGES:
            out[f"{stage}_s"] = statistics.median(getattr(m, f"{stage}_s") for m in runs)
        # What no stage covers: the engine's bookkeeping, and the caller's time between tokens.
        out["other_s"] = statistics.median(m.total_s - sum(getattr(m, f"{s}_s") for s in STAGES) for m in runs)
        if self.bytes_per_token and self.read_bandwidth:
            out["roofline_tokens_per_s"] = self.read_bandwidth / self.bytes_per_token
        return out


@dataclass
class BenchReport:
    """Every configuration's outcome, in the order asked for; ratios are to the first."""

    prompt_tokens: int
    gen_tokens: int
    runs: int
    interleaved: bool
    outcomes: list[Outcome]
    device: str = CPU
    gpu_layers: int = -1  # placed on ``device`` when it is a GPU (-1: all)
    speculative: Speculation = Speculation.LOOKUP

    def to_dict(self) -> dict[str, Any]:
        first = self.outcomes[0].summary()
        configs = []
        for outcome in self.outcomes:
            summary = outcome.summary()
            configs.append(
                {
                    "model": outcome.config.model,
                    "path": str(outcome.config.path),
                    "backend": outcome.config.backend,
                    "threads": outcome.threads,
                    "summary": summary,
                    "ratios": {k: v / first[k] for k, v in summary.items() if first.get(k)},
                    "decode_bytes_per_token": outcome.bytes_per_token,
                    "read_bandwidth_bytes_per_s": outcome.read_bandwidth,
                    "runs": [{**m.to_dict(), "token_times_s": m.token_times_s} for m in outcome.runs],
                }
            )
        return {
            "prompt_tokens": self.prompt_tokens,
            "gen_tokens": self.gen_tokens,
            "runs": self.runs,
            "warmup_runs": 1,
            "interleaved": self.interleaved,
            "device": self.device,
            "gpu_layers": self.gpu_layers,
            "speculative": self.speculative.value,
            "configs": configs,
        }

    def format(self) -> str:
        """A table for people: a row per figure, a column per configuration, ratios to the first."""
        summaries = [o.summary() for o in self.outcomes]
        first = summaries[0]
        threads = "/".join(str(n) for n in sorted({o.threads for o in self.outcomes}))
        order = "configurations took turns run by run" if self.interleaved else "configurations ran one after another"
        layers = "all" if self.gpu_layers < 0 else self.gpu_layers
        drafting = "one token a step" if self.speculative is Speculation.OFF else "lookup drafting"
        lines = [
            f"{self.prompt_tokens}-token prompt, {self.gen_tokens} tokens generated (greedy, {drafting}), "
            f"{self.runs} run{'s' * (self.runs != 1)} after 1 warm-up, {threads} thread{'s' * (threads != '1')}"
            + (f", {layers} layers on {self.device}" if self.device != CPU else "")
            + (f"; {order}" if len(self.outcomes) > 1 else ""),
            "medians over runs; TPOT percentiles over every token; ratios are to the first column",
            "",
        ]
        table: list[list[str]] = [
            ["", *(o.config.model_label for o in self.outcomes)],
            ["", *(o.config.backend for o in self.outcomes)],
        ]

        def row(
            label: str, key: str, show: Callable[[float], str], note: _Note | None = None, ratio: bool = True
        ) -> None:
            cells = [label]
            for i, s in enumerate(summaries):
                if key not in s:
                    cells.append("-")
                    continue
                cell = show(s[key]) + (note(s, key) if note else "")
                if ratio and i > 0 and first.get(key):
                    cell += f"  {s[key] / first[key]:.2f}x"
                cells.append(cell)
            table.append(cells)

        row("load", "load_s", _duration)
        row("cold start", "cold_start_s", _duration)
        row("TTFT", "ttft_s", _duration)
        for q in (50, 95, 99):
            row(f"TPOT P{q}", f"tpot_p{q}_s", _duration)
        row("prefill", "prefill_tokens_per_s", _rate)
        row("decode", "decode_tokens_per_s", _rate)
        if self.speculative is not Speculation.OFF:  # "-" where nothing was drafted
            row("drafts kept", "acceptance_rate", lambda v: f"{v:.0%}", ratio=False)
        row("roofline", "roofline_tokens_per_s", _rate, _reached)
        row("peak RSS", "peak_rss_bytes", lambda v: f"{v / 2**20:,.0f} MiB")
        table.append(["time by stage:", *([""] * len(summaries))])
        for stage in (*STAGES, "other"):
            row(f"  {stage}", f"{stage}_s", _duration, _share)
        row("  total", "total_s", _duration)

        widths = [max(len(r[c]) for r in table) for c in range(len(table[0]))]
        for r in table:
            cells = [r[0].ljust(widths[0])] + [cell.rjust(w) for cell, w in zip(r[1:], widths[1:], strict=True)]
            lines.append("   ".join(cells).rstrip())
        if any("roofline_tokens_per_s" in s for s in summaries):
            lines.append("roofline: the fastest decode memory allows (bytes a step reads / bandwidth measured here)")
        return "\n".join(lines)

    def plot(self, path: Path) -> None:
        """Draw the TPOT spread and the stage times per configuration into a PNG at ``path``."""
        plt = _pyplot()
        labels = [f"{o.config.model_label}\n{o.config.backend}" for o in self.outcomes]
        figure, (spread, stages) = plt.subplots(1, 2, figsize=(6 + 2 * len(labels), 4.5))
        spread.boxplot(
            [[gap * 1000 for m in o.runs for gap in m.token_gaps_s] for o in self.outcomes],
            whis=(5, 99),
            showfliers=False,
        )
        spread.set_xticks(range(1, len(labels) + 1), labels)
        spread.set_ylabel("ms per output token (P5-P99)")
        summaries = [o.summary() for o in self.outcomes]
        columns = np.arange(len(labels))  # by position: two columns may carry the same label
        bottom = np.zeros(len(labels))
        for stage in (*STAGES, "other"):
            heights = np.array([s[f"{stage}_s"] * 1000 for s in summaries])
            stages.bar(columns, heights, bottom=bottom, label=stage)
            bottom += heights
        stages.set_xticks(columns, labels)
        stages.set_ylabel("ms per run (median)")
        stages.legend(fontsize="small")
        figure.suptitle(f"{self.prompt_tokens}-token prompt, {self.gen_tokens} tokens generated, {self.runs} runs")
        figure.tight_layout()
        try:
            with atomic_path(path) as tmp:  # a failed draw leaves no half a file
                figure.savefig(tmp, format="png", dpi=120)
        except OSError as exc:
            raise EdgeInferError(f"cannot write the plot to {path}: {exc.strerror or exc}") from None
        finally:
            plt.close(figure)


def check_plot_possible(path: Path) -> None:
    """Refuse ``--plot`` before a long run rather than after it."""
    _pyplot()
    folder = path.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise InvalidOptionError(f"cannot write the plot to {path}: {folder} is not a folder this user can write to")


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise InvalidOptionError("--plot needs matplotlib, which is not installed: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _duration(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _rate(per_s: float) -> str:
    return f"{per_s:,.1f} tok/s"


def _reached(summary: dict[str, float], key: str) -> str:
    return f" (decode {summary['decode_tokens_per_s'] / summary[key]:.0%})"


def _share(summary: dict[str, float], key: str) -> str:
    return f" ({summary[key] / summary['total_s']:.1%})"
