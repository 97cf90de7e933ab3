"""Run ``mpcomm.bench`` from another source tree of mpcomm with this environment, for before/after comparisons in
one job window (the editable install's import hook would otherwise always load this checkout).

    git archive 245c967 | tar -x -C /tmp/before
    mpiexec -n 2 python bench/experiments/other_tree.py /tmp/before --op allreduce --dtype bfloat16 ...
"""
import runpy
import sys

if __name__ == "__main__":
    tree = sys.argv.pop(1)
    sys.meta_path[:] = [finder for finder in sys.meta_path if "editable" not in repr(finder).lower()]
    sys.path.insert(0, tree)
    import mpcomm

    if not mpcomm.__file__.startswith(tree):
        sys.exit(f"imported mpcomm from {mpcomm.__file__}, not from {tree}")
    runpy.run_module("mpcomm.bench", run_name="__main__", alter_sys=True)
