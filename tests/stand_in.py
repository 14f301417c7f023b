"""Test-only: a stand-in for one of the project's scripts under tests/reproduce.py's runner (test_reproduce.py,
test_invariants.py), which adds `--out DIR` (and `--resume` when DIR holds a started run):

    python tests/stand_in.py order NAME FILE --out DIR   DIR/NAME written (a job's done file); NAME, with " resume"
                                                         under --resume, appended to FILE as a line
    python tests/stand_in.py overlap NAME FILE --out DIR "start NAME", 0.3 s later "end NAME", appended to FILE
    python tests/stand_in.py env --out DIR               DIR/env.json: the process's environment"""

import json
import os
import sys
import time
from pathlib import Path


def main(argv: list[str]):
    what, out = argv[0], Path(argv[argv.index("--out") + 1])
    if what == "env":
        out.mkdir()
        (out / "env.json").write_text(json.dumps(dict(os.environ)))
    elif what == "order":
        name, file = argv[1], argv[2]
        out.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("x")
        with open(file, "a") as f:
            f.write(name + (" resume" if "--resume" in argv else "") + "\n")
    elif what == "overlap":
        name, file = argv[1], argv[2]
        with open(file, "a", buffering=1) as log:
            log.write(f"start {name}\n")
            time.sleep(0.3)
            log.write(f"end {name}\n")
    else:
        raise SystemExit(f"error: unknown stand-in {what!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
