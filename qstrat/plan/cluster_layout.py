"""The two sides of a refit at cluster scale, as the command line writes them.

``ep8xfsdp8`` (the trainer: 8 expert-parallel groups x 8 FSDP ranks, 64 processes),
``tp8xdp16`` (the engines: 16 replicas of a tensor-parallel-8 vLLM engine, 128 ranks),
``tp8xdp16xep`` (the same with vLLM's expert parallelism inside each replica), and a link rate
(``400gbit``: bits per second, per GPU, as NICs are sold). Parsed into values the routing model
(:mod:`qstrat.plan.cluster`) reads; a bad token is an error naming it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from qstrat.errors import ConfigError

#: vLLM's expert placements (``determine_expert_map``'s ``expert_placement_strategy``).
PLACEMENTS = ("linear", "round_robin")
#: Link rate units, bits per second (decimal, as ``tc(8)`` and NIC data sheets count).
RATE_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


@dataclass(frozen=True)
class TrainerLayout:
    """The trainer's ranks: ``ep`` expert-parallel groups of ``fsdp`` FSDP ranks each.

    Trainer rank ``ep_rank * fsdp + fsdp_rank``; expert-parallel group ``g`` holds the routed
    experts ``[g * E / ep, (g + 1) * E / ep)`` (:class:`qstrat.execute.sharding.ExpertParallel`).
    """

    ep: int = 1
    fsdp: int = 1

    @property
    def world(self) -> int:
        """Trainer processes (each one GPU, each one outgoing link)."""
        return self.ep * self.fsdp

    def __str__(self) -> str:
        return f"ep{self.ep}xfsdp{self.fsdp}"


@dataclass(frozen=True)
class EngineLayout:
    """The engines: ``dp`` replicas of one vLLM engine with ``tp`` tensor-parallel ranks;
    ``ep``: vLLM's expert parallelism inside each replica (``enable_expert_parallel=True``: the
    expert-parallel group is the replica's ``tp`` ranks), experts placed by ``placement``.

    Engine rank ``replica * tp + tp_rank`` (each one GPU, one incoming link).
    """

    tp: int = 1
    dp: int = 1
    ep: bool = False
    placement: str = "linear"

    @property
    def world(self) -> int:
        """Engine processes over all replicas."""
        return self.tp * self.dp

    def __str__(self) -> str:
        return f"tp{self.tp}xdp{self.dp}" + ("xep" if self.ep else "") + \
            (f" ({self.placement})" if self.ep else "")


#: The largest group size a layout token takes (ranks of one parallel group; bounds the routing
#: arithmetic, which loops over ranks).
MAX_GROUP = 65536
#: The fastest link rate taken, bits per second (1 Pbit/s: far above any NIC or NVLink).
MAX_RATE = 1e15


def _tokens(text: str, what: str, allowed: tuple[str, ...]) -> dict[str, int | None]:
    """``{"tp": 8, "ep": None, ...}`` from ``tp8xdp16xep``.

    Raises: ConfigError naming ``what`` and the bad token (unknown, repeated, zero, malformed).
    """
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{what}: empty layout; expected tokens such as {'x'.join(allowed)} joined by 'x'")
    found: dict[str, int | None] = {}
    for token in text.strip().lower().split("x"):
        m = re.fullmatch(r"([a-z]+)([0-9]*)", token, re.ASCII)
        if m is None or m.group(1) not in allowed:
            raise ConfigError(f"{what} {text!r}: bad token {token!r}; expected one of "
                              f"{', '.join(a + 'N' for a in allowed)} joined by 'x' (e.g. ep8xfsdp8, tp8xdp16)")
        key, digits = m.group(1), m.group(2)
        if key in found:
            raise ConfigError(f"{what} {text!r}: token {token!r} repeats {key!r}")
        value = int(digits) if digits else None
        if value is not None and not 1 <= value <= MAX_GROUP:
            raise ConfigError(f"{what} {text!r}: token {token!r}: a size must be 1 to {MAX_GROUP}")
        found[key] = value
    return found


def _size(found: dict[str, int | None], key: str, text: str, what: str) -> int:
    value = found.get(key, 1)
    if value is None:
        raise ConfigError(f"{what} {text!r}: token {key!r} needs a size ({key}8)")
    return value


def parse_trainer_layout(text: str) -> TrainerLayout:
    """``ep8xfsdp8`` -> ``TrainerLayout(ep=8, fsdp=8)`` (missing tokens are 1).

    Raises: ConfigError naming the bad token.
    """
    what = "--trainer-layout"
    found = _tokens(text, what, ("ep", "fsdp"))
    return TrainerLayout(ep=_size(found, "ep", text, what), fsdp=_size(found, "fsdp", text, what))


def parse_engine_layout(text: str, placement: str = "linear") -> EngineLayout:
    """``tp8xdp16`` / ``tp8xdp16xep`` (or ``xep8``, the size equal to ``tp``) -> EngineLayout.

    Raises: ConfigError naming the bad token, an ``epN`` other than ``tp`` (vLLM's
        expert-parallel group is a replica's TP ranks here: replicas are separate engines), or an
        unknown placement.
    """
    what = "--engine-layout"
    found = _tokens(text, what, ("tp", "dp", "ep"))
    tp, dp = _size(found, "tp", text, what), _size(found, "dp", text, what)
    ep = "ep" in found
    if ep and found["ep"] not in (None, tp):
        raise ConfigError(f"{what} {text!r}: token 'ep{found['ep']}': vLLM's expert-parallel group is each "
                          f"replica's {tp} tensor-parallel ranks (replicas are separate engines); write 'ep' "
                          f"or 'ep{tp}'")
    if placement not in PLACEMENTS:
        raise ConfigError(f"--expert-placement {placement!r}: expected one of {', '.join(PLACEMENTS)} "
                          "(vLLM's expert_placement_strategy)")
    return EngineLayout(tp=tp, dp=dp, ep=ep, placement=placement)


def parse_link_rate(text: str) -> float:
    """Bits per second of ``400gbit`` / ``1.6tbit`` / ``500mbit`` (decimal units).

    Raises: ConfigError naming the rate when it is not ``<positive number><kbit|mbit|gbit|tbit>``
        at most :data:`MAX_RATE` (a finite rate: an overflowing one would make every time 0).
    """
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([a-z]+)", str(text).strip().lower(), re.ASCII)
    if m is None or m.group(2) not in RATE_UNITS or not 0 < float(m.group(1)) * RATE_UNITS[m.group(2)] <= MAX_RATE:
        raise ConfigError(f"--link {text!r}: expected a rate in bits per second such as 400gbit, 100gbit, "
                          f"1.6tbit (units {', '.join(RATE_UNITS)})")
    return float(m.group(1)) * RATE_UNITS[m.group(2)]
