"""Run history under ``.dflash/`` and the comparison of two reports.

Why: a report is overwritten by the next run, but a reviewer asks "did this change make a
route worse?". ``--dflash-save`` keeps each report (like pytest-benchmark's ``--benchmark-save``),
``--dflash-compare`` and ``pytest-dflash diff`` compare two of them. A comparison is only
meaningful like for like: a verdict from another device, another profile or another policy is a
different experiment, so :func:`compare` says so plainly instead of mixing them silently.

Layout: ``.dflash/NNNN_<UTC time>_<profile>_<device type>_<git head>[_<NAME>].json`` and
``.dflash/index.json``, one entry per stored run (sequence, name, time, fingerprint, device,
profile, verdict counts). The index is a convenience: it is rebuilt from the stored reports when
it is missing or unreadable.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_dflash.evidence import files, timings
from pytest_dflash.evidence import report as reports

HISTORY_DIR = ".dflash"
INDEX = "index.json"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_STORED = re.compile(r"^(\d{4,})_.*\.json$")
_VERDICT_RANK = {"reject": 0, "pending": 1, "accept": 2}
_STATUS_RANK = {"failed": 0, "error": 1, "pending": 1, "absent": 1, "passed": 2}


class HistoryError(reports.ReportError):
    """A bad save name or a reference that names no stored run."""


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise HistoryError(f"--dflash-save {name!r}: a run name is 1-64 letters, digits, '.', "
                           "'_' or '-', starting with a letter or digit (e.g. before-fix)")
    return name


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.-]+", "-", text).strip("-")[:24] or "x"


def _entry(seq: int, path: Path, name: str | None, data: dict[str, Any]) -> dict[str, Any]:
    from pytest_dflash.evidence import fingerprint
    from pytest_dflash.evidence.summary import counts

    device = data.get("device", {})
    return {
        "seq": seq,
        "file": path.name,
        "name": name,
        "created": data["created"],
        "fingerprint": fingerprint.short(data.get("fingerprint", {})),
        "device": device.get("name"),
        "device_type": device.get("type"),
        "profile": data["profile"],
        "verdicts": counts(data),
    }


def _rebuild(folder: Path) -> list[dict[str, Any]]:
    found = []
    for path in sorted(folder.glob("*.json")):
        match = _STORED.match(path.name)
        if not match:
            continue
        try:
            data = reports.load(path)
        except reports.ReportError:
            continue  # a broken stored report is not listed; resolve() by path still names it
        found.append(_entry(int(match.group(1)), path, data.get("session", {}).get("saved_as"),
                            data))
    return found


def entries(root: Path) -> list[dict[str, Any]]:
    """Stored runs, oldest first (reads the index, rebuilding it if needed)."""
    folder = Path(root) / HISTORY_DIR
    if not folder.is_dir():
        return []
    index = folder / INDEX
    try:
        listed = json.loads(index.read_text(encoding="utf-8"))
        if not isinstance(listed, list) or not all(isinstance(e, dict) and "file" in e
                                                   for e in listed):
            raise ValueError("not a list of runs")
        listed = [e for e in listed if (folder / e["file"]).is_file()]
    except (OSError, ValueError):
        listed = _rebuild(folder)
        files.write_json(listed, index)
    return sorted(listed, key=lambda e: e["seq"])


def save(report: dict[str, Any], root: Path, name: str | None = None) -> Path:
    """Keep a copy of ``report`` under ``root/.dflash/`` and list it in the index."""
    from filelock import FileLock

    if name is not None:
        check_name(name)
    folder = Path(root) / HISTORY_DIR
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder / ".lock"), timeout=60):
        listed = entries(root)
        on_disk = [int(m.group(1)) for p in folder.glob("*.json")
                   if (m := _STORED.match(p.name))]
        seq = max([e["seq"] for e in listed] + on_disk + [0]) + 1
        stamp = re.sub(r"[^0-9T]", "", report["created"].split("+")[0]) + "Z"
        head = (report.get("fingerprint", {}).get("git_head") or "nogit")[:10]
        parts = [f"{seq:04d}", stamp, _slug(report["profile"]),
                 _slug(report.get("device", {}).get("type") or "unknown"), head]
        if name:
            parts.append(name)
        path = folder / ("_".join(parts) + ".json")
        stored = json.loads(json.dumps(report, default=str))
        stored.setdefault("session", {})["saved_as"] = name
        reports.write_atomic(stored, path)
        listed.append(_entry(seq, path, name, stored))
        files.write_json(listed, folder / INDEX)
    return path


def _describe(listed: list[dict[str, Any]], limit: int = 8) -> str:
    if not listed:
        return "no runs are stored yet; save one with --dflash-save"
    shown = [f"{e['seq']} ({e['name'] or e['file']}, {e['profile']}, {e['device']}, "
             f"{e['created']})" for e in listed[-limit:]]
    return "stored runs: " + "; ".join(shown)


def resolve(ref: str | None, root: Path, *, exclude: Path | None = None) -> Path:
    """The report a reference names: a file path, a sequence number, a save name, or
    ``latest`` / nothing (the newest stored run other than ``exclude``)."""
    folder = Path(root) / HISTORY_DIR
    if ref not in (None, "", "latest"):
        candidate = Path(ref).expanduser()
        if not candidate.is_absolute():
            candidate = Path(root) / candidate
        if candidate.is_file():
            return candidate
    listed = [e for e in entries(root)
              if exclude is None or (folder / e["file"]).resolve() != Path(exclude).resolve()]
    if ref in (None, "", "latest"):
        if not listed:
            raise HistoryError(f"nothing to compare with in {folder}: "
                               + _describe(listed))
        return folder / listed[-1]["file"]
    if ref.isdigit():
        match = [e for e in listed if e["seq"] == int(ref)]
    else:
        match = [e for e in listed if e["name"] == ref]
    if not match:
        raise HistoryError(f"{ref!r} is neither a report file nor a stored run; "
                           + _describe(listed))
    return folder / match[-1]["file"]


@dataclass
class Comparison:
    """What changed from ``old`` to ``new``: lines to print, and which of them are worse."""

    unlike: list[str] = field(default_factory=list)  # why the two are not like for like
    changes: list[str] = field(default_factory=list)
    worse: list[str] = field(default_factory=list)

    @property
    def like_for_like(self) -> bool:
        return not self.unlike

    def lines(self) -> list[str]:
        out: list[str] = []
        if self.unlike:
            out.append("NOT LIKE FOR LIKE: " + "; ".join(self.unlike))
        out.extend(self.changes)
        if not self.changes and not self.unlike:
            return ["no differences"]
        if self.worse:
            out.append(f"got worse: {len(self.worse)} ({', '.join(self.worse)})")
        elif self.changes:
            out.append("nothing got worse")
        return out


def _device_key(report: dict[str, Any]) -> tuple[Any, ...]:
    device = report.get("device", {})
    return device.get("type"), device.get("name"), device.get("capability")


def _unlike(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    reasons = []
    if _device_key(old) != _device_key(new):
        reasons.append(f"device {old.get('device', {}).get('name')} -> "
                       f"{new.get('device', {}).get('name')}")
    if old["profile"] != new["profile"]:
        reasons.append(f"profile {old['profile']} -> {new['profile']}")
    # as stored: a live report holds tuples where a stored one holds lists
    policy_a, policy_b = (json.loads(json.dumps(r.get("policy", {}), default=str))
                          for r in (old, new))
    changed = [k for k in sorted(set(policy_a) | set(policy_b))
               if policy_a.get(k) != policy_b.get(k)]
    if changed:
        reasons.append("policy " + ", ".join(f"{k} {policy_a.get(k)} -> {policy_b.get(k)}"
                                             for k in changed))
    return reasons


def _tests(gate: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["nodeid"]: t for t in gate.get("tests", [])}


def _shifted(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Every timing comparison of a test whose new interval does not overlap the old one: a
    real shift, named (per verify width for a validation_cost test), in either protocol."""
    old = dict(timings.comparisons(before.get("measurements", {})))
    shifts = []
    for label, b in timings.comparisons(after.get("measurements", {})):
        a = old.get(label)
        if a is None:
            continue
        keys = ("ratio_median", "ci_low", "ci_high")
        if not all(isinstance(m.get(k), (int, float)) for m in (a, b) for k in keys):
            continue
        if b["ci_low"] > a["ci_high"]:
            direction = "slower"
        elif b["ci_high"] < a["ci_low"]:
            direction = "faster"
        else:
            continue
        where = "" if len(old) == 1 else f"{label}: "
        shifts.append(f"{where}ratio {a['ratio_median']:.3f} [{a['ci_low']:.3f}, "
                      f"{a['ci_high']:.3f}] -> {b['ratio_median']:.3f} [{b['ci_low']:.3f}, "
                      f"{b['ci_high']:.3f}] ({direction})")
    return shifts


