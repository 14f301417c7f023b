"""tests/forkserver.py, which starts the torchrun tests' workers and some command-line tests: a script run through it
sees what a fresh `python -u script` sees, and exits as it would."""

import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import ROOT, TORCHRUN_ENV, run_python

PROBE = """
import json, os, sys
print(json.dumps(dict(name=__name__, argv=sys.argv, path=sys.path, cwd=os.getcwd(), unbuffered=sys.stdout.write_through,
                      env=os.environ.get("PROBE"), hash=hash("rank"), imported="common" in sys.modules)))
ending = sys.argv[1]
if ending == "code":
    sys.exit(3)
if ending == "message":
    sys.exit("error: a message")
if ending == "raise":
    raise ValueError("a bug")
if ending == "interrupt":
    raise KeyboardInterrupt
"""


def fresh_python(script, *args, cwd):
    env = dict(os.environ, **TORCHRUN_ENV, PROBE="x")
    return subprocess.run(
        [sys.executable, "-u", str(script), *args], env=env, cwd=cwd, capture_output=True, text=True, check=False
    )


@pytest.mark.parametrize("ending", ["normal", "code", "message", "raise", "interrupt"])
def test_a_script_sees_and_ends_as_in_a_fresh_python(tmp_path, ending):
    """__name__, argv, sys.path (its folder, $PYTHONPATH, then the interpreter's), the working folder, -u, the
    environment; its exit status (SystemExit's code or message, a traceback and 1, killed by SIGINT) and its stderr
    (the traceback's frames the script's). The project's modules are not imported before the script imports them."""
    script, cwd = tmp_path / "probe.py", tmp_path / "elsewhere"
    script.write_text(PROBE)
    cwd.mkdir()
    fresh, forked = fresh_python(script, ending, cwd=cwd), run_python(script, ending, cwd=cwd, env={"PROBE": "x"})
    seen = [json.loads(p.stdout.splitlines()[0]) for p in (fresh, forked)]
    for s in seen:
        del s["hash"]
    assert seen[0] == seen[1] and seen[0]["path"][:2] == [str(tmp_path), str(ROOT)] and not seen[0]["imported"]
    expected = {"normal": 0, "code": 3, "message": 1, "raise": 1, "interrupt": -signal.SIGINT}[ending]
    assert fresh.returncode == forked.returncode == expected
    assert fresh.stderr == forked.stderr


def test_each_rank_has_a_hash_seed_of_its_own(tmp_path):
    """Two ranks' workers differ in their string hashes, as two fresh processes do; one rank's two runs share one."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)

    def rank_hash(rank):
        proc = run_python(script, "normal", env={"LOCAL_RANK": str(rank)})
        return json.loads(proc.stdout)["hash"]

    assert rank_hash(0) == rank_hash(0) != rank_hash(1)


def test_a_request_that_changes_what_libraries_read_at_load_is_refused(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    proc = run_python(script, "normal", env={"OMP_NUM_THREADS": "2"})
    assert proc.returncode == 1 and "refused the request (['OMP_NUM_THREADS'])" in proc.stderr
