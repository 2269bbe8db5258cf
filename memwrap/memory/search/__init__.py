"""The planner's search: the space (learned from the plugins), technique dimensions, the cost model, the
ranking, ``plan()`` itself and the report.
"""
