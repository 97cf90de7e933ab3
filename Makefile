# The two entry points: `make run` (the 4-rank demo) and `make test` (the whole suite). Both build .venv.
VENV    ?= .venv
PY      := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec
STAMP   := $(VENV)/.mpcomm-installed
# Every mpiexec is wrapped in timeout so that a bug can never hang a terminal or CI.
MPI_TIMEOUT ?= 900
RANKS ?= 4

.PHONY: install run test test-serial test-mpi test-torch test-cluster bench soak clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,plot]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	timeout $(MPI_TIMEOUT) $(MPIEXEC) -n $(RANKS) $(PY) -m mpcomm.bench --op allreduce \
		--algorithms ring,ring_pipelined,tree,rhd,hierarchical,native,auto -b 8 -e 64M -f 8 --check -n 100 -w 5 --budget 0.2
	timeout $(MPI_TIMEOUT) $(MPIEXEC) -n $(RANKS) $(PY) -m mpcomm.train --engine 3d --dp 1 --tp 2 --pp 2 --steps 5
	timeout $(MPI_TIMEOUT) $(MPIEXEC) -n $(RANKS) $(PY) -m mpcomm.train --engine 3d --dp 2 --tp 1 --pp 2 --steps 5

test: test-serial test-mpi

test-serial: $(STAMP)
	$(PY) -m mpcomm.info
	timeout $(MPI_TIMEOUT) $(PY) -m pytest -q --with-mpi tests

test-mpi: $(STAMP)
	for n in 2 3 4; do \
		echo "== mpiexec -n $$n"; \
		timeout $(MPI_TIMEOUT) $(MPIEXEC) -n $$n $(PY) -m pytest -q --with-mpi -m mpi tests || exit 1; \
	done

# The CPU build of PyTorch (a plain "torch" or the extra's range may resolve to a multi-GB CUDA build).
# Measured here: ~35 s to install from the local wheel, +870 MB in the venv.
# Runs every test marked `torch` (the torch.distributed backend, CPU torch tensors as mpcomm buffers, ...): mark a
# new test `@pytest.mark.torch`, or a new file with `pytestmark = pytest.mark.torch`, and it runs here. Each run
# collects all of tests/ to select them: 32-53 s per run measured with the machine loaded (load average ~19).
# `import torch` first, so that a broken install fails instead of turning the tests into skips; then build the
# backend's C++ all-reduce (~30 s, cached by torch; a failed build fails here, where the backend would only warn).
# Then FSDP2 x tensor parallelism on a 2 x 2 DeviceMesh (4 ranks), and PyTorch's own backend test class
# DistributedTest._DistTestBase under 3 ranks (tests/torch_backend/distributed_suite.py; expecttest is what torch's test
# utilities import): the tests gloo passes, those gated on the name "gloo" run as if named so, and PyTorch's MPI-only
# all-to-all tests (the lists in tests/torch_backend/dist_suite_*.txt say how they were chosen).
TORCH_SPEC ?= torch==2.13.0
TORCH_TEST_DEPS ?= expecttest==0.3.0
DIST_SUITE := tests/torch_backend/distributed_suite.py --backend mpcomm --expect-pass --tests tests/torch_backend/dist_suite_mpcomm.txt \
	--gated gloo tests/torch_backend/dist_suite_as_gloo.txt --gated mpi tests/torch_backend/dist_suite_as_mpi.txt
test-torch: $(STAMP)
	$(PY) -m pip install -q "$(TORCH_SPEC)" "$(TORCH_TEST_DEPS)"
	$(PY) -c "import torch, torch.distributed, expecttest"
	timeout $(MPI_TIMEOUT) $(PY) -m mpcomm.integrations.torch.extension
	timeout $(MPI_TIMEOUT) $(PY) -m pytest -q --with-mpi -m torch tests
	for n in 2 3; do \
		timeout $(MPI_TIMEOUT) $(MPIEXEC) -n $$n $(PY) -m pytest -q --with-mpi -m "mpi and torch" tests || exit 1; \
	done
	timeout $(MPI_TIMEOUT) $(MPIEXEC) -n 4 $(PY) -m pytest -q --with-mpi -m mpi tests/torch_backend/test_fsdp2_tp.py
	OMP_NUM_THREADS=1 timeout $(MPI_TIMEOUT) $(MPIEXEC) -n 3 $(PY) $(DIST_SUITE)

# Multi-node tests on simulated clusters (ci/cluster.sh: a network namespace per node, tbf-shaped veth links; needs
# root or user namespaces, else it says why and skips): 2 nodes x 2 ranks and 4 x 1.
test-cluster: $(STAMP)
	timeout 1200 tests/cluster/run.sh

# The long soak (bench/soak.py): SOAK_CALLS seeded random collectives at p = 2, 3, 4, each checked against numpy;
# fails on a wrong result, on RSS growing more than SOAK_RSS_MIB after the first fifth, or on fds / threads changing.
SOAK_CALLS ?= 20000
SOAK_RSS_MIB ?= 48
soak: $(STAMP)
	for n in 2 3 4; do \
		timeout 3600 $(MPIEXEC) -n $$n $(PY) bench/soak.py --calls $(SOAK_CALLS) --rss-bound-mib $(SOAK_RSS_MIB) \
			--json bench/results/soak_p$$n.json || exit 1; \
	done

clean:
	rm -rf $(VENV) *.egg-info
