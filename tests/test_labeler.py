"""RuleLabeler: exact on the synthetic reports, right on real-style report text; `tests/reproduce.py labels`."""

import csv
import time

import numpy as np
import pytest

import reproduce
from common import (
    CHEXPERT_LABELS,
    LABEL_INDEX,
    RuleLabeler,
    apply_no_finding_rule,
)
from sandbox import sample_synthetic_study, write_synthetic_report

# Real-style report text with labels we are sure of. Labels not listed are blank; No Finding, unless listed,
# follows CheXpert's rule over the 13 (1 when nothing but Support Devices is positive or uncertain).
REAL_STYLE = [
    ("No acute cardiopulmonary process.", {}),
    ("No pleural effusion or pneumothorax.", {"Pleural Effusion": 0, "Pneumothorax": 0}),
    (
        "No focal consolidation, pleural effusion, or pneumothorax.",
        {"Consolidation": 0, "Pleural Effusion": 0, "Pneumothorax": 0},
    ),
    ("Heart size is normal.", {"Cardiomegaly": 0}),
    ("The heart size is mildly enlarged.", {"Cardiomegaly": 1}),
    ("Moderate cardiomegaly is unchanged.", {"Cardiomegaly": 1}),
    ("Stable moderate cardiomegaly.", {"Cardiomegaly": 1}),
    ("The cardiac silhouette is enlarged.", {"Cardiomegaly": 1}),
    ("The heart is not enlarged.", {"Cardiomegaly": 0}),
    ("Mild pulmonary edema.", {"Edema": 1}),
    ("There is mild pulmonary vascular congestion.", {"Edema": -1}),  # CheXpert: "vascular congestion" is uncertain
    ("Moderate pulmonary edema has improved.", {"Edema": 1}),
    ("Pulmonary edema has resolved.", {"Edema": 0}),
    ("Small bilateral pleural effusions.", {"Pleural Effusion": 1}),
    ("Small left pleural effusion cannot be excluded.", {"Pleural Effusion": -1}),
    ("Cannot exclude a small left pleural effusion.", {"Pleural Effusion": -1}),
    ("Possible small right pleural effusion.", {"Pleural Effusion": -1}),
    ("Interval resolution of the left pleural effusion.", {"Pleural Effusion": 0}),
    ("No pericardial effusion.", {}),
    (
        "Left lower lobe opacity may reflect atelectasis or pneumonia.",
        {"Lung Opacity": 1, "Atelectasis": -1, "Pneumonia": -1},
    ),
    ("Right basilar opacity, likely atelectasis.", {"Lung Opacity": 1, "Atelectasis": -1}),
    ("Patchy opacity in the right lower lobe concerning for pneumonia.", {"Lung Opacity": 1, "Pneumonia": -1}),
    ("Hazy opacity at the right base may represent pneumonia.", {"Lung Opacity": 1, "Pneumonia": -1}),
    ("There is no evidence of pneumonia.", {"Pneumonia": 0}),
    ("Findings suggestive of pneumonia.", {"Pneumonia": -1}),
    ("Pneumonia is not excluded.", {"Pneumonia": -1}),
    ("Pneumonia cannot be ruled out.", {"Pneumonia": -1}),
    ("There is no focal consolidation to suggest pneumonia.", {"Consolidation": 0, "Pneumonia": 0}),
    ("Right lower lobe consolidation, but no pleural effusion.", {"Consolidation": 1, "Pleural Effusion": 0}),
    ("No pleural effusion, but there is a small right pneumothorax.", {"Pleural Effusion": 0, "Pneumothorax": 1}),
    ("Lungs are clear without consolidation or edema.", {"Consolidation": 0, "Edema": 0}),
    ("Endotracheal tube terminates 4 cm above the carina.", {"Support Devices": 1}),
    ("The endotracheal tube has been removed.", {"Support Devices": 0}),
    ("Interval removal of the nasogastric tube.", {"Support Devices": 0}),
    ("Right internal jugular central venous catheter tip in the mid SVC.", {"Support Devices": 1}),
    ("Left chest wall pacemaker with leads in the right atrium and right ventricle.", {"Support Devices": 1}),
    ("Nasogastric tube courses below the diaphragm.", {"Support Devices": 1}),
    ("Feeding tube tip is in the stomach.", {"Support Devices": 1}),
    ("Left PICC line tip in the lower SVC.", {"Support Devices": 1}),
    ("Small right apical pneumothorax.", {"Pneumothorax": 1}),
    ("There is a tiny left apical pneumothorax.", {"Pneumothorax": 1}),
    ("No pneumothorax is seen.", {"Pneumothorax": 0}),
    ("There is a 1.2 cm nodule in the right upper lobe.", {"Lung Lesion": 1}),
    (
        "No XXXX focal consolidation. A 1.5 cm XXXX nodule. 2. No effusion.",  # IU X-Ray's anonymisation tokens
        {"Consolidation": 0, "Lung Lesion": 1, "Pleural Effusion": 0},
    ),
    ("No suspicious pulmonary nodules or masses.", {"Lung Lesion": 0}),
    ("Multiple displaced left rib fractures.", {"Fracture": 1}),
    ("No acute displaced rib fracture.", {"Fracture": 0}),
    ("Mild bibasilar atelectasis.", {"Atelectasis": 1}),
    ("The cardiomediastinal silhouette is within normal limits.", {"Enlarged Cardiomediastinum": 0}),
    ("The mediastinum is widened.", {"Enlarged Cardiomediastinum": 1}),
    ("Apical pleural thickening.", {"Pleural Other": 1}),
    ("Calcified pleural plaques are consistent with prior asbestos exposure.", {"Pleural Other": 1}),
    (
        "Mild cardiomegaly with small left pleural effusion and adjacent atelectasis.",
        {"Cardiomegaly": 1, "Pleural Effusion": 1, "Atelectasis": 1},
    ),
    ("The lungs are hyperinflated but clear.", {"No Finding": np.nan}),  # CheXpert's No Finding mention list
    ("Small left pleural effusion is unchanged. No pneumothorax.", {"Pleural Effusion": 1, "Pneumothorax": 0}),
    (
        "No evidence of pneumothorax or pleural effusion. Heart size is normal.",
        {"Pneumothorax": 0, "Pleural Effusion": 0, "Cardiomegaly": 0},
    ),
    # CheXpert's aggregation over mentions of one observation: {0,1} -> 1, {0,-1} -> -1, {-1,1} -> 1
    ("No right pleural effusion. Small left pleural effusion.", {"Pleural Effusion": 1}),
    ("Possible left basilar atelectasis. No atelectasis on the right.", {"Atelectasis": -1}),
    ("Possible small left effusion. Small right pleural effusion.", {"Pleural Effusion": 1}),
]


