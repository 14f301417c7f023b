import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import sandbox
from hub_layout import build_tiny_qwen


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: benchmarks and long checks, run with -m slow")
    # Tiny models are all small ops: intra-op threads only spin and fight (10x slower on a
    # busy 2-core machine). Benchmarks that want threads set them themselves.
    import torch

    torch.set_num_threads(int(os.environ.get("RRG_TEST_THREADS", "1")))


# Tests that launch torchrun or two JVMs (8-60 s each) go first: pytest-xdist hands tests out in collection order, so
# the two workers then end together rather than one waiting on a long test at the end (-n 2: the suite's wall time).
LONG_FIRST = {
    ("test_distributed.py", "test_orapo_under_two_processes"),
    ("test_distributed.py", "test_mrg_r1_under_two_processes"),
    ("test_distributed.py", "test_deer_under_two_processes"),
    ("test_distributed.py", "test_dcrrg_two_processes_equal_one"),
    ("test_distributed.py", "test_rrgcl_two_processes_equal_one"),
    ("test_running.py", "test_two_nodes_through_the_c10d_rendezvous_equal_one_process"),
    ("test_running.py", "test_an_error_on_one_rank_ends_the_job_at_once"),
    ("test_metrics.py", "test_meteor_equals_pycocoevalcap"),
}


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: (item.path.name, item.originalname) not in LONG_FIRST)  # stable: the rest keep order


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item):
    """An error inside pytest's own handling of a test (an internal error: under pytest-xdist, the worker's traceback
    and no test name) names the test it was running (.ci/run's digest prints the line)."""
    try:
        return (yield)
    except Exception as e:
        if hasattr(e, "add_note"):  # Python 3.11 and newer
            e.add_note(f"raised while pytest ran {item.nodeid}")
        raise


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    # `--data synthetic` caches under $RRG_CACHE: keep tests out of the user's cache. METEOR starts a JVM
    # (seconds) in every process: off unless a test asks for it (tests/test_metrics.py); figures likewise (test_cli.py).
    os.environ["RRG_CACHE"] = str(tmp_path_factory.mktemp("rrg_cache"))
    os.environ["RRG_METEOR"] = "0"
    os.environ["RRG_FIGURES"] = "0"


def _small_only(real, what: str, instead: str):
    """The sandbox's `what`: the shipped one, or built with small settings; a test that would train it at full size
    (minutes) fails at once."""

    def build(annotation=None, settings=None):
        if annotation is not None and settings is None:
            raise AssertionError(f"this test trains the sandbox's {what} at full size: give it {instead}")
        return real(annotation, settings)

    return build


@pytest.fixture(autouse=True)
def _no_full_sandbox_models(monkeypatch):
    """A test that would train the sandbox's CheXbert or foundation at full size, or draw the full synthetic set,
    fails at once instead; tests of them pass small settings (the shipped models load in a moment)."""

    chexbert = _small_only(sandbox.synthetic_chexbert, "CheXbert", "--labeler rule")
    monkeypatch.setattr(sandbox, "synthetic_chexbert", chexbert)
    foundation = _small_only(sandbox.synthetic_foundation, "foundation", "--tiny-start random")
    monkeypatch.setattr(sandbox, "synthetic_foundation", foundation)
    draw = sandbox.synthetic_data

    def small_set(*args, **kwargs):  # the full set draws 2,700 images (seconds): tests use small_synthetic
        if not (args or kwargs):
            raise AssertionError("this test draws the full synthetic set: monkeypatch sandbox.synthetic_data")
        return draw(*args, **kwargs)

    monkeypatch.setattr(sandbox, "synthetic_data", small_set)


# The sandbox's foundation at a size a test can afford: seconds on a CPU (tests/test_foundation.py)
SMALL_FOUNDATION = dict(images=48, reports=48, held_out=16, batch_size=8, lr=3e-3, every=5, patience=2)
SMALL_FOUNDATION |= dict(min_gain=0.01, max_steps=20, seed=1)


@pytest.fixture(scope="session")
def small_foundation(small_synthetic):
    """A foundation for the small synthetic set, built once for the session (beside it, as runs find it)."""

    return sandbox.synthetic_foundation(small_synthetic, SMALL_FOUNDATION)


