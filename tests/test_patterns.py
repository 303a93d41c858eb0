"""qstrat.config.patterns: include/exclude name patterns (a glob matching the whole name, or a regex
searched in it after ``re:``)."""
from __future__ import annotations

import re

import pytest

from qstrat.config.patterns import NamePattern, any_match

NAME = "model.layers.12.mlp.experts.3.up_proj.weight"


@pytest.mark.parametrize("text,matches", [
    ("*.experts.*", True),
    ("model.layers.1?.mlp.*", True),
    ("*.up_proj", False),            # a glob matches the whole name
    ("*.EXPERTS.*", False),          # case-sensitive
    ("model.layers.[0-9].*", False),
    ("re:experts\\.3\\.", True),      # a regex is searched anywhere in the name
    ("re:^experts", False),
    ("re:layers\\.1[0-5]\\.", True),
    ("re:up_proj$", False),
])
def test_glob_matches_whole_names_and_regex_searches(text, matches):
    assert NamePattern(text)(NAME) is matches


def test_an_invalid_regex_raises_re_error():
    with pytest.raises(re.error):
        NamePattern("re:(unclosed")
    assert NamePattern("(unclosed")("(unclosed")  # a glob: parentheses are literal


def test_any_match_and_repr():
    pats = [NamePattern("*.q_proj.weight"), NamePattern("re:experts\\.3\\.")]
    assert any_match(pats, NAME) and not any_match(pats, "model.layers.0.self_attn.k_proj.weight")
    assert not any_match([], NAME)
    assert repr(pats[1]) == "NamePattern('re:experts\\\\.3\\\\.')"
