"""Group contexts: the state a format shares across the members of an engine-fused group.

NVFP4's q/k/v (or one expert's gate/up) share one global scale, computed from every member
before the first is quantized (:meth:`~qstrat.serializers.base.Serializer.group_context`). A
format without a group step (the default ``group_context``) gets no context: nothing waits for
siblings. :class:`GroupContexts` computes each group's context once, checks the members'
values first (so a NaN names the member tensor), and says when a member's input can be
released: after its own quantization, or - for a group with a context - once every member is
quantized.
"""
from __future__ import annotations

from typing import Any

from qstrat.plan.data import RefitPlan
from qstrat.serializers.base import Serializer
from qstrat.execute.stream.window import InputWindow

__all__ = ["GroupContexts"]


class GroupContexts:
    """The fused groups of ``plan`` and the contexts computed so far.

    Args:
        plan: the plan being executed (entries' ``group`` keys).
        inputs: where members' values are read.
        values_checked: NaN/inf already checked for every input (no check here).
    """

    def __init__(self, plan: RefitPlan, inputs: InputWindow, values_checked: bool) -> None:
        self.plan, self.inputs, self.values_checked = plan, inputs, values_checked
        self.members = inputs.index.groups  # group -> entry indices (read only)
        self.contexts: dict[str, Any] = {}  # group -> context, while members remain
        self.stepped: set[str] = set()      # groups whose format has a group step
        self.checked: set[str] = set()      # inputs whose NaN/inf check ran with their group
        self.done: set[int] = set()         # entries quantized

    def context(self, i: int, ser: Serializer) -> Any:
        """The group context of entry ``i`` for format ``ser``: computed once per fused group,
        for formats with a group step; None otherwise.

        Raises: NonFiniteError naming the member tensor (values not checked yet).
        """
        g = self.plan.entries[i].group
        if not g or type(ser).group_context is Serializer.group_context:
            return None
        if g not in self.contexts:
            self.stepped.add(g)
            names = [self.plan.entries[m].name for m in self.members[g]]
            members = [self.inputs.get(n) for n in names]
            if not self.values_checked:  # NaN/inf named by member tensor, not "fusion group member i"
                for n, w in zip(names, members):
                    ser.check_values(w, n)
                    self.checked.add(n)
            self.contexts[g] = ser.group_context(members)
        return self.contexts[g]

    def finish(self, batch: list[int]) -> None:
        """Mark entries quantized; release inputs no pending group context still needs."""
        self.done.update(batch)
        for j in batch:
            g = self.plan.entries[j].group
            if g not in self.stepped:
                self.inputs.release(self.plan.entries[j].name)
            elif all(m in self.done for m in self.members[g]):
                for m in self.members[g]:
                    self.inputs.release(self.plan.entries[m].name)
                self.contexts.pop(g, None)