@pytest.fixture
def synthetic_set_is_small(monkeypatch, small_synthetic):
    """`--data synthetic` reads the small set (as the full one is found)."""

    monkeypatch.setattr(sandbox, "synthetic_data", lambda *a, **k: small_synthetic)


@pytest.fixture
def synthetic_is_small(monkeypatch, synthetic_set_is_small, small_foundation):
    """`--data synthetic` reads the small set, and its foundation is the small one (as the full ones are found)."""

    monkeypatch.setattr(sandbox, "synthetic_foundation", lambda *a, **k: small_foundation)


@pytest.fixture(scope="session")
def small_synthetic(tmp_path_factory, request):
    """A small synthetic set (R2Gen layout) shared by the tests, and by pytest-xdist's workers: one writes it (and the
    small foundation beside it, through the cache's own lock), the other waits and reads it."""

    session = tmp_path_factory.getbasetemp()
    worker = hasattr(request.config, "workerinput")  # a pytest-xdist worker: its folder is under the session's
    out = (session.parent if worker else session) / "synthetic"
    with sandbox.cache_lock(out.parent / ".synthetic.lock"):
        if not (out / "annotation.json").is_file():
            sandbox.make_synthetic(out, n_train=40, n_val=8, n_test=12, size=64, seed=0)
    return out / "annotation.json"


def qwen_flags(data, model_dir, out, *more: str) -> list[str]:
    """A script's flags for a short run of the tiny random Qwen2.5-VL (the Hugging Face path): the data, the model, the
    offline rules and the run folder; `more`: the test's own (steps, tokens, pixels, ...)."""
    return ["--data", str(data), "--model", str(model_dir), "--labeler", "rule", "--out", str(out), *more]


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory, small_synthetic):
    """A folder with a tiny random Qwen2.5-VL and its processor, usable as `--model DIR`."""
    import common

    reports = [r.report for r in common.load_annotation(small_synthetic)["train"]]
    prompts = ["You are a radiologist. Describe the chest X-ray.", "<think> </think> <report> </report>"]
    return build_tiny_qwen(tmp_path_factory.mktemp("tiny_qwen"), reports + prompts)


def fake_eval(*args, **kwargs) -> dict:
    """What Run.evaluate returns, all zeros: for tests that monkeypatch it away (not under test)."""
    import common

    ce = {k: 0.0 for k in ("micro_f1", "macro_precision", "macro_recall", "macro_f1", "example_f1")}
    return {
        "headline": (kwargs.get("ce") or {}).get("headline", "micro_f1"),
        "uncertain_as": 0,
        "ce": ce,
        "nlg": {"BLEU-4": 0.0},
        "degenerate": common.degenerate_output(["a"], ["a"]),
        "reward": 0.0,
        "facts_reward": 0.0,
    }


def metrics_rows(path):
    """A run's metrics.jsonl as dicts without the wall-clock "time": what a resumed run must repeat exactly."""
    import json

    return [{k: v for k, v in json.loads(x).items() if k != "time"} for x in Path(path).read_text().splitlines()]


class Crash(Exception):
    """A run killed right after writing a checkpoint (the resume tests)."""


@pytest.fixture
def crash_after_checkpoint(monkeypatch):
    """arm(k): from now on Run.save_checkpoint writes its checkpoint and then raises Crash when it saved
    step k; arm(None) puts the real one back. The resume tests compare a resumed run with one never stopped bit for
    bit, with no tolerance, and that holds on any CPU: both run in this process, on the same kernels, and the resumed
    one repeats the same float operations in the same order and shapes, from weights, optimiser state and RNG states
    that the checkpoint gives back exactly (checked under ATEN_CPU_CAPABILITY=default and avx2)."""
    import common

    real = common.Run.save_checkpoint

    def arm(crash_step):
        if crash_step is None:
            monkeypatch.setattr(common.Run, "save_checkpoint", real)
            return

        def save_then_crash(self, step):
            real(self, step)
            if step == crash_step:
                raise Crash(f"stopped after the step-{step} checkpoint")

        monkeypatch.setattr(common.Run, "save_checkpoint", save_then_crash)

    return arm


