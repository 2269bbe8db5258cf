"""Built-in trace-input plugins: the inputs a real step does not pass on because of their values."""
