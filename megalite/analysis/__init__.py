"""Analysis of pipeline schedules and parallel layouts: simulate, balance, measure, plan.

simulate.py checks and times any action list (deadlock proof, bubble,
activation memory); balance.py chooses the layer split the simulator finds
fastest; measure.py times the real model's layer kinds for that choice;
planner.py ranks whole (tp, pp, vp, dp, ...) layouts by memory and step time.
Analysis reads the runtime (megalite.pipeline, megalite.model) and never the
reverse; only the composition root (megalite.training) and the tools import
it (README, Architecture).
"""
