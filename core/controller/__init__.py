"""The daemon: one detached process per cluster that owns its nodes, its plan and its coordinator."""
