"""Read every rank's flight-recorder dump and say what happened, in a few lines.

For each communicator (torch's "process group") the ranks' entries are lined up by their sequence number, which
counts that communicator's collectives on every member alike. Then:

* the last collective each rank completed;
* the collective the ranks wait in (the highest one started and not completed), and the members that never
  entered it — behind, stopped, or gone (a member without a dump is named as such);
* the first sequence number where the members called different collectives or shapes (validate=False lets a
  program do that): the ranks in the minority are the ones named;
* the stack of every rank named: its call in flight, or, when it was in no collective, its main thread at the
  time of its dump.
"""
from __future__ import annotations

import ast
import os
import pickle
import re
from collections import Counter
from dataclasses import dataclass, field

from .recorder import FILE_PREFIX

_FILE = re.compile(rf"^{re.escape(FILE_PREFIX)}(\d+)$")
STACK_LINES = 6  # frames of a named rank's stack printed (innermost last, as a traceback reads)


class TraceError(Exception):
    """The dumps cannot be read: the message names the directory or file."""


@dataclass
class Finding:
    """One thing the analyzer found: ``kind`` is "behind" (never entered the collective ``seq`` the others wait
    in), "missing" (no dump from a member), or "mismatch" (called another collective or shape at ``seq``)."""

    kind: str
    group: str
    seq: int
    ranks: list[int]
    text: str


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)


def load(directory: str) -> dict[int, dict]:
    """Every rank's dump in ``directory``: {world rank: dump}. TraceError names what cannot be read."""
    if not os.path.isdir(directory):
        raise TraceError(f"{directory!r} is not a directory (expected the MPCOMM_TRACE_DIR the dumps went to)")
    dumps: dict[int, dict] = {}
    for name in sorted(os.listdir(directory)):
        matched = _FILE.match(name)
        if not matched:
            continue
        path = os.path.join(directory, name)
        try:
            with open(path, "rb") as f:
                dump = pickle.load(f)
            entries, groups = dump["entries"], dump["pg_config"]
            if not isinstance(entries, list) or not isinstance(groups, dict):
                raise TypeError("entries is not a list or pg_config not a dict")
        except Exception as exc:  # (whatever unpickling a stray file raises: it is not a dump)
            raise TraceError(f"{path}: not a flight-recorder dump ({type(exc).__name__}: {exc})") from None
        dumps[int(matched.group(1))] = dump
    if not dumps:
        raise TraceError(f"{directory!r} holds no flight-recorder dumps ({FILE_PREFIX}<rank> files)")
    return dumps


