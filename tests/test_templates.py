"""Chat templates from the GGUF, in the sandbox: real templates render, escapes execute nothing."""

from __future__ import annotations

import pytest

from edgeinfer import Engine, TemplateError
from edgeinfer.chat import CHATML_TEMPLATE, ChatTemplate
from edgeinfer.models.info import load_model_info

from support import rewrite_gguf

MESSAGES = [{"role": "user", "content": "Hi"}]


def test_the_models_own_template_renders(engine):
    assert engine.info.chat_template and not engine.template.is_default
    text = engine.render(MESSAGES)
    # SmolLM2's template adds its own system prompt when there is none.
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


ESCAPES = [
    "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% for c in [].__class__.__base__.__subclasses__() %}{{ c }}{% endfor %}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{{ joiner.__init__.__globals__.__builtins__.__import__('os').system('touch MARKER') }}",
    "{{ namespace.__init__.__globals__.os.system('touch MARKER') }}",
    "{% set x = messages.append({'role': 'x', 'content': 'y'}) %}{{ x }}",
]


@pytest.mark.parametrize("source", ESCAPES)
def test_escape_attempts_fail_clearly_and_execute_nothing(source, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TemplateError) as info:
        ChatTemplate(source).render(MESSAGES)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "MARKER").exists()


def test_escape_attempt_inside_a_real_model_file(model_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    evil = rewrite_gguf(model_path, tmp_path / "evil.gguf", strings={"tokenizer.chat_template": ESCAPES[0]})
    with Engine(evil, kv_budget="512tok", threads=2) as engine:
        with pytest.raises(TemplateError, match="tried to reach Python internals"):
            engine.chat(MESSAGES)
        assert engine.generate("Hello", max_tokens=2).metrics.output_tokens <= 2
    assert not (tmp_path / "MARKER").exists()


def test_a_model_without_a_template_gets_chatml(model_path, tmp_path):
    plain = rewrite_gguf(model_path, tmp_path / "plain.gguf", drop=("tokenizer.chat_template",))
    assert load_model_info(plain).chat_template is None
    with Engine(plain, kv_budget="512tok", threads=2) as engine:
        assert engine.template.is_default and engine.template.source == CHATML_TEMPLATE
        assert engine.render(MESSAGES) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        assert engine.chat(MESSAGES, temperature=0, max_tokens=8).metrics.output_tokens >= 1


def test_template_errors_are_one_line():
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate("{% for %}").render(MESSAGES)
    with pytest.raises(TemplateError, match="rejected the conversation: no system"):
        ChatTemplate("{{ raise_exception('no system') }}").render(MESSAGES)
    with pytest.raises(TemplateError, match="'role' and 'content'"):
        ChatTemplate(None).render([{"text": "hi"}])


def test_tojson_keeps_unicode_as_hugging_face_does():
    assert ChatTemplate("{{ messages[0] | tojson }}").render([{"role": "user", "content": "é"}]) == (
        '{"role": "user", "content": "é"}'
    )


@pytest.mark.parametrize(
    "source",
    [
        "{{ 'A' * 100000000 }}",
        "{{ ['x'] * 10000000 }}",
        "{{ 10 ** 100000000 }}",
        "{% for i in range(100000) %}{{ 'ABCDEFGHIJ' * 10 }}{% endfor %}",
    ],
)
def test_templates_cannot_exhaust_memory(source):
    with pytest.raises(TemplateError, match="refused"):
        ChatTemplate(source).render(MESSAGES)
