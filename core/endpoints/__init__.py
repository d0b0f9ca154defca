"""Every way into the cluster, written against the Service: the control socket, the OpenAI API, Prometheus."""