N = np.nan
# One group per rule of the CheXpert labeler (stanfordmlgroup/chexpert-labeler: phrases/, patterns/,
# stages/aggregate.py) or of ours, on sentences written for these tests; each group fails without its rule.
RULES = {
    "no_finding_mentions": [
        ("Degenerative endplate changes at several thoracic levels.", {"No Finding": N}),
        ("Stable mild dextroscoliosis.", {"No Finding": N}),  # inside a word, as CheXpert
        ("No emphysema. Calcified granuloma in the left upper lobe.", {"No Finding": N}),
    ],
    "no_finding_mentions_ours": [
        ("Mild tortuosity of the aortic arch is noted.", {"No Finding": N}),
        ("Spondylosis in the mid thoracic spine.", {"No Finding": N}),
        ("Low lung volumes on this portable film.", {"No Finding": N}),
    ],
    "chf_uncertain_cardiomegaly": [("Mild congestive heart failure.", {"Edema": 1, "Cardiomegaly": -1})],
    "hedged_edema": [
        ("Slight pulmonary vascular congestion today.", {"Edema": -1}),
        ("Indistinctness of the central pulmonary vessels.", {"Edema": -1}),
        ("No vascular congestion is seen now.", {"Edema": 0}),
    ],
    "borderline_heart_size_hedged": [("Borderline heart size on this film.", {"Cardiomegaly": -1})],
    "borderline_not_a_hedge": [
        ("There is borderline cardiomegaly again.", {"Cardiomegaly": 1}),
        ("The heart remains borderline in size.", {"Cardiomegaly": 1}),
    ],
    "stable_heart_or_mediastinum_hedged": [
        ("The cardiomediastinal silhouette is unchanged from before.", {"Enlarged Cardiomediastinum": -1}),
        ("Stable heart size since the last exam.", {"Cardiomegaly": -1}),
        ("Heart size is normal and stable.", {"Cardiomegaly": 0}),
    ],
    "heart_is_large": [
        ("The heart is large on this view.", {"Cardiomegaly": 1}),
        ("Moderate heart enlargement is present.", {"Cardiomegaly": 1}),
        ("There has been an increase in heart size since the last film.", {"Cardiomegaly": 1}),
    ],
    # against CheXpert, as the radiologists' gold: a calcified nodule is a lesion (a granuloma is not), "infection"
    # alone no pneumonia
    "calcified_nodule_is_a_lesion": [
        ("A calcified nodule in the left upper lobe.", {"Lung Lesion": 1}),
        ("A calcified granuloma in the right upper lobe.", {"No Finding": N}),
    ],
    "infection_alone_not_pneumonia": [
        ("Residual scarring from an old infection.", {"Lung Opacity": 1}),
        ("Changes of an old granulomatous infection in the left apex.", {"No Finding": N}),
        ("Findings may reflect an infectious process.", {"Pneumonia": -1}),
    ],
    "unmention_pleural_scar": [("Right apical pleural scarring.", {"Pleural Other": 1})],
    "lung_lesion_phrases": [
        ("Expansile lesion of the right posterior rib.", {}),
        ("Nodular opacity in the right midlung.", {"Lung Lesion": 1, "Lung Opacity": 1}),
        ("Cavitary lesion in the left apex.", {"Lung Lesion": 1}),
    ],
    "aspiration_not_pneumonia": [("Recurrent aspiration.", {"No Finding": N})],
    "blunting_not_effusion": [("Blunting of the left costophrenic angle.", {"No Finding": N})],
    "lung_opacity_phrases": [
        ("Apical scarring in both lungs.", {"Lung Opacity": 1}),
        ("Coarse interstitial markings at both bases.", {"Lung Opacity": 1}),
    ],
    "pleural_other_fibrosis": [("Mild pulmonary fibrosis.", {"Pleural Other": 1})],
    "history_of": [("History of pneumonia.", {"Pneumonia": 0})],
    "has_cleared": [("The left basilar atelectasis has cleared.", {"Atelectasis": 0})],
    "not_well_seen": [("The right lower lobe nodule is not well seen today.", {"Lung Lesion": -1})],
    "consideration": [("Atypical pneumonia is another consideration.", {"Pneumonia": -1})],
    "correlate_clinically_for": [("Correlate clinically for pneumonia.", {"Pneumonia": -1})],
    "suggestion_maybe_favoring": [
        ("There is a suggestion of a small left effusion.", {"Pleural Effusion": -1}),
        ("Maybe early pneumonia.", {"Pneumonia": -1}),
        ("Streaky opacity favoring atelectasis.", {"Lung Opacity": 1, "Atelectasis": -1}),
    ],
    "suspected_after": [("Tiny bilateral effusions suspected.", {"Pleural Effusion": -1})],
    "question_suspicion": [
        ("Question small left pleural effusion.", {"Pleural Effusion": -1}),
        ("Suspicion for a small right pneumothorax.", {"Pneumothorax": -1}),
    ],
    "suggesting": [("Patchy opacity suggesting pneumonia.", {"Lung Opacity": 1, "Pneumonia": -1})],
    "difficult_to_completely_exclude": [("It is difficult to completely exclude pneumonia.", {"Pneumonia": -1})],
    "vs_period_ends_no_clause": [("Cannot exclude atelectasis vs. pneumonia.", {"Atelectasis": -1, "Pneumonia": -1})],
    # the radiologists' gold reads a disjunction as both present; CheXpert (conj:versus) reads it uncertain
    "versus_is_not_a_hedge": [("Left basilar atelectasis versus pneumonia.", {"Atelectasis": 1, "Pneumonia": 1})],
}


