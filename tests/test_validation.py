"""qstrat.config.validation: how a validation problem is worded (key paths, one line per error, nested
options expanded, the nearest valid name). Through load_config: tests/test_config_schema.py."""
from __future__ import annotations

import pydantic
import pytest

from qstrat.config.validation import close_matches, format_validation_error


class Inner(pydantic.BaseModel):
    flag: bool


class Outer(pydantic.BaseModel):
    name: str
    items: list[Inner]


def error_of(data) -> pydantic.ValidationError:
    with pytest.raises(pydantic.ValidationError) as info:
        Outer.model_validate(data)
    return info.value


def test_one_error_is_one_line_with_its_key_path():
    assert format_validation_error(error_of({"name": "x", "items": [{"flag": True}, {"flag": "maybe"}]})) == \
        "items[1].flag: Input should be a valid boolean, unable to interpret input"
    assert format_validation_error(error_of({"name": "x", "items": [{}]}), prefix="refit.yaml") == \
        "refit.yaml.items[0].flag: Field required"


def test_several_errors_are_listed_under_invalid_config():
    assert format_validation_error(error_of({"items": "no"})) == (
        "invalid config:\n  name: Field required\n  items: Input should be a valid list")


def test_a_model_level_error_has_no_key_path():
    class Checked(pydantic.BaseModel):
        @pydantic.model_validator(mode="after")
        def never(self):
            raise ValueError("nothing to refit")

    with pytest.raises(pydantic.ValidationError) as info:
        Checked.model_validate({})
    assert format_validation_error(info.value) == "<config>: nothing to refit"


@pytest.mark.parametrize("name,choices,want", [
    ("block_fp8", ["block-fp8", "mxfp8", "bf16"], "did you mean 'block-fp8'? "),
    ("qwen3moe", ["qwen3_moe", "qwen3_5_moe", "llama"], "did you mean 'qwen3_moe' or 'qwen3_5_moe'? "),
    ("zzz", ["block-fp8", "mxfp8"], ""),
    ("FP4", ["bf16", "block_fp8", "mxfp8", "nvfp4"], "did you mean 'nvfp4' (NVFP4, E2M1 with E4M3 scales per 16)? "),
    ("fp8", ["keys", "only"], ""),  # an alias of no choice: difflib as before
    ("mxfp8", {}, ""),
])
def test_close_matches_offers_at_most_two_near_names(name, choices, want):
    assert close_matches(name, choices) == want