def write_for_torch(dumps: dict[int, dict], directory: str, backend: str = "gloo") -> list[str]:
    """Copies of ``dumps`` in ``directory`` that torch's analyzer (``python -m
    torch.distributed.flight_recorder.fr_trace``) reads: it accepts only its own backends' names before the
    ``:`` of an operation's name, so "mpcomm:all_reduce" becomes "gloo:all_reduce" (gloo is torch's CPU
    backend; the rest of the dump is already torch's layout). Returns the files written."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise TraceError(f"cannot make {directory!r}: {exc}") from None
    written = []
    for rank, dump in sorted(dumps.items()):
        entries = [{**e, "profiling_name": f"{backend}:{e['profiling_name'].split(':', 1)[-1]}"}
                   for e in dump["entries"]]
        path = os.path.join(directory, f"{FILE_PREFIX}{rank}")
        try:
            with open(path, "wb") as f:
                pickle.dump({**dump, "entries": entries}, f)
        except OSError as exc:
            raise TraceError(f"cannot write {path!r}: {exc}") from None
        written.append(path)
    return written


def analyze(dumps: dict[int, dict]) -> Report:
    """What the dumps say, as lines and as :class:`Finding` values."""
    report = Report()
    reasons = {rank: dump.get("mpcomm", {}).get("reason", "?") for rank, dump in dumps.items()}
    report.lines.append(f"{len(dumps)} dump(s): " + "; ".join(f"rank {r}: {reasons[r]}" for r in sorted(dumps)))
    for name, ranks in _groups(dumps).items():
        _analyze_group(report, dumps, name, ranks)
    return report


def _groups(dumps: dict[int, dict]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for dump in dumps.values():
        for name, config in dump["pg_config"].items():
            ranks = config["ranks"]
            groups.setdefault(name, sorted(ast.literal_eval(ranks) if isinstance(ranks, str) else ranks))
    return groups


def _analyze_group(report: Report, dumps: dict[int, dict], name: str, members: list[int]) -> None:
    calls = {rank: {e["collective_seq_id"]: e for e in dumps[rank]["entries"]
                    if e["process_group"][0] == name and not e.get("is_p2p")}
             for rank in members if rank in dumps}
    if not any(calls.values()):
        return
    lines = report.lines
    lines.append(f"communicator {name} (world ranks {_ranks(members)}):")
    completed = {rank: max((s for s, e in by_seq.items() if e["state"] == "completed"), default=0)
                 for rank, by_seq in calls.items()}
    lines.append("  last completed: " + ", ".join(
        f"rank {r} #{s} {_what(calls[r][s])}" if s else f"rank {r} none" for r, s in completed.items()))
    missing = [rank for rank in members if rank not in dumps]
    # a rank waits in its last call if that did not complete (an earlier one that never completed — refused by
    # validate=True — is not where it waits)
    pending = {rank: max(by_seq) for rank, by_seq in calls.items()
               if by_seq and by_seq[max(by_seq)]["state"] != "completed"}
    named: list[int] = []
    mismatch = _first_mismatch(calls)
    if mismatch is not None:
        seq, odd, majority = mismatch
        text = (f"#{seq}: rank(s) {_ranks(odd)} called {_what(calls[odd[0]][seq])} where rank(s) "
                f"{_ranks(majority)} called {_what(calls[majority[0]][seq])}")
        lines.append(f"  MISMATCH {text}")
        report.findings.append(Finding("mismatch", name, seq, odd, text))
        named += odd
    if pending:
        seq = max(pending.values())
        waiting = [r for r, s in pending.items() if s == seq]
        entry = calls[waiting[0]][seq]
        waited = _elapsed(dumps, waiting, seq, calls)
        absent = [r for r in calls if seq not in calls[r]]
        text = f"rank(s) {_ranks(waiting)} wait in #{seq} {_what(entry)}{waited}"
        if absent:
            text += "; never entered it: " + ", ".join(
                f"rank {r} (last completed #{completed[r]}" + (f", in flight #{pending[r]})" if r in pending else ")")
                for r in absent)
            report.findings.append(Finding("behind", name, seq, absent, text))
            named += absent
        lines.append(f"  {text}")
        if missing:
            text = (f"no dump from rank(s) {_ranks(missing)}: stopped, killed, or never dumped — they may be behind "
                    f"#{seq}")
            report.findings.append(Finding("missing", name, seq, missing, text))
            lines.append(f"  {text}")
            named += missing
    elif missing:
        text = f"no dump from rank(s) {_ranks(missing)}"
        report.findings.append(Finding("missing", name, max(completed.values()), missing, text))
        lines.append(f"  {text}")
    elif mismatch is None:
        lines.append("  every member completed every collective recorded")
    late = next((d["mpcomm"].get("stragglers", {}).get(name) for d in dumps.values()
                 if d["mpcomm"].get("stragglers", {}).get(name)), None)  # (every member holds the same reports)
    if late:
        lines.append(f"  late (MPCOMM_STRAGGLER), the last {min(len(late), 5)} of {len(late)}: " + "; ".join(
            f"rank {r['rank']} came {r['late_s'] * 1e3:.1f} ms after the others to #{r['seq']} {r['call']}"
            for r in late[-5:]))
    for rank in dict.fromkeys(named):
        if rank in dumps:
            lines += _stack(dumps[rank], rank, calls.get(rank, {}))


def _first_mismatch(calls: dict[int, dict]) -> tuple[int, list[int], list[int]] | None:
    """(seq, ranks in the minority, ranks in the majority) of the first sequence number at which the members'
    calls differ, or None."""
    seqs = sorted(set().union(*[set(by_seq) for by_seq in calls.values()]))
    for seq in seqs:
        there = {rank: _signature(by_seq[seq]) for rank, by_seq in calls.items() if seq in by_seq}
        if len(set(there.values())) < 2:
            continue
        common = Counter(there.values()).most_common(1)[0][0]
        odd = [r for r, s in there.items() if s != common]
        return seq, odd, [r for r, s in there.items() if s == common]
    return None


def _signature(entry: dict) -> tuple:
    return (entry["profiling_name"], str(entry["input_sizes"]), str(entry["output_sizes"]),
            str(entry["input_dtypes"]), entry.get("root"), entry.get("op"))


def _what(entry: dict) -> str:
    name = entry["profiling_name"].split(":", 1)[-1]
    sizes = entry["input_sizes"] or entry["output_sizes"]
    shape = f" {sizes[0]}" if sizes else ""
    dtype = f" {entry['input_dtypes'][0]}" if entry.get("input_dtypes") else ""
    root = f" root {entry['root']}" if entry.get("root") is not None else ""
    return f"{name}{shape}{dtype}{root}"


def _elapsed(dumps, waiting, seq, calls) -> str:
    """How long the waiting ranks had waited when they dumped."""
    waited = [(dumps[r]["mpcomm"]["time_ns"] - calls[r][seq]["time_discovered_started_ns"]) / 1e9
              for r in waiting if "mpcomm" in dumps[r]]
    return f" (for {min(waited):.1f}-{max(waited):.1f} s when they dumped)" if waited else ""


def _stack(dump: dict, rank: int, by_seq: dict) -> list[str]:
    """The innermost frames of ``rank``: of its call in flight, else of its main thread."""
    flying = [e for e in by_seq.values() if e["state"] != "completed" and e.get("frames")]
    if flying:
        frames, where = flying[-1]["frames"], f"in #{flying[-1]['collective_seq_id']}"
    else:
        stacks = dump.get("mpcomm", {}).get("stacks", {})
        frames, where = stacks.get("MainThread") or next(iter(stacks.values()), []), "main thread"
    if not frames:
        return [f"  rank {rank}: no stack recorded"]
    shown = [f for f in frames if "/mpcomm/" not in f["filename"]][:STACK_LINES] or frames[:STACK_LINES]
    return [f"  rank {rank} stack ({where}, innermost last):"] + [
        f"    {f['filename']}:{f['line']} in {f['name']}" for f in reversed(shown)]


def _ranks(ranks) -> str:
    return "[" + ", ".join(map(str, ranks)) + "]"
