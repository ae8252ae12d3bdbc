"""What the command shows of the library's log: warnings always, progress on a terminal, rewritten in place."""

from __future__ import annotations

import io
import logging

import pytest

from edgeinfer.notes import show_notes


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def log(monkeypatch):
    show_notes()
    show_notes()  # twice: still one handler, so each note is shown once
    return logging.getLogger("edgeinfer.backends.onnx")


def test_a_terminal_sees_progress_rewritten_in_place_and_each_note_once(log, monkeypatch):
    stderr = Terminal()
    monkeypatch.setattr("sys.stderr", stderr)
    log.info("measuring tiny.gguf")
    for layer in (1, 2):
        log.info("building: layer %d of 2", layer, extra={"progress": layer < 2})
    log.warning("falling back to the CPU")
    assert stderr.getvalue() == (
        "measuring tiny.gguf\nbuilding: layer 1 of 2\r\x1b[Kbuilding: layer 2 of 2\nfalling back to the CPU\n"
    )


def test_a_script_sees_the_warnings_alone(log, monkeypatch):
    stderr = io.StringIO()
    monkeypatch.setattr("sys.stderr", stderr)
    log.info("building: layer 1 of 2", extra={"progress": True})
    log.warning("falling back to the CPU")
    assert stderr.getvalue() == "falling back to the CPU\n"
