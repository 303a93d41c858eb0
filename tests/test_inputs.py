"""qstrat.execute.named_tensors: what a trainer may pass (a mapping or (name, tensor) pairs, lazy handles, spec
triples) and the refusals that name the input, before anything is planned or emitted. Bad dtypes
and non-finite values inside the formats: tests/test_input_errors.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from qstrat import PlanError, RefitDriver, TensorSpec, tensor_specs

Q = "model.layers.0.self_attn.q_proj.weight"
K = "model.layers.0.self_attn.k_proj.weight"
NORM = "model.layers.0.input_layernorm.weight"


@pytest.fixture(scope="module")
def state(tiny_model):
    return tiny_model.state_dict()


@pytest.fixture(scope="module")
def driver(tiny_hf_config):
    return RefitDriver("block-fp8", hf_config=tiny_hf_config)


def emitted_before_error(driver, tensors):
    """Run the driver; return (names emitted before it raised, the exception)."""
    names = []
    with pytest.raises(Exception) as info:
        for name, _ in driver.run(tensors):
            names.append(name)
    return names, info.value


@pytest.mark.parametrize("value,message", [
    (None, f"{Q}: value is None, expected a torch.Tensor"),
    (np.zeros((64, 64), dtype=np.float32),
     f"{Q}: is a numpy.ndarray, expected a torch.Tensor (convert it with torch.from_numpy)"),
    (np.float32(1.0), f"{Q}: is a numpy.float32, expected a torch.Tensor (convert it with torch.from_numpy)"),
    ([[1.0, 2.0]], f"{Q}: is a list, expected a torch.Tensor (or a TensorSpec or lazy handle: shape and a torch dtype)"),
    ("weights.bin", f"{Q}: is a str, expected a torch.Tensor (or a TensorSpec or lazy handle: shape and a torch dtype)"),
])
def test_a_value_that_is_not_a_tensor_is_named(driver, state, value, message):
    tensors = {**state, Q: value}
    with pytest.raises(PlanError) as info:
        driver.plan(tensors)
    assert str(info.value) == message
    names, exc = emitted_before_error(driver, tensors)
    assert names == [] and str(exc) == message


def test_every_bad_pair_is_reported_at_once(driver, state):
    pairs = [*state.items(), (Q, None), (NORM, np.ones(64)), (7, torch.ones(2)), ("x",), (K, state[K])]
    with pytest.raises(PlanError) as info:
        driver.plan(pairs)
    assert str(info.value).splitlines() == [
        "invalid input tensors:",
        f"  {Q}: given twice",
        f"  {NORM}: given twice",
        "  tensor names must be strings, got 7 (int)",
        "  expected (name, tensor) pairs, got ('x',)",
        f"  {K}: given twice",
    ]
    pairs = [(Q, None), (NORM, np.ones(64))]
    with pytest.raises(PlanError) as info:
        driver.plan(pairs)
    assert str(info.value).splitlines() == [
        "invalid input tensors:", f"  {Q}: value is None, expected a torch.Tensor",
        f"  {NORM}: is a numpy.ndarray, expected a torch.Tensor (convert it with torch.from_numpy)"]
    with pytest.raises(PlanError, match="expected a mapping or an iterable of .name, tensor. pairs, got Tensor"):
        driver.plan(torch.ones(3))


class Handle:
    """A lazy handle (shape, dtype, load()) whose load() returns ``value``."""

    def __init__(self, shape, dtype, value):
        self.shape, self.dtype, self.value = torch.Size(shape), dtype, value

    def load(self):
        return self.value


@pytest.mark.parametrize("value,got", [
    (torch.ones(4, 8, dtype=torch.bfloat16), "[4, 8] torch.bfloat16"),
    (torch.ones(256, dtype=torch.float32), "[256] torch.float32"),
    (None, "NoneType"),
])
def test_a_lazy_handle_must_load_what_it_declared(driver, state, value, got):
    declared = state[NORM]
    names, exc = emitted_before_error(driver, {**state, NORM: Handle(declared.shape, declared.dtype, value)})
    assert isinstance(exc, PlanError)
    assert str(exc) == (f"{NORM}: load() returned {got}, but the handle declared [256] torch.bfloat16 "
                        "(the plan was made from the declaration)")
    assert NORM not in names


def test_plan_from_spec_triples_equals_plan_from_tensors(tiny_model, tiny_hf_config):
    state = tiny_model.state_dict()
    driver = RefitDriver("mxfp8", hf_config=tiny_hf_config)
    a = driver.plan(tensor_specs([(n, list(t.shape), t.dtype) for n, t in state.items()]))
    assert a.entries == driver.plan(state).entries
    with pytest.raises(PlanError, match="expected .name, shape, dtype."):
        tensor_specs([("x",)])


def test_names_must_be_strings():
    with pytest.raises(PlanError, match="tensor names must be strings, got 5"):
        RefitDriver("block-fp8").plan([(5, torch.empty(2, 2, device="meta"))])


# ---- a TensorSpec (shape and dtype only) where values are needed -----------------------------
def _spec_inputs():
    return {"model.layers.0.mlp.down_proj.weight": TensorSpec((64, 64), torch.bfloat16),
            "model.layers.0.mlp.up_proj.weight": torch.ones(64, 64, dtype=torch.bfloat16)}


SPEC_ERROR = (r"^model\.layers\.0\.mlp\.down_proj\.weight: is a TensorSpec \(a shape and dtype only, for planning\); "
              r"quantizing, sending or writing needs its values: pass the tensor, or a lazy handle with \.load\(\)$")


def test_a_spec_given_as_a_value_is_refused_before_anything_is_emitted(tmp_path):
    from qstrat import RefitDriver
    from qstrat.execute.checkpoint import write_checkpoint
    from qstrat.errors import NoValuesError

    driver = RefitDriver("mxfp8")
    driver.plan(_spec_inputs())  # planning takes specs
    out = driver.run(_spec_inputs())
    with pytest.raises(NoValuesError, match=SPEC_ERROR) as exc:
        next(iter(out))
    assert isinstance(exc.value, TypeError) and isinstance(exc.value, PlanError)
    with pytest.raises(NoValuesError, match=SPEC_ERROR):
        write_checkpoint(driver, _spec_inputs(), tmp_path / "out" / "ckpt")
    assert list(tmp_path.iterdir()) == []
    specs = {f"model.layers.{i}.mlp.down_proj.weight": TensorSpec((64, 64), torch.float32) for i in range(6)}
    with pytest.raises(NoValuesError, match=r"^model\.layers\.0\.mlp\.down_proj\.weight: is a TensorSpec .*\(and "
                                            r"5 more: model\.layers\.1\.mlp\.down_proj\.weight, .* \.\.\.\);"):
        list(driver.run(specs))


def test_a_spec_in_a_stream_is_named_when_it_arrives():
    from qstrat import RefitDriver
    from qstrat.errors import NoValuesError

    driver = RefitDriver("mxfp8")
    plan = driver.plan(_spec_inputs())
    with pytest.raises(NoValuesError, match=SPEC_ERROR):
        list(driver.run(iter(_spec_inputs().items()), plan=plan))


# ---- malformed specs name the tensor (issue 36, item 13) ---------------------------------------
@pytest.mark.parametrize("shape", [None, 5, "ab", (2, -4), (2.5, 4), (True, 4)])
def test_a_malformed_spec_shape_names_the_tensor(shape):
    """The old code: TypeError/ValueError from inside (None, 5, "ab"), and a negative dim was
    accepted, giving negative byte totals for a pass-through tensor."""
    with pytest.raises(PlanError, match=r"^model\.norm\.weight: TensorSpec shape must be a sequence of ints >= 0, "
                                        r"got "):
        tensor_specs([("model.norm.weight", shape, torch.bfloat16)])


def test_a_negative_dimension_from_a_lazy_handle_is_a_plan_error():
    class Handle:  # what a hand-written lazy handle may declare
        shape = (-4, 256)
        dtype = torch.bfloat16

    with pytest.raises(PlanError, match=r"model\.norm\.weight: shape \[-4, 256\] has a negative dimension"):
        RefitDriver("block-fp8").plan({"model.norm.weight": Handle()})
