"""What the assistant says when it ends a per-turn turn without a tool call (``closing`` of prepare-data; the
oracle's replies under the per-turn protocols of `rcgrpo eval`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ClosingTexts:
    """What the assistant says when it ends a per-turn turn without a tool call."""

    completed: str = "I have completed the request."
    missing_parameter: str = "I cannot do this yet: some required information is missing. Could you provide it?"
    missing_function: str = "None of the available tools can do this, so I cannot complete this request."
    nothing_to_do: str = "There is nothing to do for this request with the available tools."

    def for_turn(self, task: Any, turn: int, planned_calls: int) -> str:
        """``task``: one with ``ground_truth`` (its calls per turn) and ``category`` (BFCL's task records)."""
        if planned_calls or task.ground_truth[turn]:
            return self.completed  # also a premature stop: the agent believes it is done
        if task.category == "miss_param":
            return self.missing_parameter
        if task.category == "miss_func":
            return self.missing_function
        return self.nothing_to_do
