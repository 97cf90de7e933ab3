"""Bridges from other frameworks to mpcomm. Each module imports its framework only when it is imported itself:

* ``mpcomm.integrations.torch``: a ``torch.distributed`` backend named ``"mpcomm"`` (``pip install mpcomm[torch]``).
* ``mpcomm.integrations.ports``: a free TCP port for a rendezvous store (no framework needed).
"""
