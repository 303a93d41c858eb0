"""Integrations and refits an attacker found failing unclearly or half-applying (issue 42): each
test failed on f44ce35 - a /server_info that is not a mapping crashed with AttributeError, ..."""
from __future__ import annotations

import pytest
import torch

from qstrat.errors import ConfigError


# ---- TRL server: a /server_info that is not a mapping ----------------------------------------------
class _Fp8Plan:
    engine_quantization = None

    def vllm_quantization_config(self):
        return {"quant_method": "fp8", "weight_block_size": [128, 128]}


@pytest.mark.parametrize("info,kind", [(None, "NoneType"), (["fp8"], "list"), ("qstrat", "str")])
def test_trl_server_check_refuses_a_server_info_that_is_not_a_mapping_as_a_config_error(info, kind):
    """check_server_info read ``info.get(...)`` on whatever /server_info answered: None, a list
    or a string raised AttributeError; it is a ConfigError naming ``server_info`` and the type."""
    from qstrat.integrations.trl_server import check_server_info

    with pytest.raises(ConfigError, match=rf"^server_info: the vLLM server at http://s:8000 answered "
                                          rf"/server_info with a {kind} "):
        check_server_info(info, _Fp8Plan(), "http://s:8000")


# ---- SkyRL: a NaN deep in the stream ---------------------------------------------------------------
def test_skyrl_source_refuses_a_nan_in_the_last_layer_before_the_first_tensor():
    """QstratWeightSource checked values as it streamed: a NaN in the last layer was raised after
    every earlier tensor had been yielded to vLLM's layerwise reload (no rollback, no flag on the
    trainer side). It is raised before the first tensor now, naming the tensor."""
    from vllm.distributed.weight_transfer.base import ModuleSource

    from qstrat import NonFiniteError, RefitDriver
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.integrations.skyrl import QstratWeightSource

    model = build_tiny_qwen3_moe(seed=1)
    last = max(int(n.split(".")[2]) for n, _ in model.named_parameters() if n.startswith("model.layers."))
    name = f"model.layers.{last}.self_attn.o_proj.weight"
    with torch.no_grad():
        dict(model.named_parameters())[name][1, 2] = float("nan")
    source = QstratWeightSource(ModuleSource(model), RefitDriver("block-fp8", hf_config=hf_config(model)))
    yielded = []
    with pytest.raises(NonFiniteError, match=rf"{name}"):
        for item in source:
            yielded.append(item[0])
    assert yielded == []
    inline = QstratWeightSource(ModuleSource(model), RefitDriver("block-fp8", hf_config=hf_config(model)),
                                values="inline")
    got = []
    with pytest.raises(NonFiniteError, match=rf"{name}"):
        for item in inline:
            got.append(item[0])
    assert len(got) > 10  # what the stream did before: the earlier layers were handed over


# ---- NeMo-RL: an interrupted step's buckets ---------------------------------------------------------
def _nemo_extension(monkeypatch):
    """qstrat's NeMo-RL extension over a stand-in for NeMo-RL 0.7.0's ``VllmInternalWorkerExtension``
    (NeMo-RL is not on the package index; docs/integrations.md ran the real one): its receiver
    hands each bucket to ``_load_weights``, and fails after ``fail_after`` buckets when set.
    Returns (the extension, what refit_worker received per call)."""
    import sys
    import types

    class Stock:
        fail_after = None

        def prepare_refit_info(self, info):
            self.state_dict_info = info

        def update_weights_from_collective(self, buckets):
            for i, bucket in enumerate(buckets):
                if i == self.fail_after:
                    raise RuntimeError("NCCL timeout")
                self._load_weights(bucket)
            return True

        update_weights_via_ipc_zmq = update_weights_from_collective

    backend = types.ModuleType("nemo_rl.models.generation.vllm.vllm_backend")
    backend.VllmInternalWorkerExtension = Stock
    for name in ("nemo_rl", "nemo_rl.models", "nemo_rl.models.generation", "nemo_rl.models.generation.vllm"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, backend.__name__, backend)
    monkeypatch.delitem(sys.modules, "qstrat.integrations.nemo_rl", raising=False)
    import qstrat.integrations.nemo_rl as ext

    loaded = []
    monkeypatch.setattr(ext, "refit_worker", lambda worker, tensors: loaded.append(tensors) or "report")
    worker = ext.QstratWorkerExtension()
    worker.prepare_refit_info({n: ((1,), torch.bfloat16) for n in "abc"})
    return worker, loaded


