"""Memory techniques that are ``wrap()`` options, each in its own place: the optimizer step inside backward,
the chunked LM-head loss and ``budget=``. (Precision and checkpointing, the techniques with plugins of their
own, are the folders :mod:`memwrap.precision` and :mod:`memwrap.checkpointing`.)
"""
