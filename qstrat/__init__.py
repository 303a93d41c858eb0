"""qstrat: pluggable quantization strategies for refitting vLLM from an RL trainer.

Public API::

    cfg = qstrat.load_config("refit.yaml")          # or a mapping / preset name
    driver = qstrat.RefitDriver(cfg, hf_config=hf_config)   # the checkpoint's config.json, as a dict
    plan = driver.plan(model.state_dict())          # every decision, before any work
    plan = driver.plan(qstrat.tensor_specs(specs))  # ... or from (name, shape, dtype) alone
    for name, tensor in driver.run(pairs, plan=plan):     # a stream, consumed once
    for name, tensor in driver.run(model.state_dict()):   # engine checkpoint format, wire order
        ...
    qstrat.vllm.refit(llm, driver, model.state_dict())    # into a running vLLM
    qstrat.select(cfg, model)                        # per-module decisions for the trainer
    qstrat.get_serializer("mxfp8").quantize(w)       # one format directly
"""
from qstrat.config.loader import KeepBF16, RefitConfig, Rule, load_config
from qstrat.execute.driver import RefitDriver
from qstrat.execute.named_tensors import TensorSpec, tensor_specs
from qstrat.errors import (ConfigError, NonFiniteError, PlanError, PluginError, QstratError,
                           UnsupportedShapeError)
from qstrat.plan import OutputTensor, PlanEntry, RefitPlan
from qstrat.plugins.registry import Registry, get_registry, get_serializer
from qstrat.config.rules import Decision
from qstrat.plan.trainer_decisions import select
from qstrat.serializers.base import PartSpec, Serializer, SerializerOptions

__version__ = "0.1.0"

__all__ = [
    "ConfigError", "Decision", "KeepBF16", "NonFiniteError", "OutputTensor", "PartSpec",
    "PlanEntry", "PlanError", "PluginError", "QstratError", "RefitConfig", "RefitDriver",
    "RefitPlan", "Registry", "Rule", "Serializer", "SerializerOptions", "TensorSpec",
    "UnsupportedShapeError", "get_registry", "get_serializer", "load_config", "select", "tensor_specs", "vllm",
]


def __getattr__(name: str):  # qstrat.vllm without importing vLLM at `import qstrat`
    if name == "vllm":
        import importlib

        return importlib.import_module("qstrat.vllm")
    raise AttributeError(name)
