"""Test-only: several runs in one torchrun launch, so that the suite pays a worker's imports (~5 CPU-s) once.

`python -m torch.distributed.run --nproc_per_node=2 --standalone tests/torchrun_cases.py CASES` (conftest's
torchrun_cases launches it): CASES is a JSON list of {"name", "script", "argv", "env"}. Each rank runs the cases in
turn, each as `python -u script argv` would run it (as __main__, with the case's variables set), all in the process
group the first one joins. The end of a case's run (common.end_process) ends the case, not the process: it waits for
the other rank and leaves the group standing; the case's exit status (0, or 130 after Ctrl-C) goes to
status_rank<RANK>.json beside CASES. An error ends the whole launch as it would end a run (torchrun stops the other
rank): the test that launched it fails with the traceback. What a case's script changes on the project's modules,
their classes and torch (a function it wraps, a constant it shortens) is undone before the next case starts."""

import json
import os
import runpy
import sys
import types
from pathlib import Path

import torch

import common
import dcrrg
import deer
import mrg_r1
import orapo
import rrgcl

PATCHABLE_MODULES = (torch, common, dcrrg, deer, mrg_r1, orapo, rrgcl)
end_process = common.end_process  # the real one: a case's end is end_case below


class CaseEnded(Exception):
    """A case's run ended; its exit status."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def end_case(message: str | None = None, at_once: bool = False, code: int = 1):
    """common.end_process for a case: an error (at_once) ends the launch as it ends a run; any other end (done, or
    interrupted with its message) waits for the other rank and ends the case alone."""
    if at_once:
        end_process(message, at_once=True, code=code)
    common.barrier()
    if message:
        sys.stderr.write(f"{message}\n")
    raise CaseEnded(code if message else 0)


def patchable() -> list:
    """The objects a case may patch: the modules above and the classes the project's modules define."""
    classes = [
        value
        for module in PATCHABLE_MODULES[1:]
        for value in vars(module).values()
        if isinstance(value, type) and value.__module__ == module.__name__
    ]
    return [*PATCHABLE_MODULES, *classes]


def snapshot() -> list:
    return [(obj, dict(vars(obj))) for obj in patchable()]


def restore(saved: list):
    """Put back every attribute a case set, added or deleted on the objects of `snapshot()`."""
    for obj, before in saved:
        now = vars(obj)
        for name in set(now) - set(before):
            if not isinstance(now[name], types.ModuleType):  # a submodule imported meanwhile stays
                delattr(obj, name)
        for name, value in before.items():
            if name not in now or now[name] is not value:
                setattr(obj, name, value)


def run_case(case: dict) -> int:
    saved, environ, argv = snapshot(), dict(os.environ), list(sys.argv)
    os.environ.update(case.get("env", {}))
    sys.argv = [case["script"], *case["argv"]]
    try:
        runpy.run_path(case["script"], run_name="__main__")
        return 0  # a script without common.run_main
    except CaseEnded as ended:
        return ended.code
    finally:
        restore(saved)
        os.environ.clear()
        os.environ.update(environ)
        sys.argv = argv


if __name__ == "__main__":
    cases_file = Path(sys.argv[1])
    common.end_process = end_case
    status = {}
    for case in json.loads(cases_file.read_text()):
        status[case["name"]] = run_case(case)
    (cases_file.parent / f"status_rank{os.environ['RANK']}.json").write_text(json.dumps(status))
    end_process()
