"""Example third-party sparse algorithms (import from the repository root, e.g.
``SparseConfig(algorithm="examples.sink_window:SinkWindow")``)."""
