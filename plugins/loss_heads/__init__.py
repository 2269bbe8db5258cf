"""Built-in loss-head plugins for the chunked LM-head loss: memwrap's zoo models and Hugging Face causal LMs.
"""
