"""The stats layer: what each step, turn and session measured, and the plots of it.

``_stats`` (StepStats, TurnStats, SessionStats, tables; imports nothing of agentkv at
module level), ``_plots`` (TTFT and reuse per turn, with the ``plot`` extra).
"""
