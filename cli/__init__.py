"""ggml-cluster command line: typer commands and rich rendering only."""
