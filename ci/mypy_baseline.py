"""mypy against its baseline: fail on any error beyond the ones listed in ci/mypy_baseline.txt (a new one, or
one more of a kind in a file), and on a listed one that is gone (then shrink the baseline: --write).

    python ci/mypy_baseline.py           # check (what ci/lint.sh runs)
    python ci/mypy_baseline.py --write   # rewrite the baseline from this run

Other arguments go to mypy (e.g. ``--python-executable PATH`` to see another environment's packages).
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
from pathlib import Path

BASELINE = Path(__file__).with_name("mypy_baseline.txt")
ERROR = re.compile(r"^(?P<file>[^:]+):\d+: error: .*\[(?P<code>[a-z-]+)\]$")


def counts(output: str) -> collections.Counter[tuple[str, str]]:
    found: collections.Counter[tuple[str, str]] = collections.Counter()
    for line in output.splitlines():
        match = ERROR.match(line.strip())
        if match:
            found[(match["file"], match["code"])] += 1
    return found


def read_baseline() -> collections.Counter[tuple[str, str]]:
    listed: collections.Counter[tuple[str, str]] = collections.Counter()
    for line in BASELINE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            file, code, number = line.split()
            listed[(file, code)] = int(number)
    return listed


def main(argv: list[str]) -> int:
    extra = [a for a in argv if a != "--write"]
    proc = subprocess.run([sys.executable, "-m", "mypy", *extra], capture_output=True, text=True)
    found = counts(proc.stdout)
    if proc.returncode not in (0, 1) or (proc.returncode == 1 and not found):
        print(proc.stdout + proc.stderr, file=sys.stderr)
        return 2
    if "--write" in argv:
        lines = [f"{file} {code} {n}" for (file, code), n in sorted(found.items())]
        BASELINE.write_text("# file  error-code  count: mypy's errors when it was added (ci/mypy_baseline.py)\n"
                            + "\n".join(lines) + "\n")
        print(f"baseline: {sum(found.values())} errors in {len({f for f, _ in found})} files")
        return 0
    listed = read_baseline()
    new = {k: n - listed[k] for k, n in found.items() if n > listed[k]}
    gone = {k: listed[k] - found[k] for k in listed if found[k] < listed[k]}
    for (file, code), n in sorted(new.items()):
        print(f"new: {n} more [{code}] in {file}:")
        for line in proc.stdout.splitlines():
            if line.startswith(file + ":") and line.endswith(f"[{code}]"):
                print("  " + line)
    for (file, code), n in sorted(gone.items()):
        print(f"fixed: {n} [{code}] fewer in {file}: remove it from {BASELINE.name} (python ci/mypy_baseline.py --write)")
    print(f"mypy: {sum(found.values())} errors, baseline {sum(listed.values())}; new {sum(new.values())}, "
          f"fixed {sum(gone.values())}")
    return 1 if new or gone else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
