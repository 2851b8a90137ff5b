"""Public model names to deployments: the routing file, discovery, selection, fallbacks, streams."""