@pytest.mark.parametrize(
    "rule,text,labels",
    [(r, t, l) for r, cases in RULES.items() for t, l in cases],
    ids=[f"{r}-{i}" for r, cases in RULES.items() for i in range(len(cases))],
)
def test_rule(rule, text, labels):
    test_real_style_sentences(text, labels)


def expected_vector(labels: dict) -> np.ndarray:
    v = np.full(14, np.nan)
    for name, value in labels.items():
        v[LABEL_INDEX[name]] = value
    return apply_no_finding_rule(v) if "No Finding" not in labels else v


def same(a, b):
    return bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))


@pytest.mark.parametrize("text,labels", REAL_STYLE, ids=[t[:40] for t, _ in REAL_STYLE])
def test_real_style_sentences(text, labels):
    got = RuleLabeler()([text])[0]
    want = expected_vector(labels)
    assert same(got, want), {
        n: (g, w) for n, g, w in zip(CHEXPERT_LABELS, got, want) if not same(np.array(g), np.array(w))
    }


def test_real_style_set_is_large_enough():
    assert len(REAL_STYLE) >= 40


def test_no_finding_rule_ignores_support_devices():
    labels = RuleLabeler()(
        [
            "Endotracheal tube in standard position. No pneumothorax.",
            "Endotracheal tube in standard position. Small pneumothorax.",
        ]
    )
    assert labels[0, LABEL_INDEX["No Finding"]] == 1
    assert np.isnan(labels[1, LABEL_INDEX["No Finding"]])


