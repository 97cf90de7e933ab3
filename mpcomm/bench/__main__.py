"""``python -m mpcomm.bench ...`` (same as ``mpcomm-bench``)."""
from .cli import main

main()
