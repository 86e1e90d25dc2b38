"""The speculative core shared by `generate` and `serve`: one step (`step.run_step`)."""
