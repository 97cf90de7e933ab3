"""The benchmark scripts of ``bench/`` still run: each once at toy size under ``mpiexec -n 2`` (their figures
are measured by hand and recorded in ``bench/results/``; here only that they run and report).

Serial pytest pass only: they launch mpiexec themselves.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import mpiexec_path, serial_only

from mpcomm.bench.cli import DTYPES

ROOT = Path(__file__).resolve().parent.parent
pytestmark = serial_only


def _run(*argv: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    proc = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def test_pipeline_bubble_quick():
    out = _run("bench/pipeline_bubble.py", "--quick", "--micro-batches", "1")
    lines = [line for line in out.splitlines() if line.startswith("pp=2 ")]
    assert [line.split()[2] for line in lines] == ["gpipe", "1f1b", "interleaved-1f1b"], out
    assert ["theory 0.333" in lines[0], "theory 0.333" in lines[1], "theory 0.200" in lines[2]] == [True] * 3, out
    assert all("measured" in line for line in lines), out


def test_pipeline_bubble_regenerates_its_tables_and_keeps_the_notes_below_them(tmp_path, monkeypatch):
    """``--record`` regenerates pipeline_bubble.md's tables from the JSONs; the hand-written notes under its marker
    stay (a re-run used to overwrite them)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import pipeline_bubble
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(pipeline_bubble, "RESULTS", str(tmp_path))
    case = {"pp": 2, "schedule": "1f1b", "v": 1, "m": 8, "layers": 4, "d_model": 192, "d_hidden": 768,
            "theory": 0.111, "replayed": 0.118, "measured": 0.125, "t_f_ms": 4.1, "t_b_ms": 5.2, "step_s": 0.087}
    recorded_before_the_replay = dict(case, schedule="gpipe", replayed=None)
    meta = {"pp": 2, "cores": 2, "platform": "test"}
    (tmp_path / "pipeline_bubble_pp2.json").write_text(json.dumps({"meta": meta,
                                                                   "cases": [case, recorded_before_the_replay]}))
    notes = pipeline_bubble.NOTES + "\n\n## A note by hand\n\nkept\n"
    (tmp_path / "pipeline_bubble.md").write_text("# old tables\n\n| stale |\n\n" + notes)
    text = pipeline_bubble.write_markdown()
    assert text == (tmp_path / "pipeline_bubble.md").read_text()
    assert "stale" not in text and "| 192x768 | 1f1b | 1 | 8 | 4 | 0.111 | 0.118 | 0.125 | 1.13 | 1.06 |" in text
    assert "| 192x768 | gpipe | 1 | 8 | 4 | 0.111 | - | 0.125 | 1.13 | - |" in text
    assert text.endswith("\n" + notes)