def labels(**values):
    """One (1, 14) label row: labels(Cardiomegaly=1, Edema=0) (names with spaces via _)."""
    import numpy as np

    import common

    row = np.full((1, len(common.CHEXPERT_LABELS)), np.nan)
    for k, v in values.items():
        row[0, common.LABEL_INDEX[k.replace("_", " ")]] = v
    return row


TORCHRUN_ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}  # CPU (gloo), 1 thread


def run_python(script, *args: str, env: dict | None = None, cwd=None, timeout: int = 300):
    """`python -u script args` in a process of its own (a CompletedProcess, text captured). The environment:
    os.environ, TORCHRUN_ENV's, then `env`."""
    import subprocess

    command = [sys.executable, "-u", str(script), *args]
    environment = {**os.environ, **TORCHRUN_ENV, **(env or {})}
    return subprocess.run(
        command, env=environment, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )


def torchrun(script: str, *flags: str, nproc: int = 2, timeout: int = 300, ok: bool = True):
    """ROOT/script under `python -m torch.distributed.run --nproc_per_node=nproc --standalone` on CPU (gloo), one
    thread per process; fails the test with the end of stderr if it fails (or, ok=False, if it does not)."""
    import subprocess

    launch = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone"]
    proc = subprocess.run(
        [*launch, str(ROOT / script), *flags],
        env=dict(os.environ, **TORCHRUN_ENV),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,  # the exit status is asserted below
    )
    assert (proc.returncode == 0) == ok, proc.stderr[-4000:]
    return proc


# Real IU X-Ray as users have it, written by the tests (the text is ours, never Open-i's). The R2GenGPT layout that
# public RRG repositories ship: no "split" field in records, flat Open-i image names (CXR<n>_IM-<m>-<k>001.png), 1 to
# 5 views per study, non-square PNGs; R2Gen's own file: "split" fields, images/<id>/0.png and 1.png, 2 views each.
# Reports hold XXXX anonymisation tokens, numbers ("1.2 cm", "1. ... 2. ..."), one longer than the tiny model's
# 96-token cap and one impression-only report.
IU_FINDINGS = [
    "The heart is normal in size.",
    "The mediastinum is unremarkable.",
    "The lungs are clear.",
    "There is no pneumothorax or pleural effusion.",
    "XXXX XXXX are intact.",
    "No focal airspace consolidation.",
    "The cardiomediastinal silhouette is within normal limits.",
    "No acute bony abnormality.",
    "There is a 1.2 cm calcified granuloma in the right upper lobe.",
    "Mild degenerative changes of the spine.",
    "The heart is mildly enlarged.",
    "Small left pleural effusion.",
    "Stable XXXX sternotomy wires.",
    "Patchy opacity at the right base may represent atelectasis or early pneumonia.",
    "There is a 2.5 x 1.8 cm nodule in the left midlung.",
    "Mild hyperinflation of the lungs.",
]
IU_IMPRESSIONS = [
    "No acute cardiopulmonary abnormality.",
    "No active disease.",
    "Cardiomegaly without acute process.",
    "1. Small left effusion. 2. No pneumothorax.",
]
IU_VIEWS = [2, 1, 2, 3, 2, 4, 2, 1, 5, 2]  # views per study, cycled: mostly 2, some 1, 3, 4, 5


