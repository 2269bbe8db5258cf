"""Built-in memwrap plugins, loaded through the `memwrap` entry-point group like third-party ones."""
