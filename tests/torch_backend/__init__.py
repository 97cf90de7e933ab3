"""The torch.distributed backend's tests (marked ``torch``: ``make test-torch`` runs them on every supported torch
release) and their helpers (``groups``: fresh default process groups on mpcomm or gloo)."""
