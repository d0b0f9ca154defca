"""ggml-cluster core: everything but the command line (never imports typer or rich)."""

import warnings

# cryptography 51 warns on import of asyncssh (its DSA support), on stderr before any command's output: the warning
# is about asyncssh's internals, not anything a user runs, and would break every one-line error.
warnings.filterwarnings("ignore", message="DSA is deprecated", module=r"asyncssh(\.|$)")
