"""MMLU in its original layout: reading the CSV files and building the standard k-shot prompt.

Data layout of the original release (Hendrycks et al., "Measuring Massive Multitask Language
Understanding", ICLR 2021): ``dev/{subject}_dev.csv`` (the few-shot exemplars) and
``test/{subject}_test.csv``, no header, columns question, A, B, C, D, answer letter. Cells are
kept verbatim as strings (as lm-evaluation-harness does; the release's pandas reader would turn
an all-numeric option column such as "0.10" into 0.1).

Prompt (the release's ``evaluate.py``, ``gen_prompt`` / ``format_example``)::

    The following are multiple choice questions (with answers) about {subject, "_" -> " "}.

    {question}
    A. {a}
    B. {b}
    C. {c}
    D. {d}
    Answer: {letter}

    ...  (k exemplars, each closed by a blank line)
    {test question}
    A. ...
    D. {d}
    Answer:
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

CHOICES = ("A", "B", "C", "D")

# The ten subjects of the seed paper's Tables 3 and 4 (the ones shipped in data/mmlu), in its
# column order, with its column labels.
PAPER_SUBJECTS = {
    "abstract_algebra": "AbsAlg",
    "anatomy": "Anatomy",
    "astronomy": "Astron",
    "business_ethics": "BusEth",
    "clinical_knowledge": "ClinKn",
    "college_biology": "ColBio",
    "college_chemistry": "ColChem",
    "college_computer_science": "ColCS",
    "college_mathematics": "ColMath",
    "college_medicine": "ColMed",
}

SHIPPED_DATA_DIR = Path(__file__).parent / "data" / "mmlu"


@dataclass(frozen=True)
class Question:
    """One MMLU item: ``choices`` are the four option texts, ``answer`` one of CHOICES."""

    subject: str
    text: str
    choices: tuple[str, str, str, str]
    answer: str


def subjects_in(data_dir: str | Path) -> list[str]:
    """The subjects that have a test file under ``data_dir/test``, sorted.

    Raises FileNotFoundError when ``data_dir/test`` is not a directory."""
    test_dir = Path(data_dir) / "test"
    if not test_dir.is_dir():
        raise FileNotFoundError(f"no MMLU test split at {test_dir} (expected the original layout "
                                "dev/{subject}_dev.csv, test/{subject}_test.csv)")
    return sorted(p.name[: -len("_test.csv")] for p in test_dir.glob("*_test.csv"))


def read_split(data_dir: str | Path, subject: str, split: str) -> list[Question]:
    """All questions of one subject's split ("dev" or "test"), in file order.

    Raises FileNotFoundError for a missing file and ValueError, naming file and line, for a row
    that does not have six cells or whose answer is not one of A-D."""
    path = Path(data_dir) / split / f"{subject}_{split}.csv"
    questions = []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        for row in reader:
            if len(row) != 6 or row[5].strip() not in CHOICES:
                raise ValueError(f"{path}:{reader.line_num}: expected question, A, B, C, D, answer "
                                 f"letter A-D; got {len(row)} cells {row[-1:]!r}")
            questions.append(Question(subject, row[0], tuple(row[1:5]), row[5].strip()))
    return questions


def format_question(question: Question, with_answer: bool) -> str:
    """The question, its lettered options and "Answer:" (+ " {letter}\\n\\n" for an exemplar)."""
    text = question.text + "".join(f"\n{letter}. {choice}"
                                   for letter, choice in zip(CHOICES, question.choices))
    text += "\nAnswer:"
    if with_answer:
        text += f" {question.answer}\n\n"
    return text


def prompt_header(subject: str) -> str:
    """The line that opens every prompt of ``subject``, with the blank line after it."""
    return ("The following are multiple choice questions (with answers) about "
            f"{subject.replace('_', ' ')}.\n\n")


def build_prompt(question: Question, exemplars: list[Question]) -> str:
    """The k-shot prompt for ``question`` with ``exemplars`` (k = len(exemplars), 0 allowed);
    it ends in "Answer:" so the next token is the predicted letter."""
    return prompt_header(question.subject) + "".join(format_question(e, True) for e in exemplars) \
        + format_question(question, False)