def test_uncertain_finding_blocks_no_finding():
    labels = RuleLabeler()(["Possible small left pleural effusion."])
    assert np.isnan(labels[0, LABEL_INDEX["No Finding"]])


def test_empty_report_is_all_blank():
    labels = RuleLabeler()(["", "   "])
    assert np.isnan(labels).all()


def test_labels_every_synthetic_report_exactly():
    rng = np.random.default_rng(123)
    reports, truth = [], []
    for _ in range(3000):
        findings, labels = sample_synthetic_study(rng)
        reports.append(write_synthetic_report(findings, labels, rng))
        truth.append(labels)
    got = RuleLabeler()(reports)
    truth = np.array(truth)
    wrong = [reports[i] for i in range(len(reports)) if not same(got[i], truth[i])]
    assert not wrong, wrong[:5]


GOLD_HEADER = [
    "id",
    "report",
    "Atelectasis",
    "Cardiomegaly",
    "Effusion",
    "Infiltration",
    "Mass",
    "Nodule",
    "Pneumonia",
    "Pneumothorax",
    "Consolidation",
    "Edema",
    "Emphysema",
    "Fibrosis",
    "Pleural_Thickening",
    "Hernia",
    "normal",
]


def write_gold(path, rows):
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(
            [GOLD_HEADER]
            + [[f"CXR{i}", text] + [int(c in marked) for c in GOLD_HEADER[2:]] for i, (text, marked) in enumerate(rows)]
        )


