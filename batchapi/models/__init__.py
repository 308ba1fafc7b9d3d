"""Models: the served-model registry (``registry``) and the store that fetches and converts them (``store``)."""