def write_iu_xray(
    out_dir, layout: str = "r2gengpt", n_train: int = 40, n_val: int = 8, n_test: int = 12, seed: int = 0
):
    """A folder with the structure of real IU X-Ray -> its annotation.json (no "labels": the scripts label them)."""
    import json

    import numpy as np
    from PIL import Image

    rng, out = np.random.default_rng(seed), Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    annotation, k = {}, 0
    for split, n in (("train", n_train), ("val", n_val), ("test", n_test)):
        annotation[split] = []
        for _ in range(n):
            study, k = f"CXR{1000 + k}_IM-{2000 + 7 * k:04d}", k + 1
            sentences = list(rng.choice(IU_FINDINGS, size=int(rng.integers(3, 7)), replace=False))
            report = " ".join(sentences + [str(rng.choice(IU_IMPRESSIONS))])
            if k % 13 == 0:  # impression only
                report = str(rng.choice(IU_IMPRESSIONS))
            if k % 17 == 0:  # longer than the tiny model's 96 tokens
                report = " ".join(IU_FINDINGS * 2)
            views = IU_VIEWS[k % len(IU_VIEWS)] if layout == "r2gengpt" else 2
            names = (
                [f"{study}-{v + 1}001.png" for v in range(views)]
                if layout == "r2gengpt"
                else [f"{study}/{v}.png" for v in range(views)]
            )
            for name in names:
                h, w = int(rng.integers(56, 90)), int(rng.integers(56, 90))  # not square
                (out / "images" / name).parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(rng.integers(0, 255, (h, w), dtype=np.uint8)).save(out / "images" / name)
            record = {"id": study, "report": report, "image_path": names}
            annotation[split].append(record | ({"split": split} if layout == "r2gen" else {}))
    (out / "annotation.json").write_text(json.dumps(annotation))
    return out / "annotation.json"


@pytest.fixture(scope="session")
def iu_xray(tmp_path_factory):
    """IU X-Ray in the R2GenGPT layout (1-5 views per study, flat Open-i names), text ours."""
    return write_iu_xray(tmp_path_factory.mktemp("iu_xray_r2gengpt"))


@pytest.fixture(scope="session")
def iu_xray_r2gen(tmp_path_factory):
    """IU X-Ray in R2Gen's own layout (2 views per study, images/<id>/0.png, "split" fields), text ours."""
    return write_iu_xray(tmp_path_factory.mktemp("iu_xray_r2gen"), layout="r2gen")


def update_relative_difference(a: dict, b: dict, start: dict) -> float:
    """sum |a - b| / sum |b - start| over the floating tensors of three state dicts: how far apart two runs ended,
    against how far one of them moved. Tolerances that hold on any CPU compare this, not elements: Adam's first steps
    divide by |gradient|, so an element whose gradient is rounding noise (a bias before a GroupNorm, whose gradient is
    0 in exact arithmetic) moves by its full lr in a direction rounding picks, on any kernel."""
    keys = [k for k in b if b[k].is_floating_point()]
    moved = sum(float((b[k].double() - start[k].double()).abs().sum()) for k in keys)
    return sum(float((a[k].double() - b[k].double()).abs().sum()) for k in keys) / moved


@pytest.fixture
def starting_weights(monkeypatch):
    """A copy of the state dict of each model given to Run.restore (the weights its steps start from), in call order."""
    import common

    seen, restore = [], common.Run.restore

    def keep(self, model, *a, **k):
        seen.append({n: t.detach().clone() for n, t in model.state_dict().items()})
        return restore(self, model, *a, **k)

    monkeypatch.setattr(common.Run, "restore", keep)
    return seen


class Stop(Exception):
    """Raised where a settings test has read what it needs (tests/test_paper_settings.py)."""


