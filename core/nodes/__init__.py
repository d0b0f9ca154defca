"""Touching a machine: shell, files and processes on a node, reached locally or over SSH."""
