"""Run the conformance suite for every backend of the device matrix this machine can run.

    python ci/run_matrix.py                 # every entry whose device is here
    python ci/run_matrix.py --column cpu    # only the CPU column (cpu and the simulated devices)
    python ci/run_matrix.py --out ci/out    # where matrix.json and matrix.md go

Each entry runs ``pytest --pyargs amp_backends.testing --amp-backend NAME`` in its own
process (the simulated device renames PrivateUse1, once per process) and its JUnit report
becomes one column of the table: each check pass, fail or skip with the reason.
Exit status: 1 if any check failed, else 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

HERE = Path(__file__).resolve().parent


def load_matrix(path: Path) -> dict:
    with path.open("rb") as fh:
        return tomllib.load(fh)


def entry_env(entry: dict) -> dict[str, str]:
    env = dict(os.environ)
    if entry.get("simulated"):
        from amp_backends.testing import sim_packages_path

        folder = sim_packages_path(entry.get("sim_packages", entry["name"]))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH")]))
    env.update({k: str(v) for k, v in entry.get("env", {}).items()})  # e.g. which chip a simulation imitates
    return env


def probe(entry: dict) -> dict:
    """Whether the entry's backend is available here, and on what device."""
    code = (
        "import json, amp_backends\n"
        f"reg = amp_backends.registry.default_registry(); found = [b for b, _ in reg.backends() if b.name == {entry['name']!r}]\n"
        "be = found[0] if found else None\n"
        "reason = 'not registered' if be is None else be.unavailable_reason()\n"
        "device = None\n"
        "if be is not None and reason is None:\n"
        "    import torch\n"
        "    device = torch.cuda.get_device_name() if be.device_type == 'cuda' else str(be.device())\n"
        "print(json.dumps({'reason': reason, 'device': device}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=entry_env(entry))
    if proc.returncode != 0:
        return {"reason": f"probe failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}", "device": None}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_entry(entry: dict) -> dict:
    label = entry.get("label", entry["name"])
    found = probe(entry)
    device = found["device"] and (found["device"] + (" (simulated)" if entry.get("simulated") else ""))
    result = {"backend": label, "name": entry["name"], "device": device, "reason": found["reason"], "checks": {}}
    if found["reason"] is not None:
        return result
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", "--pyargs", "amp_backends.testing", "--amp-backend", entry["name"],
               "-p", "no:cacheprovider", "-q", f"--junitxml={report}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=entry_env(entry), cwd=tmp)
        result["exit_code"] = proc.returncode
        if report.exists():
            result["checks"] = parse_junit(report)
        else:
            result["reason"] = f"pytest produced no report (exit {proc.returncode}): {proc.stderr[-500:]}"
    return result


def parse_junit(path: Path) -> dict[str, dict[str, str]]:
    checks = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "?")
        module = (case.get("classname") or "").rsplit(".", 1)[-1].replace("test_conformance_", "")
        outcome, detail = "pass", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "skip" if tag == "skipped" else "fail"
                detail = (node.get("message") or "").replace("\n", " ")[:160]
                break
        checks[f"{module}::{name}"] = {"outcome": outcome, "detail": detail}
    return checks


def markdown(results: list[dict], meta: dict) -> str:
    lines = ["# Device matrix: conformance results", "",
             f"{meta['date']} on {meta['machine']}, torch {meta['torch']}, Python {meta['python']}", ""]
    head = "| check | " + " | ".join(r["backend"] for r in results) + " |"
    lines += [
        "| backend | device found | result |", "|---|---|---|",
        *[
            f"| {r['backend']} | {r['device'] or 'no'} | "
            + (f"not run: {r['reason']}" if r["reason"] else _summary(r["checks"])) + " |"
            for r in results
        ],
        "",
        head,
        "|---|" + "---|" * len(results),
    ]
    names = sorted({c for r in results for c in r["checks"]})
    for name in names:
        cells = []
        for r in results:
            check = r["checks"].get(name)
            if check is None:
                cells.append("-")
            else:
                cells.append(check["outcome"] + (f" ({check['detail']})" if check["detail"] and check["outcome"] != "pass" else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _summary(checks: dict) -> str:
    counts = {k: sum(1 for c in checks.values() if c["outcome"] == k) for k in ("pass", "fail", "skip")}
    return f"{counts['pass']} pass, {counts['fail']} fail, {counts['skip']} skip"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matrix", type=Path, default=HERE / "matrix.toml")
    parser.add_argument("--column", help="run only entries of this column (cpu, cuda, mlu)")
    parser.add_argument("--out", type=Path, default=HERE / "out")
    args = parser.parse_args(argv)
    import torch

    matrix = load_matrix(args.matrix)
    entries = [e for e in matrix["backend"] if args.column in (None, e["column"])]
    if not entries:
        print(f"no matrix entries for column {args.column!r}", file=sys.stderr)
        return 2
    results = [run_entry(e) for e in entries]
    meta = {"date": datetime.date.today().isoformat(), "machine": platform.node() or platform.machine(),
            "torch": torch.__version__, "python": platform.python_version(), "column": args.column}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "matrix.json").write_text(json.dumps({**meta, "results": results}, indent=2))
    table = markdown(results, meta)
    (args.out / "matrix.md").write_text(table)
    print(table)
    failed = any(c["outcome"] == "fail" for r in results for c in r["checks"].values())
    broken = any(r.get("exit_code") not in (None, 0) and not r["checks"] for r in results)
    return 1 if failed or broken else 0


if __name__ == "__main__":
    sys.exit(main())
