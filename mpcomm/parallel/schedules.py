"""The pipeline schedules live in :mod:`mpcomm.schedules` (pure data, below the mesh that plans with them); this
name stays for the engines and the code that imports them from here."""
from ..schedules import *  # noqa: F401,F403
from ..schedules import __all__, execution_order  # noqa: F401
