"""What runs during a refit: the driver, what runs before the first byte, the execution stream,
the trainer's inputs and the checkpoint sink. The vLLM sinks: :mod:`qstrat.vllm.sink`; the
transport: :mod:`qstrat.transport`.

- :mod:`.driver`: :class:`RefitDriver`: plan, prepare, execute (the facade a trainer uses)
- :mod:`.prepare`: what runs before the first byte: the one preparation every sink goes through
- :mod:`.named_tensors`: the trainer's tensors: ``NamedTensors``, ``TensorSpec``, ``tensor_specs``
- :mod:`.sharding`: sharded trainers: which rank emits what, global expert names
- :mod:`.checkpoint`: the safetensors sink: a refit written as an HF checkpoint vLLM loads
- :mod:`.mix_rule`: the MIX flag rule every engine sink follows (in-process and transport)
- :mod:`.stream` (package): plan execution: inputs as they arrive, outputs in wire order, expert
  batches
"""
