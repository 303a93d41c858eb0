"""natural_key (the wire order's sort key) orders names exactly as the tuple key
(text, int, text, int, ...) from splitting at digit runs, on tricky generated names."""
from __future__ import annotations

import random
import re

import qstrat
from qstrat import RefitDriver

from qstrat.plan.data import natural_key, natural_keys

from plan_cases import small_moe


def tuple_key(name: str):
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def test_natural_key_orders_like_the_tuple_key():
    rng = random.Random(14)
    alphabet = ["0", "00", "1", "2", "9", "10", "007", "123456789012345678901234", ".", "_", "-",
                "!", " ", "a", "b", "layers", "experts", "weight", "Z", "~"]
    names = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 7))) for _ in range(3000)]
    names += ["model.layers.2.mlp", "model.layers.10.mlp", "model.layers.2", "a.weight", "a1.weight",
              "a.1", "a.!", "x10", "x1a", "x01", "x1"]
    want = sorted(names, key=tuple_key)
    got = sorted(names, key=natural_key)
    assert [tuple_key(n) for n in got] == [tuple_key(n) for n in want]
    assert natural_key("layers.2") < natural_key("layers.10")


def whole_name_key(name: str) -> str:
    """The documented encoding applied to the whole name at once (no dot segments, no cache)."""
    def digits(m):
        d = m.group().lstrip("0") or "0"
        return "\0" + chr(0x30 + len(d)) + d
    return re.sub(r"\d+", digits, name)


def test_segment_and_batch_keys_equal_the_whole_name_encoding():
    rng = random.Random(15)
    alphabet = ["0", "00", "7", "10", "007", "99999999999", ".", "..", "_", "a", "layers", "experts", "٣"]
    names = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 9))) for _ in range(3000)]
    names += [f"model.layers.{i}.mlp.experts.{e}.{p}.weight{s}" for i in (0, 9, 10) for e in (0, 7, 255)
              for p in ("gate_proj", "w1") for s in ("", "_scale_inv")]
    names += ["", ".", "a.b", "1.2", "x.0.0", "a..b.c"]
    want = [whole_name_key(n) for n in names]
    assert [natural_key(n) for n in names] == want
    assert natural_keys(names) == want


def test_plan_json_roundtrip():
    import json

    cfg, tensors = small_moe()
    doc = json.loads(RefitDriver("block-fp8", hf_config=cfg).plan(tensors).to_json())
    assert doc["quantization_config"]["quant_method"] == "fp8"
    assert doc["totals"]["block_fp8"]["tensors"] == 4 * (4 + 4 * 3)
    # natural wire order is model order: embeddings, layers by index, then the rest
    assert doc["wire_order"] == "natural"
    assert doc["entries"][0]["name"] == "model.embed_tokens.weight"
    assert [e["name"] for e in doc["entries"][-2:]] == ["lm_head.weight", "model.norm.weight"]


def test_a_plan_prints_as_one_line_of_totals(tiny_model, tiny_hf_config):
    """print(plan) in a notebook: its totals, not every entry (the dataclass repr was the whole plan)."""
    plan = qstrat.RefitDriver("block-fp8", hf_config=tiny_hf_config).plan(tiny_model.state_dict())
    totals = plan.totals()
    want = (f"RefitPlan(layout qwen3_moe, 4 decoder layers, {len(plan.entries)} inputs -> "
            f"{len(plan.outputs())} tensors (passthrough {totals['passthrough']['tensors']} -> "
            f"{totals['passthrough']['outputs']}, block_fp8 {totals['block_fp8']['tensors']} -> "
            f"{totals['block_fp8']['outputs']}))")
    assert repr(plan) == str(plan) == want
    assert len(repr(plan)) < 200
