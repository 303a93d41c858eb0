"""Rule matching: which serializer each tensor gets, and why (the config's decisions).

A :class:`RuleSet` is a validated :class:`~qstrat.config.loader.RefitConfig` compiled against a
registry: its selectors resolved, its include/exclude patterns compiled. :meth:`RuleSet.decide`
turns one :class:`~qstrat.layouts.model_layout.ParsedName` into a :class:`Decision`, in this order:

1. not a weight matrix (1-D, biases, scalars): ``passthrough``;
2. ``keep_bf16.first`` / ``keep_bf16.last`` decoder layers: nothing in them is quantized, whatever
   the rules say: quantizable kinds get ``bf16``; a special kind (a router, a ``sensitive``
   projection) that a rule would quantize - a ``routers`` selector, an ``allow_special`` rule -
   is sent unchanged (``passthrough``, rule ``keep_bf16.first``/``.last``), as without the rule;
3. the rules in order, first match wins (the user's rules, then the preset's);
4. ``default`` for quantizable kinds no rule matched; ``passthrough`` for everything else
   (routers, embeddings, lm_head, norms, MTP and vision tensors are never quantized unless a
   special selector or an ``allow_special`` rule names them).

No shapes are checked here (that is the planner's job: :mod:`qstrat.plan.planner`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qstrat.plugins.builtin.selectors import BUILTIN_SELECTORS
from qstrat.config.schema import preset_rules
from qstrat.errors import PlanError, PluginError
from qstrat.layouts.model_layout import QUANTIZABLE_KINDS, SPECIAL_KINDS, ParsedName
from qstrat.config.patterns import NamePattern, any_match

if TYPE_CHECKING:
    from qstrat.config.schema import RefitConfig, Rule
    from qstrat.plugins.registry import Registry
    from qstrat.plugins.selector import Selector

#: Serializer name of tensors sent unchanged (not a registered format).
PASSTHROUGH = "passthrough"
#: Special kinds an ``allow_special`` rule's include patterns may select.
OPT_IN_KINDS = frozenset({"router", "embedding", "lm_head", "sensitive"})
#: The built-in :class:`~qstrat.plugins.selector.Selector` objects (by identity): their predicates read
#: ``ParsedName.kind`` alone (:meth:`RuleSet.structural`).
_BUILTIN_SELECTOR_IDS = frozenset(id(s) for s in BUILTIN_SELECTORS)


@dataclass(frozen=True)
class Decision:
    """How one tensor is treated: ``serializer`` (name or ``passthrough``), its ``options``, the
    ``rule`` that decided (``rules[0]``, ``keep_bf16.first``, ``default``, ``never quantized:
    router``...), the parsed name (``kind``, ``layer``...) and, from a plan
    (:func:`qstrat.select`), its ``note`` (why a BF16 fallback replaced the rule's format)."""

    serializer: str
    options: dict[str, Any]
    rule: str
    parsed: ParsedName
    note: str = ""


def kept_bf16(p: ParsedName, num_layers: int | None, first: int, last: int) -> bool:
    """True if ``p`` is in the first ``first`` or last ``last`` decoder layers.

    Args:
        p: parsed name (MTP and non-decoder tensors are never decoder layers).
        num_layers: decoder depth (needed for ``last``); None with ``last > 0`` is an error
            caught at plan time.
    """
    if p.layer is None or p.kind == "mtp":
        return False
    if p.layer < first:
        return True
    return bool(last) and num_layers is not None and p.layer >= num_layers - last


class CompiledRule:
    """One config rule with its selectors looked up and its patterns compiled.

    Attributes: label (``rules[i]``), rule (the :class:`~qstrat.config.loader.Rule`).
    """

    def __init__(self, index: int, rule: Rule, registry: Registry) -> None:
        self.label = f"rules[{index}]"
        self.rule = rule
        self.selectors = [registry.lookup("selectors", s).obj for s in rule.select]
        self._origins = {id(e.obj): e.origin for e in (registry.lookup("selectors", s) for s in rule.select)}
        self.include = [NamePattern(t) for t in rule.include]
        self.exclude = [NamePattern(t) for t in rule.exclude]

    def _predicate(self, s: Selector, p: ParsedName) -> bool:
        """``s.predicate(p)``; PluginError naming the selector, its plugin and the tensor when it
        raises or returns anything but a bool (a tensor's truth value, a None...)."""
        try:
            hit = s.predicate(p)
        except Exception as exc:
            raise PluginError(f"selector {s.name!r} from {self._origins[id(s)]}: its predicate raised "
                              f"{type(exc).__name__}: {exc} on {p.name}") from exc
        if hit is not True and hit is not False:
            raise PluginError(f"selector {s.name!r} from {self._origins[id(s)]}: its predicate must return a "
                              f"bool, got {type(hit).__name__} on {p.name}")
        return hit

    def selects(self, p: ParsedName, expert_names: Sequence[str] = ()) -> bool:
        """Selectors (any) AND include (any, if given) AND NOT exclude (any); patterns are
        matched against ``p.checkpoint_name`` - and, for a grouped slab, against the per-expert
        checkpoint names it is emitted as (``expert_names``: ``...experts.3.gate_proj.weight``,
        what vLLM loads and what a per-expert trainer holds), so a pattern decides a slab as it
        decides the same experts held per expert: a slab matches when its own name or every one
        of its per-expert names passes the patterns.

        Raises: PlanError naming the rule and a per-expert name on each side when the patterns
            pass some of a slab's per-expert names and not others (a slab is one engine module:
            it cannot be split between rules)."""
        # Special kinds (routers, embeddings, lm_head...) count only for selectors that declare
        # them (``special=True``): a third-party selector cannot quantize a router by accident.
        special = p.kind in SPECIAL_KINDS
        chosen = False
        for s in self.selectors:  # any(), first match wins
            if (s.special or not special) and self._predicate(s, p):
                chosen = True
                break
        if not chosen and self.rule.allow_special and self.include:
            chosen = p.kind in OPT_IN_KINDS  # explicit: include patterns may name these
        if not chosen:
            return False
        # patterns see the CHECKPOINT name (wrappers stripped, the layout's renames applied):
        # one name form whatever wraps the trainer's model (docs/config.md)
        if not self.include and not self.exclude:
            return True
        own = p.checkpoint_name
        if not expert_names:
            return self._passes(own)
        included = not self.include or any_match(self.include, own)
        excluded = bool(self.exclude) and any_match(self.exclude, own)
        verdicts = {n: not excluded and (included or any_match(self.include, n)) and
                    not (self.exclude and any_match(self.exclude, n)) for n in expert_names}
        if all(verdicts.values()):
            return True
        if not any(verdicts.values()):
            return False
        yes = next(n for n, v in verdicts.items() if v)
        no = next(n for n, v in verdicts.items() if not v)
        raise PlanError(f"{self.label}: its include/exclude patterns match some of this grouped slab's per-expert "
                        f"names ({yes}) and not others ({no}); the slab is one engine module and takes one "
                        "rule: write patterns that match all of its experts and projections or none")

    def _passes(self, name: str) -> bool:
        """Include (any, if given) AND NOT exclude (any) on one checkpoint name."""
        if self.include and not any_match(self.include, name):
            return False
        return not (self.exclude and any_match(self.exclude, name))


class RuleSet:
    """The decisions of one config (see the module docstring for their order).

    Args:
        config: a validated RefitConfig (preset already merged).
        registry: where the rules' selectors are looked up.
    """

    def __init__(self, config: RefitConfig, registry: Registry) -> None:
        self.config = config
        self.rules = [CompiledRule(i, r, registry) for i, r in enumerate(config.rules)]
        #: the registered formats (a refusal names those that would serve: qstrat.plan.fixes)
        self.formats = tuple(registry.serializers)
        #: the index of the first rule the config's preset added (len(rules): none)
        self.preset_from = len(self.rules) - len(preset_rules(config.preset, registry.strategies))

    def decide(self, p: ParsedName, matrix: bool, num_layers: int | None,
               expert_names: Sequence[str] = ()) -> Decision:
        """The decision for one parsed tensor name.

        Args:
            p: from :meth:`ModelLayout.parse`.
            matrix: whether the tensor is a weight matrix (2-D ``weight``) or a grouped slab
                (3-D); anything else is sent unchanged.
            num_layers: decoder depth, for ``keep_bf16.last``.
            expert_names: for a grouped slab, the per-expert checkpoint names it is emitted as
                (:meth:`CompiledRule.matches`; :meth:`patterned` says whether they are read).
        Raises: PlanError for a slab that patterns would split (:meth:`CompiledRule.matches`).
        """
        return Decision(*self.choose(p, matrix, num_layers, expert_names), p)

    @property
    def patterned(self) -> bool:
        """Whether any rule has include/exclude patterns (only then are a slab's per-expert
        names read by :meth:`choose`)."""
        return any(r.include or r.exclude for r in self.rules)

    def choose(self, p: ParsedName, matrix: bool, num_layers: int | None,
               expert_names: Sequence[str] = ()) -> tuple[str, dict[str, Any], str]:
        """:meth:`decide`'s ``(serializer, options, rule)``, without the :class:`Decision` (the
        planner's per-tensor path)."""
        if not matrix:
            return PASSTHROUGH, {}, "not a weight matrix"
        keep = self.config.keep_bf16
        kept = kept_bf16(p, num_layers, keep.first, keep.last)
        if kept:
            which = "first" if p.layer is not None and p.layer < keep.first else "last"
            if p.kind in QUANTIZABLE_KINDS:
                return "bf16", {}, f"keep_bf16.{which}"
        for rule in self.rules:
            if rule.selects(p, expert_names):
                if kept:  # a special kind (router...) a rule opted in: the kept layer wins
                    return PASSTHROUGH, {}, f"keep_bf16.{which}"
                return rule.rule.serializer, dict(rule.rule.options), rule.label
        if p.kind in QUANTIZABLE_KINDS:
            return self.config.default, {}, "default"
        return PASSTHROUGH, {}, f"never quantized: {p.kind}"

    def structural(self) -> bool:
        """Whether every decision depends on a name only through its structure - the parsed
        ``kind``, ``projection``, ``expert``, ``slab``, ``param`` - and on its layer only through
        ``keep_bf16``: every rule selects with built-in selectors (each reads ``kind`` alone) and
        has no include/exclude patterns (they read the name). The planner then derives one
        layer's entries from another's (:mod:`qstrat.plan.families`)."""
        return all(not r.include and not r.exclude and all(id(s) in _BUILTIN_SELECTOR_IDS for s in r.selectors)
                   for r in self.rules)

    def rule_for(self, label: str) -> Rule | None:
        """The config rule labelled ``rules[i]``, or None (``default``, ``keep_bf16.*``...)."""
        return next((r.rule for r in self.rules if r.label == label), None)


def is_weight_matrix(p: ParsedName, ndim: int) -> bool:
    """A 2-D ``weight`` or a 3-D grouped expert slab (``ndim``: the tensor's rank): what a
    serializer may quantize."""
    return (ndim == 2 and p.param == "weight") or (ndim == 3 and p.slab)
