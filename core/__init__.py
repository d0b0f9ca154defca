"""ggml-cluster core: everything but the command line (never imports typer or rich)."""