def compare(old: dict[str, Any], new: dict[str, Any]) -> Comparison:
    """Route verdicts, gate statuses and figures, and timing shifts from ``old`` to ``new``.

    Worse means: a verdict moved down accept > pending > reject, a gate moved down
    passed > pending > failed, or an accepted candidate disappeared.
    """
    result = Comparison(unlike=_unlike(old, new))
    for name in sorted(set(old["routes"]) | set(new["routes"])):
        before, after = old["routes"].get(name), new["routes"].get(name)
        if before is None or after is None:
            result.changes.append(f"{name}: {'added' if before is None else 'removed'}")
            if after is None and before["verdict"] == "accept":
                result.worse.append(f"{name} (removed)")
                result.changes[-1] += " <- worse"
            continue
        if before["verdict"] != after["verdict"]:
            line = f"{name}: verdict {before['verdict']} -> {after['verdict']}"
            if _VERDICT_RANK.get(after["verdict"], 0) < _VERDICT_RANK.get(before["verdict"], 0):
                result.worse.append(name)
                line += " <- worse"
            result.changes.append(line)
        for kind in sorted(set(before["gates"]) | set(after["gates"])):
            absent = {"status": "absent", "figure": "", "tests": []}
            gate_a, gate_b = before["gates"].get(kind, absent), after["gates"].get(kind, absent)
            if gate_a["status"] != gate_b["status"] or gate_a["figure"] != gate_b["figure"]:
                line = (f"{name} {kind}: {gate_a['status']} ({gate_a['figure'] or '-'})"
                        f" -> {gate_b['status']} ({gate_b['figure'] or '-'})")
                if _STATUS_RANK[gate_b["status"]] < _STATUS_RANK[gate_a["status"]]:
                    result.worse.append(f"{name} {kind}")
                    line += " <- worse"
                result.changes.append(line)
            tests_a, tests_b = _tests(gate_a), _tests(gate_b)
            for nodeid in sorted(set(tests_a) & set(tests_b)):
                for shift in _shifted(tests_a[nodeid], tests_b[nodeid]):
                    result.changes.append(f"  {nodeid}: {shift}")
    fp_a, fp_b = old.get("fingerprint", {}), new.get("fingerprint", {})
    changed = sorted(k for k in set(fp_a) | set(fp_b) if fp_a.get(k) != fp_b.get(k))
    if changed:
        result.changes.append(f"fingerprint changed: {', '.join(changed)}")
    return result