@pytest.fixture
def built(monkeypatch):
    """What a run builds, read from the objects themselves: every Run.restore (its stage's folder name, the model, the
    optimiser, the schedule, the state, the parameters that train), every Run.steps (its total and one batch drawn
    from its batches), for_training (policy, reference, options, and the reports initial_policy was given), the warm
    start's settings and the first rollout's arguments, where the run
    stops (Stop). Evaluations are skipped (fake_eval). Settings: `skip` = stage folder names whose steps do not run
    (their results and final/ are written as if they had: the next stage starts), `stop` = names whose restore
    raises Stop after it is read."""
    from types import SimpleNamespace

    import common

    seen = SimpleNamespace(restores={}, steps={}, policies=[], rollout=None, run=None, skip=set(), stop=set())
    seen.reports, seen.warm_start = None, None
    real = SimpleNamespace(start_run=common.start_run, restore=common.Run.restore, steps=common.Run.steps)
    real.initial_policy, real.warm_start, real.for_training = (
        common.initial_policy,
        common.warm_start,
        common.for_training,
    )

    def start_run(args, *a, **k):
        seen.run = real.start_run(args, *a, **k)
        return seen.run

    def initial_policy(run, reports, *a, **k):
        seen.reports = reports
        return real.initial_policy(run, reports, *a, **k)

    def warm_start(run, policy, records, settings, *a, **k):
        seen.warm_start = settings
        return real.warm_start(run, policy, records, settings, *a, **k)

    def for_training(run, policy, **options):
        policy, ref = real.for_training(run, policy, **options)
        seen.policies.append(SimpleNamespace(policy=policy, ref=ref, options=options, records=seen.reports))
        return policy, ref

    def restore(self, model, optimizer=None, scheduler=None, state=None):
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        start = real.restore(self, model, optimizer, scheduler, state)
        seen.restores[self.out.name] = SimpleNamespace(
            run=self,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            state=state,
            trainable=trainable,
            frozen=frozen,
        )
        if self.out.name in seen.stop:
            raise Stop(f"read {self.out.name}'s restore")
        return start

    def steps(self, total, batches, *a, **k):
        seen.steps[self.out.name] = SimpleNamespace(total=total, batch=next(batches(0)))
        return iter(()) if self.out.name in seen.skip else real.steps(self, total, batches, *a, **k)

    def rollout(policy, images, text, G, max_new_tokens, temperature=1.0):
        seen.rollout = SimpleNamespace(policy=policy, studies=len(images), G=G, max_new_tokens=max_new_tokens)
        seen.rollout.temperature = temperature
        raise Stop("read the first rollout")

    monkeypatch.setattr(common, "start_run", start_run)
    for hook in (initial_policy, warm_start, for_training):
        monkeypatch.setattr(common, hook.__name__, hook)
    monkeypatch.setattr(common.Run, "restore", restore)
    monkeypatch.setattr(common.Run, "steps", steps)
    monkeypatch.setattr(common, "rollout", rollout)
    monkeypatch.setattr(common.Run, "evaluate", fake_eval)
    return seen


def record_updates(mp) -> list:
    """Patches common.adamw (with `mp`, a pytest.MonkeyPatch) so that each optimiser it makes notes, when its step()
    runs, what that step applies: its parameter group's lr, and the total norm of its parameters' gradients then
    (after any clipping), beside their raw norm (each gradient as its last backward left it: a hook on the parameter,
    before anything the loop does to it). -> the optimisers' notes, in the order they were made, each a namespace of
    three lists (lr, norm, raw) with an entry a step: what the loops apply, not what they log."""
    from types import SimpleNamespace

    import common

    made, real = [], common.adamw

    def adamw(params, *args, **kwargs):
        params = list(params)
        optimizer, scheduler = real(params, *args, **kwargs)
        seen = SimpleNamespace(lr=[], norm=[], raw=[], last={})

        def accumulated(p):  # after each backward's gradient is added to p.grad: p.grad's squared norm now
            seen.last[p] = p.grad.detach().double().square().sum()

        def stepping(optimizer, args, kwargs):
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            seen.lr.append(optimizer.param_groups[0]["lr"])
            seen.norm.append(float(sum(g.detach().double().square().sum() for g in grads) ** 0.5))
            seen.raw.append(float(sum(seen.last.values()) ** 0.5))
            seen.last.clear()

        for p in params:
            p.register_post_accumulate_grad_hook(accumulated)
        optimizer.register_step_pre_hook(stepping)
        made.append(seen)
        return optimizer, scheduler

    mp.setattr(common, "adamw", adamw)
    return made


@pytest.fixture
def applied_updates(monkeypatch) -> list:
    """conftest.record_updates for a test: each optimiser's lr and gradient norms at each step()."""
    return record_updates(monkeypatch)


def assert_applied(seen, lrs: list[float], clip: float | None):
    """An optimiser's steps (record_updates' notes) applied the learning rates `lrs` (the schedule's formula worked
    by hand) and gradients of total norm min(raw, clip) (clip None: the raw ones, untouched); at least one step's raw
    norm is above `clip` (so that a loop that never clips, or clips elsewhere, shows)."""
    assert seen.lr == pytest.approx(lrs, rel=1e-9, abs=0), "the lr each step applied"
    expected = [raw if clip is None else min(raw, clip) for raw in seen.raw]
    assert seen.norm == pytest.approx(expected, rel=1e-5), (seen.raw, seen.norm)  # clip_grad_norm_: clip / (raw + 1e-6)
    assert clip is None or max(seen.raw) > clip, f"no step's gradient norm reaches the clip {clip}: {seen.raw}"


