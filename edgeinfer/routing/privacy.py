"""Privacy rules: prompts that match one stay on the device, whatever the routing policy says.

Built in: e-mail addresses, phone numbers, API keys and tokens, and card-like numbers (13 to 19
digits that pass the Luhn check, so a long sum does not count). Add your own patterns with
``PrivacyRule`` or plain regular expressions.

Every rule, yours too, sees the prompt after Unicode NFKC normalization and with zero-width and
other invisible format characters removed, so ``john＠example.com`` (a full-width @), ``john\u200b@
example.com`` (a zero-width space) and full-width digits are caught as their plain forms.

What the detectors catch: addresses written as ``name@host.tld``; phone numbers of 8 digits or
more, with a ``+`` country code or in groups joined by spaces, dots or dashes; keys with a known
prefix (``sk-`` followed by 16 or more characters, or 8 or more with a digit among them, ``ghp_``, ``github_pat_``,
``AKIA``, ``xox?-``, ``AIza``, ``hf_``), JSON web tokens, PEM private keys, ``Bearer`` tokens and
``api_key=``/``password:``-style assignments; card numbers that pass the Luhn check.

What they miss: spelled-out forms (``john at example dot com``, digits written as words),
look-alike letters from other scripts (a Cyrillic ``е`` is not an ``e``), phone numbers in one
run of fewer than 8 digits or with no separators at all, keys with no known prefix and no
``key=`` before them, and personal data with no fixed shape (names, addresses, health details):
add rules for what your prompts hold.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from edgeinfer.errors import InvalidOptionError


@dataclass(frozen=True)
class PrivacyRule:
    """A named pattern; ``check`` may veto a regex match (the Luhn test of card numbers)."""

    name: str
    pattern: re.Pattern[str]
    check: Callable[[str], bool] | None = None

    def matches(self, text: str) -> bool:
        return any(self.check is None or self.check(m.group(0)) for m in self.pattern.finditer(text))


def _luhn(candidate: str) -> bool:
    digits = [int(c) for c in candidate if c.isdigit()]
    total = 0
    for i, digit in enumerate(reversed(digits)):
        if i % 2:
            digit = digit * 2 - 9 if digit > 4 else digit * 2
        total += digit
    return 13 <= len(digits) <= 19 and total % 10 == 0


def _enough_digits(candidate: str) -> bool:
    return sum(c.isdigit() for c in candidate) >= 8


BUILTIN_RULES: tuple[PrivacyRule, ...] = (
    PrivacyRule("email address", re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)*\.[A-Za-z]{2,}")),
    PrivacyRule(
        "API key or token",
        re.compile(
            r"\b(?:sk-(?:[A-Za-z0-9_-]{16,}|(?=[A-Za-z0-9_-]*\d)[A-Za-z0-9_-]{8,})|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_\w{20,}|AKIA[0-9A-Z]{16}|"
            r"xox[abprs]-[A-Za-z0-9-]{10,}|AIza[0-9A-Za-z_-]{35}|hf_[A-Za-z0-9]{30,}|"
            r"eyJ[\w-]{8,}\.[\w-]{8,}\.[\w-]{8,})|"
            r"-----BEGIN [A-Z ]*PRIVATE KEY-----|"
            r"\bBearer\s+[\w.~+/-]{16,}|"
            r"\b(?:api[_-]?key|secret|token|password|passwd)\s*[:=]\s*['\"]?[^\s'\"]{8,}",
            re.IGNORECASE,
        ),
    ),
    # Before phone numbers: a card number with spaces also looks like a phone number.
    PrivacyRule("card number", re.compile(r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d-])"), _luhn),
    PrivacyRule(
        "phone number",
        # A leading +country code, or digit groups joined by separators; 8 digits at least.
        re.compile(r"(?<![\w+])(?:\+\d{1,3}[\s.-]?)?(?:\(\d{1,4}\)[\s.-]?)?\d{2,4}(?:[\s.-]\d{2,4}){1,4}(?![\w-])"),
        _enough_digits,
    ),
)


class PrivacyRules:
    """The rules a router applies: the built-in ones (unless ``builtin=False``) and ``extra``.

    ``extra`` takes ``PrivacyRule`` objects, compiled patterns or pattern strings (named by
    their text). A pattern string that is not a valid regular expression is an error now,
    not a silent non-match later.
    """

    def __init__(self, extra: Iterable[str | re.Pattern[str] | PrivacyRule] = (), *, builtin: bool = True) -> None:
        rules: list[PrivacyRule] = list(BUILTIN_RULES) if builtin else []
        for rule in extra:
            if isinstance(rule, PrivacyRule):
                rules.append(rule)
            elif isinstance(rule, re.Pattern):
                rules.append(PrivacyRule(f"pattern {rule.pattern!r}", rule))
            elif isinstance(rule, str):
                try:
                    rules.append(PrivacyRule(f"pattern {rule!r}", re.compile(rule)))
                except re.error as exc:
                    raise InvalidOptionError(
                        f"privacy pattern {rule!r} is not a valid regular expression: {exc}"
                    ) from None
            else:
                raise InvalidOptionError(
                    f"a privacy rule is a pattern string, a re.Pattern or a PrivacyRule, got {rule!r}"
                )
        self.rules: Sequence[PrivacyRule] = tuple(rules)

    def first_match(self, text: str) -> str | None:
        """The name of the first rule ``text`` matches (once normalized: see the module), or None."""
        text = normalize(text)
        for rule in self.rules:
            if rule.matches(text):
                return rule.name
        return None


def normalize(text: str) -> str:
    """``text`` as the rules see it: NFKC (full-width and other compatibility forms become plain ones),
    without format characters (zero-width spaces and joiners, soft hyphens, byte-order marks), which
    split a match and are invisible on screen."""
    return "".join(c for c in unicodedata.normalize("NFKC", text) if unicodedata.category(c) != "Cf")
