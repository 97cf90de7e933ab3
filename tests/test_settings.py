"""Settings (constructor arguments and MPCOMM_* variables) are checked and agreed when a Communicator is built: a
bad value, or ranks that disagree, is a ConfigError on every rank naming the setting and each rank's value, within
seconds — never garbage or timeouts later.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_settings.py`` (any N >= 1).
"""
from __future__ import annotations

import math
import time

import numpy as np
import pytest
from conftest import WORLD, run_gathered

from mpcomm import Communicator, ConfigError

pytestmark = pytest.mark.mpi

P, RANK = WORLD.Get_size(), WORLD.Get_rank()


@pytest.mark.parametrize("setting", ["validate", "timeout", "ranks_per_node"])
def test_ranks_must_agree_on_settings(setting):
    """validate (or timeout, or ranks_per_node) on some ranks only: ConfigError on every rank at construction,
    naming the setting and each rank's value — not garbage or timeouts later."""
    if P < 2:
        pytest.skip("needs two ranks to disagree")
    kwargs = {"validate": {"validate": RANK == 0}, "timeout": {"timeout": 5.0 + RANK},
              "ranks_per_node": {"ranks_per_node": 1 + RANK}}[setting]

    def run():
        with pytest.raises(ConfigError) as info:
            Communicator(WORLD, **kwargs)
        return str(info.value)

    for message in run_gathered(run):
        assert f"agree on {setting}" in message and "rank 0" in message and "rank 1" in message, message


def test_tuning_file_on_some_ranks_only_is_an_error_on_every_rank(monkeypatch, tmp_path):
    """MPCOMM_TUNING_FILE set on rank 0 only: the constructor's load_tuning is a collective. Unagreed, rank 0's
    broadcast of the table was received by the others' next broadcast (25 instead of 12345 at p = 2, no error).
    Now a ConfigError on every rank at construction, naming the variable and each rank's value."""
    if P < 2:
        pytest.skip("needs a rank without the variable")
    monkeypatch.delenv("MPCOMM_TUNING_FILE", raising=False)
    if RANK == 0:
        monkeypatch.setenv("MPCOMM_TUNING_FILE", str(tmp_path / "no-such-table.json"))

    def run():
        start = time.monotonic()
        try:
            c = Communicator(WORLD, timeout=3.0)
        except ConfigError as exc:
            return "ConfigError", str(exc), time.monotonic() - start
        try:
            value = np.array([12345 if RANK == 0 else 0], np.int64)
            c.broadcast(value, root=0, algorithm="native")
            return ("right" if value[0] == 12345 else f"WRONG {value[0]}"), "", time.monotonic() - start
        finally:
            c.free()

    for outcome, message, elapsed in run_gathered(run):
        assert outcome == "ConfigError", outcome
        assert "MPCOMM_TUNING_FILE" in message and "rank 0" in message and "rank 1 None" in message, message
        assert elapsed < 3.0 + 5


BAD_SETTINGS = {  # name -> (env or kwargs, words the message must contain)
    "timeout-nan": ({"timeout": math.nan}, "timeout"),
    "timeout-inf": ({"timeout": math.inf}, "timeout"),
    "timeout-negative": ({"timeout": -1}, "timeout"),
    "timeout-str": ({"timeout": "5"}, "timeout"),
    "timeout-bool": ({"timeout": True}, "timeout"),
    "env-timeout-nan": ({"MPCOMM_TIMEOUT": "nan"}, "MPCOMM_TIMEOUT='nan'"),
    "env-timeout-abc": ({"MPCOMM_TIMEOUT": "abc"}, "MPCOMM_TIMEOUT='abc'"),
    "env-rpn-abc": ({"MPCOMM_RANKS_PER_NODE": "abc"}, "MPCOMM_RANKS_PER_NODE='abc'"),
    "env-rpn-fraction": ({"MPCOMM_RANKS_PER_NODE": "1.5"}, "MPCOMM_RANKS_PER_NODE='1.5'"),
    "env-validate-maybe": ({"MPCOMM_VALIDATE": "maybe"}, "MPCOMM_VALIDATE='maybe'"),
    "env-progress-bogus": ({"MPCOMM_PROGRESS": "bogus"}, "MPCOMM_PROGRESS='bogus'"),
    "rpn-str": ({"ranks_per_node": "2"}, "ranks_per_node"),
    "validate-str": ({"validate": "yes"}, "validate"),
}


@pytest.mark.parametrize("only_rank_0", [False, True], ids=["every-rank", "rank-0-only"])
@pytest.mark.parametrize("case", list(BAD_SETTINGS))
def test_bad_setting_is_a_config_error_on_every_rank(monkeypatch, case, only_rank_0):
    """A bad value — on every rank, or on rank 0 only — is a ConfigError on every rank, naming the rank and the
    argument or variable, within seconds (the others do not wait in the constructor's MPI calls)."""
    values, words = BAD_SETTINGS[case]
    for name in ("MPCOMM_TIMEOUT", "MPCOMM_RANKS_PER_NODE", "MPCOMM_VALIDATE", "MPCOMM_PROGRESS"):
        monkeypatch.delenv(name, raising=False)
    kwargs = {k: v for k, v in values.items() if not k.startswith("MPCOMM_")}
    bad_here = not only_rank_0 or RANK == 0
    if bad_here:
        for name, value in values.items():
            if name.startswith("MPCOMM_"):
                monkeypatch.setenv(name, value)

    def run():
        start = time.monotonic()
        with pytest.raises(ConfigError) as info:
            Communicator(WORLD, **(kwargs if bad_here else {}))
        return str(info.value), time.monotonic() - start

    for message, elapsed in run_gathered(run):
        assert words in message and "rank 0:" in message, message
        assert elapsed < 10
