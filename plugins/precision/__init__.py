"""Built-in precision plugins, one small module per mode.
"""