def lr_factors(scheduler, steps) -> list[float]:
    """The schedule's lr multiplier at each of `steps` (LambdaLR's function), rounded to 6 places."""
    return [round(scheduler.lr_lambdas[0](k), 6) for k in steps]


def one_step_in_micro_batches(monkeypatch, main, argv: list[str], k: int):
    """A script's main(argv) for one RL step under --grad-accum k, evaluations skipped -> (the generate() calls it made,
    the rollout's completions, the gradient of everything that trains at the update, in parameter order)."""
    from types import SimpleNamespace

    import torch

    import common

    calls, rolls, grads = [], [], []
    real = SimpleNamespace(generate=common.TinyPolicy.generate, rollout=common.rollout, clip=common.clip_gradients)

    def generate(self, *a, **kw):
        calls.append(1)
        return real.generate(self, *a, **kw)

    def clip(params, max_norm):
        params = list(params)
        grads.append(torch.cat([p.grad.flatten() for p in params if p.grad is not None]))
        return real.clip(params, max_norm)

    monkeypatch.setattr(common.TinyPolicy, "generate", generate)
    monkeypatch.setattr(common, "rollout", lambda *a, **kw: rolls.append(real.rollout(*a, **kw)) or rolls[-1])
    monkeypatch.setattr(common, "clip_gradients", clip)
    monkeypatch.setattr(common.Run, "evaluate", fake_eval)
    main([*argv, "--grad-accum", str(k)])
    assert len(rolls) == len(grads) == 1, "one RL step"
    return len(calls), rolls[0].texts, grads[0]


def recorded_but_not_used(built, stage: str, folder) -> dict:
    """Each value the stage's config.json records under "resolved" (what the flags' None and "auto" came to) against
    the one the run built with it, read back from the objects (conftest.built: the optimiser, the steps and their
    batch, the policy's records, the first rollout, what trains) -> {key: (recorded, used)} where they differ. A key no
    reader below knows is an error too, so that a new recorded value gets its check; a text (a rule's description)
    is skipped, and so is a value whose objects the run did not reach (it stopped before them)."""
    import json

    resolved = json.loads((Path(folder) / "config.json").read_text())["resolved"]
    read, steps = built.restores.get(stage), built.steps.get(stage)
    made = built.policies[-1] if built.policies else None
    group = read.optimizer.param_groups[0] if read and read.optimizer else {}
    warm = built.steps.get("warm_start")
    readers = {
        "lr": lambda: group.get("initial_lr", group.get("lr")),
        "steps": lambda: steps and steps.total,
        "max_new_tokens": lambda: built.rollout and built.rollout.max_new_tokens,
        "train_size": lambda: made and len(made.records),
        "studies": lambda: made and len(made.records),
        "prompts_per_step": lambda: steps and len(steps.batch["id"]),
        "batch": lambda: steps and len(steps.batch["id"]),
        "sft_steps": lambda: steps.total if stage == "sft" else (warm.total if warm else 0),  # DEER's SFT: its own
        "lm": lambda: "frozen" if read.frozen else "trained",
        "parts": lambda: sorted({n.split(".")[0] for n in read.trainable}),
        "converge": lambda: None,
        "beta": lambda: None,  # DEER's premise beta: tests/test_deer.py follows it into the token weights
    }
    unknown = set(resolved) - set(readers)
    if unknown:
        raise AssertionError(f"{stage}: recorded {sorted(unknown)}, which no reader of recorded_but_not_used checks")
    differ = {}
    for key, recorded in resolved.items():
        if isinstance(recorded, str | dict) or readers[key]() is None:
            continue
        used = readers[key]()
        recorded = sorted(recorded) if key == "parts" else recorded
        if used != recorded:
            differ[key] = (recorded, used)
    return differ
