"""WrappedScheduler: an LR scheduler that steps once per real (non-skipped) update of its wrapped optimizer."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memwrap.state.checks import check_scheduler_state, class_name

if TYPE_CHECKING:
    from memwrap.runtime.optimizer import WrappedOptimizer

__all__ = ["WrappedScheduler"]


class WrappedScheduler:
    """Steps the inner LR scheduler only when its optimizer made a real, non-skipped update since the last step.

    Called every micro-batch, it steps once per update; called once per epoch (StepLR per epoch,
    ReduceLROnPlateau), it steps if the epoch made at least one update, whichever micro-batch closed it.

    Example:
        >>> import memwrap, torch
        >>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        >>> model, opt, sched = memwrap.wrap(model, opt, sched, accumulate=4)
    """

    def __init__(self, scheduler: Any, optimizer: WrappedOptimizer):
        self.scheduler = scheduler
        self.optimizer = optimizer
        self.updates_seen = optimizer.updates

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self.optimizer.updates > self.updates_seen:
            self.updates_seen = self.optimizer.updates
            self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "updates_seen": self.updates_seen,
                "scheduler_class": class_name(self.scheduler)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` (or a plain scheduler's); another kind of scheduler's state is refused first."""
        plain = not isinstance(state_dict, dict) or "updates_seen" not in state_dict
        inner = state_dict if plain else state_dict.get("scheduler")
        check_scheduler_state(self.scheduler, self.optimizer.optimizer, inner,
                              None if plain else state_dict.get("scheduler_class"))
        if plain:
            self.scheduler.load_state_dict(state_dict)
            self.updates_seen = self.optimizer.updates
            return
        self.scheduler.load_state_dict(state_dict["scheduler"])
        self.updates_seen = state_dict["updates_seen"]
