"""``memwrap demo``: its runner, the corpus it trains on and its report.
"""
