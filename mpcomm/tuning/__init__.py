"""Tuning ``algorithm="auto"``: measure every algorithm on the live communicator, keep the result as a table.

* :mod:`mpcomm.tuning.table` — the table's format, its checks, and saving / loading it as JSON (collective);
* :mod:`mpcomm.tuning.measure` — timing the algorithms and deciding the table (``Communicator.tune`` runs it);
* :mod:`mpcomm.tuning.cli` — ``python -m mpcomm.tuning``.

The package itself imports nothing, so the selector (``mpcomm.algorithms.auto``, below the measurement) can read
the table's format without loading the measurement.
"""
