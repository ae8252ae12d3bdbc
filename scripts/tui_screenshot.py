"""Regenerate docs/tui.svg: a real `edgeinfer chat` session with the default model, as Textual draws it.

The app runs headless under Textual's pilot: it loads the model, asks two questions
(greedy, so the answers are the model's own but repeatable), and exports the screen.

    python scripts/tui_screenshot.py            # writes docs/tui.svg
    python scripts/tui_screenshot.py OUT.svg
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from edgeinfer.tui.app import ChatApp
from edgeinfer.tui.settings import ChatSettings
from edgeinfer.tui.widgets import PromptInput

PROMPTS = ("What is the capital of France?", "Give three short tips for sleeping well, as a list.")
SIZE = (110, 30)


async def capture(out: Path, threads: int | None) -> None:
    settings = ChatSettings(system="You are a helpful assistant.", temperature=0, max_tokens=200, threads=threads)
    app = ChatApp(settings)
    async with app.run_test(size=SIZE) as pilot:
        while app.loading:
            await pilot.pause(0.05)
        for prompt in PROMPTS:
            app.query_one(PromptInput).value = prompt
            await pilot.press("enter")
            await pilot.pause(0.1)
            while app.answering:
                await pilot.pause(0.05)
        await pilot.pause(0.5)  # let the last Markdown blocks settle
        out.write_text(app.export_screenshot(title="edgeinfer chat"))
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "tui.svg")
    parser.add_argument("--threads", type=int, help="CPU threads for the model (default: the chat's own choice)")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    asyncio.run(capture(args.out, args.threads))


if __name__ == "__main__":
    main()
