"""Optional integrations; each is imported lazily by its user, never by `import memwrap`."""
