"""``mpiexec -n 2 python -m mpcomm.integrations.torch``: the DDP comparison runs to the end on mpcomm and gloo and
both train the same losses (it once failed on import, a renamed helper).

Run: ``python -m pytest -q --with-mpi -m torch tests/torch_backend/test_main.py`` (serial: it launches mpiexec).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import mpiexec_path, serial_only

pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

pytestmark = [pytest.mark.torch, serial_only]


def test_python_m_mpcomm_integrations_torch_compares_ddp_on_both_backends():
    command = [mpiexec_path(), "-n", "2", sys.executable, "-m", "mpcomm.integrations.torch", "--steps", "2",
               "--warmup", "1", "--width", "16"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "DDP step time, 2 ranks" in proc.stdout and "mpcomm " in proc.stdout, proc.stdout
    if dist.is_gloo_available():
        assert "loss trajectories identical: True" in proc.stdout, proc.stdout
