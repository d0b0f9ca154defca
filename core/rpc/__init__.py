"""The ggml-rpc bytes: the wire format, a probing client, and the observing relay."""