def test_labels_command_against_a_gold_csv(tmp_path, capsys):
    write_gold(
        tmp_path / "gold.csv",
        [
            ("Mild cardiomegaly. Small left pleural effusion.", {"Cardiomegaly", "Effusion"}),
            ("Heart size is normal. Lungs are clear.", {"normal"}),
            ("Possible right lower lobe pneumonia. A 1 cm nodule in the left lung.", {"Nodule"}),  # uncertain: absent
            ("Left basilar atelectasis. No pneumothorax.", {"Atelectasis", "Pneumothorax"}),  # we miss Pneumothorax
            ("No acute disease. Thoracic spondylosis.", {"normal"}),  # we: an abnormal finding, not No Finding
            ("Stable mild edema.", set()),
        ],
    )  # we: Edema the gold does not mark
    out = reproduce.gold_agreement(tmp_path / "gold.csv", RuleLabeler())
    # by hand: TP Atelectasis, Cardiomegaly, Effusion, Lung Lesion (4); FP Edema (1); FN Pneumothorax (1)
    for name in ("Atelectasis", "Cardiomegaly", "Pleural Effusion", "Lung Lesion"):
        assert out[name] == {"precision": 1.0, "recall": 1.0, "f1": 1.0, "gold": 1, "ours": 1}
    assert out["Pneumothorax"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "gold": 1, "ours": 0}
    assert out["Edema"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "gold": 0, "ours": 1}
    assert out["Pneumonia"]["ours"] == out["Pneumonia"]["gold"] == 0
    assert out["micro_f1"] == pytest.approx(2 * 4 / (2 * 4 + 1 + 1))
    # No Finding against normal: TP report 1, FN report 4
    assert out["No Finding"] == pytest.approx({"precision": 1.0, "recall": 0.5, "f1": 2 / 3, "gold": 2, "ours": 1})
    assert (out["no_finding_rate"], out["normal_rate"], out["n"]) == pytest.approx((1 / 6, 2 / 6, 6))
    reproduce.main(["labels", "--gold", str(tmp_path / "gold.csv")])
    printed = capsys.readouterr().out
    assert "micro F1 over the 8 findings: 0.800" in printed and "No Finding on 16.7% of 6 reports" in printed
    assert [line.split()[1:] for line in printed.splitlines() if line.startswith("Edema")] == [
        ["0.000"] * 3 + ["0", "1"]
    ]


def test_labels_command_names_the_bad_column(tmp_path):
    write_gold(tmp_path / "gold.csv", [("No effusion.", set())])
    text = (tmp_path / "gold.csv").read_text()
    (tmp_path / "no_normal.csv").write_text(text.replace(",normal", ",Normal"))
    with pytest.raises(SystemExit, match=r"^error: .*no_normal.csv: no column 'normal'"):
        reproduce.main(["labels", "--gold", str(tmp_path / "no_normal.csv")])
    (tmp_path / "bad_value.csv").write_text(text.replace("No effusion.,0", "No effusion.,yes"))
    with pytest.raises(SystemExit, match=r"^error: .*bad_value.csv:2: column 'Atelectasis' is 'yes', not 0 or 1$"):
        reproduce.main(["labels", "--gold", str(tmp_path / "bad_value.csv")])
    with pytest.raises(SystemExit, match=r"^error: gold CSV not found: .*missing.csv$"):
        reproduce.main(["labels", "--gold", str(tmp_path / "missing.csv")])


@pytest.mark.slow
def test_speed_at_least_2000_reports_per_second():
    import torch

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    reports = []
    for _ in range(5000):
        f, l = sample_synthetic_study(rng)
        reports.append(write_synthetic_report(f, l, rng))
    reports += [t for t, _ in REAL_STYLE] * 20
    labeler = RuleLabeler()
    start = time.process_time()  # CPU time of this process: other jobs on the machine do not count
    labeler(reports)
    rate = len(reports) / (time.process_time() - start)
    print(f"\nRuleLabeler: {rate:.0f} reports/s on one core, CPU time ({len(reports)} reports)")
    assert rate >= 2000
