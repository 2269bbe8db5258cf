"""Memory planning: predict a configuration's peak before it runs, pick the fastest that fits,
and watch memory during real training.

Example:
    >>> import memwrap
    >>> from memwrap.models import build_preset, preset_batch
    >>> est = memwrap.estimate(build_preset("gpt2-tiny"), preset_batch("gpt2-tiny", 2, 64))
    >>> est.peak > est.breakdown["parameters"]
    True
"""
# No submodule shares its name with a public function (estimator.py defines estimate, planner.py
# defines plan): importing a submodule rebinds the package attribute of the same name.
from memwrap.memory.budget import format_bytes, parse_budget
from memwrap.memory.tracing.estimator import Estimate, estimate
from memwrap.memory.measure import measure_peak
from memwrap.memory.monitor import MemoryMonitor
from memwrap.memory.search.planner import Candidate, Plan, plan

__all__ = ["estimate", "plan", "Estimate", "Plan", "Candidate", "MemoryMonitor", "parse_budget", "format_bytes",
           "measure_peak"]
