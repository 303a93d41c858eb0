"""Exceptions raised by qstrat.

Every error that a user can fix names the tensor or the config key it is about.
All of them derive from :class:`QstratError` (a ``ValueError``), so callers can catch one type.
"""
from __future__ import annotations


class QstratError(ValueError):
    """Base class of every qstrat error."""


class ConfigError(QstratError):
    """A config value is invalid. The message names the key path (``rules[2].serializer``)."""


class PluginError(QstratError):
    """A plugin is malformed, missing a required field, or clashes with another plugin's name."""


class UnsupportedShapeError(QstratError):
    """A format cannot represent a tensor of this shape (e.g. MXFP8 with K % 32 != 0) or dtype
    (a serializer reads bfloat16, float16 or float32 weights)."""


class NonFiniteError(QstratError):
    """A weight holds NaN or +-inf; the message names the tensor and the first bad index."""


class PlanError(QstratError):
    """The refit plan is inconsistent (name conflicts, mixed engine formats, missing fusion partners)."""


class EngineManifestError(QstratError):
    """qstrat cannot say what an engine accepts: a quantization_config no registered format
    writes, a model config the layout does not cover, or a disagreement between qstrat's engine
    manifest and vLLM's own record of the model. Nothing was sent."""


class EngineBuildError(EngineManifestError):
    """vLLM built a module in another format than the engine's ``quantization_config`` (the plan)
    says - e.g. quantized from BF16 weights with no scales, which serves NaN. The message names
    the module, both formats and the fix. Raised right after an engine starts; the engine qstrat
    started is released first."""


class EngineStateError(QstratError, RuntimeError):
    """A refit failed after the engine began its reload (out of memory, an engine-side fault, an
    error while streaming). vLLM's layerwise reload has no rollback: the reload is finalized and
    the engine flagged as holding a mix of two rounds; a partial refit of it is then refused with
    this error (nothing sent), and a whole refit that loads clears the flag."""


class TransportError(QstratError):
    """A cross-process refit failed on the wire (checksum, truncated stream, lost peer, timeout,
    another protocol version); the message names the rank and bucket. Nothing was handed to the
    engine, unless it is a :class:`MixedWeightsError`."""


class TransportConfigError(TransportError, ConfigError):
    """A sender was built with an invalid argument (a mode, a rank), before any connection: both
    a :class:`TransportError` (what the transport raised for it before) and a
    :class:`ConfigError`; the message names the argument and the valid values."""


class WireManifestMismatchError(TransportError):
    """A wire manifest (:mod:`qstrat.transport.wire_manifest`: where each tensor lies in a transfer
    round; not the engine manifest) is malformed or does not match what the receiving engine accepts;
    raised before any tensor data is received."""


class TransferAuthError(TransportError):
    """A transfer round (or an ``init_weight_transfer_engine``) was refused by authentication: no
    valid MAC (no secret, a wrong key, tampered), a replayed round, or an init info pointing the
    engine at another address than the configured one. Raised before any tensor data is loaded;
    the message never contains the secret."""


class MixedWeightsError(TransportError):
    """A transfer round was not committed everywhere while some rank holds new weights (bounded
    mode: units loaded before a fault on any rank; atomic mode: a load that raised part-way in
    ``finish_weight_update``): those ranks hold a mix of the old and the new weights and are
    flagged (the message names them). The engines keep running; qstrat refuses partial refits of
    a flagged engine until a whole refit succeeds."""


class BackendUnavailableError(QstratError, RuntimeError):
    """A rule's ``backend`` option cannot run here (``triton`` without triton, or on CPU tensors
    without ``TRITON_INTERPRET=1``). Raised when the plan is checked, before anything is written
    or sent; also a ``RuntimeError`` for callers that caught the earlier type."""


class VerificationError(QstratError):
    """A written checkpoint does not match its plan (names, shapes, dtypes, config or bytes)."""


class NoValuesError(PlanError, TypeError):
    """An input that has only a shape and dtype (a :class:`qstrat.execute.named_tensors.TensorSpec`, for planning)
    was given where its values are needed (quantizing, sending, writing); the message names it."""


class InputMismatchError(PlanError):
    """An input read from a stream differs from its plan entry in shape or dtype (or is not a
    tensor): the message names the input, what arrived and what was planned. Raised where the
    stream reads it; a transport round that reused its kept plan (:class:`qstrat.execute.driver.PlanCache`)
    then aborts with nothing loaded and is planned and sent again."""


class ConfigOnlyUnsupportedError(PlanError):
    """qstrat cannot derive this model's tensors from its config.json alone (a structure its
    layout does not generate - the default generator's hybrid linear attention and vision towers,
    per-expert names of gpt-oss's slab-only experts -, a family no layout matches): plan the
    trainer's state_dict() instead. An engine of such a family gets no manifest and is not refit."""


class FidelityError(QstratError, RuntimeError):
    """After a refit, the engine's logprobs on the probe sequences differ from the trainer's
    model with the same quantized weights by more than the format's threshold
    (:mod:`qstrat.vllm.fidelity.probe`): the engine does not serve what was sent. The reload itself
    completed; ``.report`` holds the measured :class:`~qstrat.vllm.fidelity.probe.FidelityReport`."""

    def __init__(self, message: str, report: object = None) -> None:
        super().__init__(message)
        self.report = report