def test_a_traced_step_replays_to_its_own_makespan():
    """bench/traced_pipeline.replay: a hand-made pp = 2, m = 1 trace (1 s computes, 0.1 s sends, 0.2 s from each
    send's end to its waiting receiver's compute) replays to 4 s with free messages and to its measured 4.6 s with
    them; a receive of a message that had already arrived costs its receiver's time."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from traced_pipeline import replay, send_latencies, spans_of
    finally:
        sys.path.pop(0)
    from mpcomm.parallel.schedules import schedule

    rank0 = [("F0.0", 0.0, 1.0), ("SEND_F0.0", 1.0, 1.1), ("WRECV_B0.0", 1.1, 3.6), ("B0.0", 3.6, 4.6)]
    rank1 = [("WRECV_F1.0", 0.0, 1.3), ("F1.0", 1.3, 2.3), ("B1.0", 2.3, 3.3), ("SEND_B1.0", 3.3, 3.4)]
    spans = spans_of([rank0, rank1])
    assert send_latencies(spans) == pytest.approx([0.2, 0.2])
    lists = schedule("1f1b", 2, 1)
    assert replay(lists, spans, False).makespan == pytest.approx(4.0)
    assert replay(lists, spans, True).makespan == pytest.approx(4.6)

    # rank 1 starts its receive after the message's send ended: its 0.1 s is rank 1's own work (MPI's copy), not a
    # wait, so it is no latency and is charged to rank 1's compute instead
    arrived = spans_of([rank0, [("WRECV_F1.0", 1.2, 1.3)] + rank1[1:]])
    copied_at_once = spans_of([rank0, [("WRECV_F1.0", 1.2, 1.2)] + rank1[1:]])
    assert send_latencies(arrived) == pytest.approx([0.2])
    assert replay(lists, arrived, True).makespan - replay(lists, copied_at_once, True).makespan == pytest.approx(0.1)


def test_ddp_overlap_tiny(tmp_path):
    report = tmp_path / "ddp.md"
    _run("bench/ddp_overlap.py", "--width", "32", "--layers", "2", "--batch", "4", "--iters", "2", "--warmup", "1",
         "--out", str(report))
    text = report.read_text()
    for row in ("compute alone", "compute alone, grads kept", "comm alone", "overlapped (DDP)", "delay_all_reduce",
                "overlapped, gradient_as_bucket_view", "exposed wait"):
        assert row in text, text


def test_progress_wait_tiny():
    out = _run("bench/progress_wait.py", "--mib", "0.01", "--iters", "3", "--warmup", "1")
    assert "blocking allreduce" in out and "iallreduce + wait" in out and "ratio" in out, out


def test_per_byte_16_tiny(tmp_path):
    """Every contender at each size, float32's fastest at ratio 1.00, the rows in the JSON."""
    path = tmp_path / "per_byte.json"
    out = _run("bench/per_byte_16.py", "--sizes", "4096,8192", "--rounds", "2", "--calls", "2", "--json", str(path))
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) == 2 * 7 and {r["contender"] for r in rows} >= {"bfloat16 auto", "float16 direct", "float32 rhd"}
    for size in (4096, 8192):
        assert min(r["ratio"] for r in rows if r["bytes"] == size and r["contender"].startswith("float32")) == 1.0
    assert "x f32" in out, out


def test_per_byte_16_native_adds_each_dtypes_native_and_float32s_on_the_widened_wire(tmp_path):
    """``--native``: each dtype's native, and float32's native on twice the bytes (what a 16-bit one widens to)."""
    path = tmp_path / "native.json"
    _run("bench/per_byte_16.py", "--native", "--sizes", "512", "--rounds", "1", "--calls", "2", "--json", str(path))
    contenders = {r["contender"] for r in json.loads(path.read_text())["rows"]}
    assert contenders >= {"bfloat16 native", "float16 native", "float32 native, 2x bytes"} and len(contenders) == 10


