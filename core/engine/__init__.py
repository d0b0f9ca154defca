"""The llama.cpp side: child processes that load the model through the RPC devices (the only place llama_cpp
is imported)."""
