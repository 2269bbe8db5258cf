"""The path of one micro-batch in two-line mode: the wrapped module, optimizer, loader and scheduler, the
accumulation gate they share, the window loss, batch splitting and the data-parallel sync control.
"""
