"""What a user runs on a run's results, beside the scripts (common.py holds what a run shares):

python tests/reports.py evaluate --generations FILE.jsonl  # NLG and CE metrics, by the rules of the run beside it
python tests/reports.py generate RUN IMAGE [IMAGE ...]     # a trained run's report for the views of one study
python tests/reports.py generate RUN --data annotation.json --split test --json reports.jsonl
"""

from __future__ import annotations

import argparse
import json
import logging
import pkgutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py and the scripts (mrg_r1's report extraction)
import common


def generate_reports(run_dir, studies: list[tuple[str, list[str]]]) -> list[dict]:
    """`generate`: RUN/final's policy (LoRA folded in) writes a greedy report for each study (id, its view files) with
    the prompt, length and report extraction its run evaluated with -> [{"id", "views", "report"}]."""
    final = Path(run_dir) / "final"
    if not (final / "generation.json").is_file():
        raise FileNotFoundError(f"{run_dir}: no final/generation.json (not a finished run's --out, or a stage's)")
    settings = json.loads((final / "generation.json").read_text())
    config = json.loads((Path(run_dir) / "config.json").read_text())
    tiny = (final / "tiny_policy.pt").is_file()
    if (config["model"] == "tiny") != tiny:
        raise ValueError(f"{final}: not a model of --model {config['model']} (its config.json)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if config["dtype"] == "bf16" and device == "cuda" else torch.float32
    try:
        policy = common.load_policy(final, device, dtype, **({} if tiny else {"max_pixels": config.get("max_pixels")}))
    except (RuntimeError, KeyError) as e:  # weights of another shape or kind
        raise ValueError(f"{final}: does not load as its config's model ({str(e).splitlines()[0][:200]})") from None
    report = pkgutil.resolve_name(settings["report"]) if settings["report"] else None  # mrg_r1:extract_report
    records = [common.Record(i, views, "", "") for i, views in studies]
    texts = common.greedy_reports(policy, records, settings["prompt"], settings["max_new_tokens"], device, dtype)
    return [{"id": i, "views": views, "report": report(t) if report else t} for (i, views), t in zip(studies, texts)]


def main(argv=None):
    """`evaluate --generations FILE.jsonl`: score a generations file (as its run did, if beside it); `generate RUN IMAGE
    [IMAGE ...]`: a trained run's report for a study's views."""
    p = argparse.ArgumentParser(description=main.__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("evaluate", help="NLG and CE metrics of a JSONL file with 'reference' and 'generated' per line")
    e.add_argument("--generations", required=True, help="JSONL with 'reference' and 'generated' per line")
    e.add_argument("--labeler", choices=["rule", "chexbert"], help="without these four: the run's, else rule")
    e.add_argument("--chexbert-weights", help="a local chexbert.pth (else downloaded once from the Hub)")
    e.add_argument("--clean", choices=["mimic_cxr", "iu_xray", "none"], help="R2Gen's cleaning, else MIMIC-CXR's")
    e.add_argument("--uncertain-as", type=int, choices=[0, 1], help="CE: uncertain as positive, or the papers' 0")
    e.add_argument("--no-meteor", action="store_true", help="skip METEOR (it needs java and pycocoevalcap)")
    e.add_argument("--out", help="JSON output (default: <generations file>.scores.json beside it)")
    g = sub.add_parser("generate", help="a trained run's greedy report for new images (RUN/final, the run's prompt)")
    g.add_argument("run", help="a finished run's --out folder, or a stage's (deer.py's rl_grad, ...)")
    g.add_argument("images", nargs="*", help="the views of one study; or one folder, each image in it a study")
    g.add_argument("--data", help="an annotation.json (R2Gen's layout): each study of its --split")
    g.add_argument("--split", default="test", choices=["train", "val", "test"])
    g.add_argument("--json", help="write {id, views, report} per line to this file (else print the reports)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "generate":  # the studies its arguments name, their reports printed or written
        try:
            if args.data:
                studies = [(r.id, r.image_paths) for r in common.load_data(args.data, splits=(args.split,))[args.split]]
            elif len(args.images) == 1 and Path(args.images[0]).is_dir():
                files = sorted(Path(args.images[0]).iterdir())  # each image a study
                studies = [(p.stem, [str(p)]) for p in files if p.suffix.lower() in (".png", ".jpg", ".jpeg")]
            else:
                studies = [(Path(args.images[0]).stem if args.images else "", args.images)]
            missing = [v for _, views in studies for v in views if not Path(v).is_file()]
            if missing:
                raise FileNotFoundError(f"image not found: {missing[0]}")
            if not studies or not studies[0][1]:
                raise FileNotFoundError("no image given: IMAGE [IMAGE ...], a folder of images, or --data FILE")
            rows = generate_reports(args.run, studies)
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: {e}") from None
        if args.json:
            Path(args.json).write_text("".join(json.dumps(row) + "\n" for row in rows))
            return print(f"wrote {args.json}: {len(rows)} reports")
        return print("\n".join(row["report"] if len(rows) == 1 else f"{row['id']}: {row['report']}" for row in rows))
    rules = dict(labeler="rule", chexbert_weights=None, clean="mimic_cxr", uncertain_as=0, headline="micro_f1")
    path = Path(args.generations)  # the run that wrote it: its config.json (or its stage's), its eval JSON
    found = [p for p in (path.with_name("config.json"), path.parent.with_name("config.json")) if p.is_file()][:1]
    evals = [path.with_name(f"eval_{path.stem.removeprefix('generations_')}.json"), path.with_name("eval.json")]
    found += [p for p in evals if p.is_file() and "headline" in json.loads(p.read_text())][:1]
    for source in found:  # the config's labeler, weights and cleaning; the eval JSON's cleaning and CE convention
        skip = "" if source.name == "config.json" else "labeler"  # an eval JSON names the labeler's class
        rules |= {k: v for k, v in json.loads(source.read_text()).items() if k in rules and k != skip}
    given = {k: v for k, v in vars(args).items() if k in rules and v is not None}  # flags given win
    rules |= given
    print(f"rules {rules}: from {', '.join(map(str, found)) or 'the defaults'}; given: {', '.join(given) or 'none'}")
    try:
        rows = common.read_generations(args.generations)
        labeler = common.make_labeler(rules["labeler"], rules["chexbert_weights"])
        clean = None if rules["clean"] == "none" else rules["clean"]
        name = path.stem.removeprefix("generations_")  # the evaluation (test_after, ...), as its warnings name it
        meteor = not args.no_meteor
        result = common.evaluate_generations(
            rows, labeler, clean, rules["uncertain_as"], meteor, rules["headline"], name=name
        )
    except (FileNotFoundError, ValueError) as e:  # bad input: one clear line, no traceback
        raise SystemExit(f"error: {e}") from None
    out = Path(args.out) if args.out else Path(args.generations).with_suffix(".scores.json")  # never a run's eval.json
    out.write_text(json.dumps(result, indent=2))
    scores = {**result["nlg"], **{k: v for k, v in result["ce"].items() if k != "per_label"}}
    print(json.dumps(scores, indent=1), f"\n{common.summary(result)}\nwrote {out}")


if __name__ == "__main__":
    main()
