"""The plugin host: hook specs, the manager (built-ins and third-party plugins through one entry-point group),
guarded calls into plugins, the shared name index, the optimizer registry with its state sizes and argument
checks. The conformance kits for plugin authors are :mod:`memwrap.testing`.
"""