@pytest.mark.parametrize("receiver", ["update_weights_from_collective", "update_weights_via_ipc_zmq"])
def test_nemo_rl_a_step_after_an_interrupted_one_loads_only_its_own_buckets(monkeypatch, receiver):
    """Step 1 sends buckets a, b and its receiver fails before c; step 2 sends c, a, b. The
    extension kept step 1's a, b (``_qstrat_pending``), so step 2's c completed the set and the
    engine loaded step 1's a, b with step 2's c. Each receiver call starts a step now."""
    worker, loaded = _nemo_extension(monkeypatch)
    step = {n: lambda s, n=n: [(n, torch.full((1,), s, dtype=torch.bfloat16))] for n in "abc"}
    worker.fail_after = 2
    with pytest.raises(RuntimeError, match="NCCL timeout"):
        getattr(worker, receiver)([step["a"](1), step["b"](1), step["c"](1)])
    assert loaded == []
    worker.fail_after = None
    assert getattr(worker, receiver)([step["c"](2), step["a"](2), step["b"](2)]) is True
    assert len(loaded) == 1
    assert {n: float(t) for n, t in loaded[0].items()} == {"a": 2.0, "b": 2.0, "c": 2.0}
    assert worker.qstrat_reports == ["report"]


def test_nemo_rl_a_bucket_naming_a_received_tensor_starts_a_new_step(monkeypatch):
    """Without NeMo-RL's receivers (``_load_weights`` called directly), a tensor that arrives twice
    means a new step began: the earlier step's buckets are dropped, not mixed in."""
    worker, loaded = _nemo_extension(monkeypatch)
    one = torch.ones(1, dtype=torch.bfloat16)
    worker._load_weights([("a", one), ("b", one)])
    worker._load_weights([("a", 2 * one)])
    worker._load_weights([("c", 2 * one)])  # completed the set with step 1's b before
    assert loaded == []
    worker._load_weights([("b", 2 * one)])
    assert [{n: float(t) for n, t in d.items()} for d in loaded] == [{"a": 2.0, "b": 2.0, "c": 2.0}]


@pytest.mark.parametrize("receiver", ["update_weights_from_collective", "update_weights_via_ipc_zmq"])
def test_nemo_rl_a_short_step_is_refused_not_reported_loaded(monkeypatch, receiver):
    """A receiver call whose buckets hold only a and b of the announced a, b, c returned True
    although nothing was reloaded (the step stayed pending). Now the step is refused, naming what
    is missing, and its buckets do not complete the next step."""
    from qstrat.errors import PlanError

    worker, loaded = _nemo_extension(monkeypatch)
    step = {n: lambda s, n=n: [(n, torch.full((1,), s, dtype=torch.bfloat16))] for n in "abc"}
    with pytest.raises(PlanError, match=r"the step ended with 2 of the 3 tensors prepare_refit_info announced "
                                        r"\(missing: \['c'\]\); .*nothing was reloaded"):
        getattr(worker, receiver)([step["a"](1), step["b"](1)])
    assert loaded == []
    with pytest.raises(PlanError, match=r"ended with 1 of the 3 tensors .*missing: \['a', 'b'\]"):
        getattr(worker, receiver)([step["c"](2)])  # step 1's a, b were dropped: no mix
    assert loaded == []
    assert getattr(worker, receiver)([step["c"](3), step["b"](3), step["a"](3)]) is True
    assert [{n: float(t) for n, t in d.items()} for d in loaded] == [{"a": 3.0, "b": 3.0, "c": 3.0}]


def test_skyrl_source_gathers_once_and_a_short_pass_yields_nothing():
    """values="first" gathered the source twice per sync (a check pass, then a quantizing pass),
    and the second pass could differ: a short second pass (a rank's gather cut off) was refused
    only after every earlier tensor had been yielded to vLLM's reload. Now one gather per sync, and
    a short pass is refused before the first tensor."""
    from vllm.distributed.weight_transfer.base import ModuleSource

    from qstrat import PlanError, RefitDriver
    from qstrat.cli.demo.tiny_model import build_tiny_qwen3_moe, hf_config
    from qstrat.integrations.skyrl import QstratWeightSource

    model = build_tiny_qwen3_moe(seed=1)

    class Gathers(ModuleSource):
        """Counts passes; pass number ``short`` stops 5 tensors early."""
        passes, short = 0, None

        def __iter__(self):
            type(self).passes += 1
            items = list(super().__iter__())
            yield from (items[:-5] if self.passes == self.short else items)

    source = QstratWeightSource(Gathers(model), RefitDriver("block-fp8", hf_config=hf_config(model)))
    assert len(list(source)) == len(source.plan.outputs()) and Gathers.passes == 1
    Gathers.passes, Gathers.short = 0, 2  # the second pass of a sync is short
    got = list(source)  # pass 1 (full)
    yielded = []
    with pytest.raises(PlanError):
        for name, _ in source:  # pass 2 (short)
            yielded.append(name)
    assert len(got) == len(source.plan.outputs()) and yielded == [] and Gathers.passes == 2