def test_per_byte_16_takes_any_dtypes_and_refuses_an_unknown_one_in_a_line():
    """``--dtype``: integers beside float32 (one row each per algorithm); a name it does not know is argparse's one
    line and exit 2, before any rank starts."""
    out = _run("bench/per_byte_16.py", "--dtype", "int8,int64", "--sizes", "4096", "--rounds", "1", "--calls", "2")
    assert all(f"{name} {a}" in out for name in ("int8", "int64") for a in ("direct", "auto")), out
    bad = subprocess.run([sys.executable, "bench/per_byte_16.py", "--dtype", "int8,float128x"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert bad.stderr.strip().splitlines()[-1].endswith("--dtype: unknown dtype 'float128x'; choose from "
                                                        + ", ".join(DTYPES)), bad.stderr


def test_pipeline_idle_tiny():
    out = _run("bench/pipeline_idle.py", "--schedule", "gpipe", "--micro-batches", "2", "--steps", "1", "--warmup", "0")
    rows = [line for line in out.splitlines() if line.startswith(("| 0 |", "| 1 |"))]
    replays = [line for line in out.splitlines() if line.startswith(("measured:", "replayed, "))]
    assert len(rows) == 2 and len(replays) == 3 and all("x theory" in line for line in replays), out


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_ddp_compression_tiny(tmp_path, engine):
    """bench/cluster_ddp_compression.sh on one host (LOCAL=1) at toy size: one row per mode, 'none' the baseline,
    PowerSGD's choice per bucket (FSDP: per unit) reported."""
    out = tmp_path / "compression.md"
    env = dict(os.environ, LOCAL="1", MODES="none powersgd:1", ROUNDS="1", STEPS="22", OUT=str(out), ENGINE=engine,
               PYTHON=sys.executable, PATH=os.path.dirname(mpiexec_path()) + os.pathsep + os.environ["PATH"],
               MODEL="--layers 1 --d-model 16 --d-hidden 32 --global-batch 4 --compression-warmup 2")
    proc = subprocess.run(["bash", "bench/cluster_ddp_compression.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| none") or line.startswith("| powersgd")]
    assert len(rows) == 2 and "1.00 [1.00, 1.00]" in rows[0] and rows[1].endswith("| powersgd |"), rows
    assert out.read_text().startswith(f"# {engine.upper()} gradient compression: mpcomm-train --engine {engine}")


def test_cluster_auto_check_times_every_algorithm_on_the_dtype_and_op_asked(tmp_path):
    """``cluster_auto_check.py --dtype --op``: a table per (dtype, op) of the lists (no avg of an integer dtype), a
    row per size, every algorithm timed, auto's choice for that dtype and op named; the cells above 1.10 counted;
    ``--json``: every algorithm's median as rows that ``model_picks.py`` judges."""
    rows_json = tmp_path / "check.json"
    out = _run("bench/cluster_auto_check.py", "--sizes", "8,64K", "--reps", "2", "--dtype", "bfloat16,int8", "--op",
               "max,avg", "--json", str(rows_json))
    tables = [line.split(",")[0] for line in out.splitlines() if line.startswith("all-reduce of ")]
    assert tables == ["all-reduce of bfloat16 max", "all-reduce of bfloat16 avg", "all-reduce of int8 max"], out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith(("| 8 B", "| 64 KiB"))]
    assert len(rows) == 12, out  # (3 tables x 2 sizes, each row printed as measured, then in the table)
    from mpcomm.algorithms import ALLREDUCE
    assert all(row[1 + len(ALLREDUCE)] in ALLREDUCE for row in rows), rows
    assert "Cells where auto's choice is above 1.1 of the best by median: " in out and " of 6" in out, out
    assert "chosen / best, median (95 %) |" in out and "Of them, above 1.1 over the whole 95 % interval" in out, out
    timed = json.loads(rows_json.read_text())
    assert len(timed) == 6 * len(ALLREDUCE) and {r["redop"] for r in timed} == {"max", "avg"}, timed[:2]
    assert all(r["min_us"] <= r["time_us"] and len(r["times_us"]) == 2 for r in timed), timed
    judged = subprocess.run([sys.executable, "bench/model_picks.py", "--library", "mpich", str(rows_json)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert judged.returncode == 0 and "1 runs: 6 cells" in judged.stdout, judged.stdout + judged.stderr
    bad = subprocess.run([sys.executable, "bench/cluster_auto_check.py", "--op", "sum,mean"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "mean: not one of sum, prod, min, max, avg" in bad.stderr, bad.stderr


def test_cluster_auto_check_times_the_algorithms_asked(tmp_path):
    """``--algorithms``: only those are timed (``--rotate``: in a rotation of the order given); a cell whose auto
    choice is not among them is not judged, and says so; a wrong name is a usage error, exit 2."""
    rows_json = tmp_path / "check.json"
    out = _run("bench/cluster_auto_check.py", "--sizes", "8,4M", "--reps", "2", "--algorithms", "ring,direct",
               "--rotate", "--json", str(rows_json))
    assert "| size | ring | direct | auto chose |" in out and "(rotated order)" in out, out
    timed = json.loads(rows_json.read_text())
    assert [r["algorithm"] for r in timed] == ["ring", "direct"] * 2, timed
    cells = {line.split(" | ")[0]: line for line in out.splitlines() if line.startswith(("| 8 B", "| 4 MiB"))}
    assert "(not timed)" in cells["| 8 B"], out  # (auto sends 8 bytes through native or the tree: not timed here)
    judged = int("(not timed)" not in cells["| 4 MiB"])
    assert f" of {judged}\n" in out.split("Cells where auto's choice is above")[1], out
    bad = subprocess.run([sys.executable, "bench/cluster_auto_check.py", "--algorithms", "ring,fastest"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "fastest: not one of" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


def test_cluster_auto_check_draws_each_repetitions_order_the_same_on_every_rank(monkeypatch):
    """The calls of a repetition run in a drawn order: every algorithm once, after more than one other algorithm
    over the repetitions (in a rotation each always follows the same one within a repetition), and the same draw
    every time it is made (every rank must call the same collective next)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import cluster_auto_check

    names = ["ring", "tree", "rhd", "direct", "native"]
    drawn = cluster_auto_check.orders(names, 30)
    assert drawn == cluster_auto_check.orders(names, 30) and all(sorted(o) == sorted(names) for o in drawn), drawn

    def predecessors(runs):  # within a repetition
        pairs = [pair for order in runs for pair in zip(order, order[1:])]
        return {name: {before for before, after in pairs if after == name} for name in names}

    assert all(len(before) >= 3 for before in predecessors(drawn).values()), predecessors(drawn)
    rotated = cluster_auto_check.orders(names, 30, rotate=True)
    assert rotated[1] == names[1:] + names[:1]
    assert all(len(before) == 1 for before in predecessors(rotated).values() if before), predecessors(rotated)


def test_cluster_auto_check_interval_keeps_a_repetition_together_and_picks_the_best_again(monkeypatch):
    """The interval of chosen / best: a drift that every algorithm of a repetition shares is not spread between
    them (a chosen 1.2x the best in every repetition stays 1.2, however the repetitions differ), and algorithms
    timed alike are not told apart by whichever led one sample (its interval reaches down to 1)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import cluster_auto_check

    rng = np.random.default_rng(5)
    drift = rng.uniform(1.0, 3.0, size=21)
    low, high = cluster_auto_check.ratio_interval({"ring": 100 * drift, "rhd": 120 * drift}, "rhd")
    assert low == pytest.approx(1.2) and high == pytest.approx(1.2), (low, high)
    alike = {name: rng.normal(100, 15, size=21) for name in ("ring", "tree", "rhd", "direct", "native")}
    medians = {name: np.median(times) for name, times in alike.items()}
    chosen = max(medians, key=medians.__getitem__)  # the slowest of these repetitions by its median
    low, high = cluster_auto_check.ratio_interval(alike, chosen)
    assert medians[chosen] / min(medians.values()) > 1.05 and 1.0 <= low < 1.02 < high, (medians, low, high)


def test_ddp_auto_onehost_tiny():
    out = _run("bench/ddp_auto_onehost.py", "--steps", "3", "--repeats", "1", "--d-model", "8", "--d-hidden", "16")
    assert "auto/none over 1 repeats of 3 interleaved steps" in out and "auto chose ['exact']" in out, out


def test_dtype_op_sweep_takes_the_median_of_repeated_runs(tmp_path, monkeypatch):
    """``--runs``: per cell the median over the runs of auto / best (each timed in its run), and listed only the
    cells above 1.10 in every run: one run's outlier is noise, a miss in all of them is auto's."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import dtype_op_sweep

    def sweep(path: Path, ratios: dict[int, float]) -> str:
        rows = []
        for size, ratio in ratios.items():
            rows += [{"dtype": "float32", "redop": "sum", "size": size, "algorithm": "ring", "time_us": 10.0,
                      "resolved": "ring"},
                     {"dtype": "float32", "redop": "sum", "size": size, "algorithm": "auto", "time_us": 10.0 * ratio,
                      "resolved": "native"}]
        path.write_text(json.dumps({"rows": rows}))
        return str(path)

    paths = [sweep(tmp_path / f"{i}.json", {8: noisy, 64: 1.5}) for i, noisy in enumerate((1.0, 1.9, 1.05))]
    out = dtype_op_sweep.repeated(paths)
    assert "| float32 | sum | 1.05 | 1.50 | **1.50** |" in out, out
    assert "(1 of 2 cells above 1.1)" in out, out
    assert "- float32 sum 64: 1.50-1.50 (auto took native; best ring)" in out and "sum 8:" not in out, out


def test_model_picks_judges_the_models_pick_by_the_median_time_of_the_runs(tmp_path):
    """``model_picks.py``: per cell, the model's pick among the algorithms the runs timed, judged by its median time
    over the runs against the fastest one's (not auto's own column); with ``--held-out`` each run also judges the
    other runs' median pick and the model's; with ``--picked-by`` the pick of other runs' medians is judged by these;
    runs of different collectives are refused."""
    def run(path: Path, native_us: float, collective: str = "allreduce") -> str:
        rows = [{"collective": collective, "ranks": 2, "dtype": "float32", "redop": "sum", "size": 8,
                 "algorithm": name, "time_us": us} for name, us in
                (("native", native_us), ("ring", 10.0), ("auto", 1.0), ("mpi4py-raw", 1.0))]
        path.write_text(json.dumps(rows))
        return str(path)

    runs = [run(tmp_path / f"{i}.json", us) for i, us in enumerate((5.0, 20.0, 30.0))]  # (native's median: 20)

    def picks(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "bench/model_picks.py", "--library", "mpich", *argv], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)

    out = picks(*runs)
    assert out.returncode == 0, out.stderr
    assert "3 runs: 1 cells, 1 above 1.1, geometric mean 2.000, worst 2.00" in out.stdout, out.stdout
    assert "float32 sum 8: native 2.00" in out.stdout, out.stdout  # (8 B: the model's pick is native)
    # Each run held out judges the others' median pick (ring, 10 us, in every case: native's medians are 25, 17.5,
    # 12.5) and the model's (native): ring is 2x the best in run 0 only, native in runs 1 and 2
    held = picks("--held-out", *runs)
    assert held.returncode == 0, held.stderr
    assert "held out, each run judging: 3 cells; above 1.1: the measured pick (the other runs' median best) 1, " \
        "the model's 2" in held.stdout, held.stdout
    two = picks("--held-out", *runs[:2])
    assert two.returncode != 0 and "--held-out needs 3 runs or more" in two.stderr, two.stderr
    mixed = picks(runs[0], run(tmp_path / "rs.json", 5.0, "reduce_scatter"))
    assert mixed.returncode != 0 and "mix collectives or ranks" in mixed.stderr, mixed.stderr
    # --picked-by: the pick of other runs' medians (native, 5 us there) judged by these runs' medians (native 20 us
    # against ring's 10: 2x), beside the model's (native too)
    other = [run(tmp_path / "other.json", 5.0)]
    cross = picks(*runs, "--picked-by", *other)
    assert cross.returncode == 0, cross.stderr
    assert "judged by these: 1 cells; above 1.1: their pick 1, the model's 1" in cross.stdout, cross.stdout
    ring_wins = [run(tmp_path / "other.json", 50.0)]  # (their pick: ring, 10 us here too: the best)
    cross = picks(*runs, "--picked-by", *ring_wins)
    assert "judged by these: 1 cells; above 1.1: their pick 0, the model's 1" in cross.stdout, cross.stdout
    unlike = picks(*runs, "--picked-by", run(tmp_path / "rs2.json", 5.0, "reduce_scatter"))
    assert unlike.returncode != 0 and "--picked-by runs are reduce_scatter at p = 2" in unlike.stderr, unlike.stderr
