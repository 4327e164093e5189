"""VQA v2: loaders of the official question/annotation JSON, the official accuracy, the answer
vocabulary and the soft training targets.

The accuracy follows the official evaluation code (GT-Vision-Lab/VQA,
`PythonEvaluationTools/vqaEvaluation/vqaEval.py`, `VQAEval.evaluate`, newest revision) rule for
rule; docs/metrics.md lists each rule and where the official code has it:
- the prediction and the ten human answers lose "\\n"/"\\t" (-> space) and outer whitespace;
- only when those ten cleaned answers are not all the same are the prediction and the humans
  normalised (`process_punctuation`, then `process_digit_article`); a unanimous question compares
  the cleaned prediction with the cleaned answer as written ("Yes" or "yes." do not match "yes");
- for each human, min(1, matches among the other nine / 3); the question scores their mean;
- the overall number is 100 * sum / count rounded to 2 digits as Python 2 rounds (halves away
  from zero), summed in the order of the annotations file.
The official code is Python 2 on `unicode` text; where Python 3 would act differently the
helpers below keep Python 2's behaviour: `\\d` in its regular expressions is ASCII only, the period
regex's `re.UNICODE` lands in `count` (at most 32 periods go), `lower()` maps one code point at a
time, U+180E is whitespace. (Not kept: the case mappings Unicode added after 5.2, e.g. Cherokee.)

Every answer the model can write (the vocabulary) is a normalised answer that normalisation leaves
unchanged, and a question's training target for it is its official accuracy (`soft_targets`).
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Context, Decimal
from pathlib import Path
from typing import Sequence

from vlbert_core.utils import get_logger

from .base import (
    NO_TEST_LABELS,
    Baseline,
    PaperTable,
    TableColumn,
    Task,
    TaskHeads,
    TaskLoss,
    check_prediction_ids,
    check_text_fits,
    model_side,
    query_text,
    split_path,
)

log = get_logger(__name__)

CONTRACTIONS = {
    "aint": "ain't", "arent": "aren't", "cant": "can't", "couldve": "could've",
    "couldnt": "couldn't", "couldn'tve": "couldn't've", "couldnt've": "couldn't've",
    "didnt": "didn't", "doesnt": "doesn't", "dont": "don't", "hadnt": "hadn't",
    "hadnt've": "hadn't've", "hadn'tve": "hadn't've", "hasnt": "hasn't", "havent": "haven't",
    "hed": "he'd", "hed've": "he'd've", "he'dve": "he'd've", "hes": "he's", "howd": "how'd",
    "howll": "how'll", "hows": "how's", "Id've": "I'd've", "I'dve": "I'd've", "Im": "I'm",
    "Ive": "I've", "isnt": "isn't", "itd": "it'd", "itd've": "it'd've", "it'dve": "it'd've",
    "itll": "it'll", "let's": "let's", "maam": "ma'am", "mightnt": "mightn't",
    "mightnt've": "mightn't've", "mightn'tve": "mightn't've", "mightve": "might've",
    "mustnt": "mustn't", "mustve": "must've", "neednt": "needn't", "notve": "not've",
    "oclock": "o'clock", "oughtnt": "oughtn't", "ow's'at": "'ow's'at", "'ows'at": "'ow's'at",
    "'ow'sat": "'ow's'at", "shant": "shan't", "shed've": "she'd've", "she'dve": "she'd've",
    "she's": "she's", "shouldve": "should've", "shouldnt": "shouldn't",
    "shouldnt've": "shouldn't've", "shouldn'tve": "shouldn't've", "somebody'd": "somebodyd",
    "somebodyd've": "somebody'd've", "somebody'dve": "somebody'd've",
    "somebodyll": "somebody'll", "somebodys": "somebody's", "someoned": "someone'd",
    "someoned've": "someone'd've", "someone'dve": "someone'd've", "someonell": "someone'll",
    "someones": "someone's", "somethingd": "something'd", "somethingd've": "something'd've",
    "something'dve": "something'd've", "somethingll": "something'll", "thats": "that's",
    "thered": "there'd", "thered've": "there'd've", "there'dve": "there'd've",
    "therere": "there're", "theres": "there's", "theyd": "they'd", "theyd've": "they'd've",
    "they'dve": "they'd've", "theyll": "they'll", "theyre": "they're", "theyve": "they've",
    "twas": "'twas", "wasnt": "wasn't", "wed've": "we'd've", "we'dve": "we'd've",
    "weve": "we've", "werent": "weren't", "whatll": "what'll", "whatre": "what're",
    "whats": "what's", "whatve": "what've", "whens": "when's", "whered": "where'd",
    "wheres": "where's", "whereve": "where've", "whod": "who'd", "whod've": "who'd've",
    "who'dve": "who'd've", "wholl": "who'll", "whos": "who's", "whove": "who've",
    "whyll": "why'll", "whyre": "why're", "whys": "why's", "wont": "won't",
    "wouldve": "would've", "wouldnt": "wouldn't", "wouldnt've": "wouldn't've",
    "wouldn'tve": "wouldn't've", "yall": "y'all", "yall'll": "y'all'll", "y'allll": "y'all'll",
    "yall'd've": "y'all'd've", "y'alld've": "y'all'd've", "y'all'dve": "y'all'd've",
    "youd": "you'd", "youd've": "you'd've", "you'dve": "you'd've", "youll": "you'll",
    "youre": "you're", "youve": "you've",
}
NUMBER_WORDS = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4",
                "five": "5", "six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10"}
ARTICLES = ("a", "an", "the")
PUNCT = (";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@",
         "`", ",", "?", "!")
# The official patterns, typo'd lookbehind `(?!<=\d)` included (it never matches, so any period
# not followed by a digit goes). Python 2 compiled them without re.UNICODE, so \d is 0-9 only.
PERIOD_STRIP = re.compile(r"(?!<=\d)(\.)(?!\d)", re.ASCII)
COMMA_STRIP = re.compile(r"(\d)(,)(\d)", re.ASCII)
# The official code calls periodStrip.sub("", text, re.UNICODE): the flag lands in `count`.
_OFFICIAL_PERIOD_COUNT = int(re.UNICODE)
OFFICIAL_DIGITS = 2  # VQAEval(n=2): the overall accuracy is reported rounded to 2 digits


def process_punctuation(text: str) -> str:
    """The official `processPunctuation`.

    Each mark in `PUNCT` is deleted when it touches a space in the input or when the input has a
    digit,digit comma anywhere; otherwise it becomes a space. Then periods not followed by a digit
    are deleted (at most 32, see `_OFFICIAL_PERIOD_COUNT`). Apostrophes and colons stay.
    """
    out = text
    has_digit_comma = COMMA_STRIP.search(text) is not None
    for p in PUNCT:
        if (p + " " in text or " " + p in text) or has_digit_comma:
            out = out.replace(p, "")
        else:
            out = out.replace(p, " ")
    return PERIOD_STRIP.sub("", out, count=_OFFICIAL_PERIOD_COUNT)


def _python2_lower(text: str) -> str:
    """`unicode.lower()` of Python 2: each code point on its own (simple case mapping).

    Python 3 adds the final-sigma rule and lowers U+0130 to two code points; this does neither.
    """
    if text.isascii():
        return text.lower()
    return "".join("i" if c == "\u0130" else c.lower() for c in text)


# Python 2.7's Unicode 5.2 tables count U+180E (Mongolian vowel separator) as whitespace; later
# ones do not. It is the only whitespace difference, so strip() and split() add it back.
_PYTHON2_ONLY_SPACE = "\u180e"
_PYTHON2_WHITESPACE = "".join(c for c in map(chr, range(0x3001)) if c.isspace()) + _PYTHON2_ONLY_SPACE


def _python2_strip(text: str) -> str:
    return text.strip(_PYTHON2_WHITESPACE) if _PYTHON2_ONLY_SPACE in text else text.strip()


def _python2_split(text: str) -> list[str]:
    return text.replace(_PYTHON2_ONLY_SPACE, " ").split()


def process_digit_article(text: str) -> str:
    """The official `processDigitArticle`: lower-case, split on whitespace, number words zero..ten
    (and "none") to digits, drop a/an/the, restore contractions ("dont" -> "don't")."""
    words = [NUMBER_WORDS.get(w, w) for w in _python2_split(_python2_lower(text))]
    words = [w for w in words if w not in ARTICLES]
    return " ".join(CONTRACTIONS.get(w, w) for w in words)


def clean_whitespace(text: str) -> str:
    """The clean-up every answer gets: newlines and tabs become spaces, outer whitespace goes."""
    if not isinstance(text, str):
        raise TypeError(f"a VQA answer must be a string, got {type(text).__name__} {text!r}")
    return _python2_strip(text.replace("\n", " ").replace("\t", " "))


def normalize_answer(text: str) -> str:
    """Clean-up, punctuation and digit/article steps: what the official code compares on a
    question whose humans disagree."""
    return process_digit_article(process_punctuation(clean_whitespace(text)))


def _compared_humans(human_answers: Sequence[str]) -> tuple[bool, list[str]]:
    """(unanimous, the human answers as the official code compares them)."""
    if not human_answers:
        raise ValueError("VQA accuracy needs at least one human answer")
    humans = [clean_whitespace(h) for h in human_answers]
    unanimous = len(set(humans)) <= 1
    if not unanimous:
        humans = [process_digit_article(process_punctuation(h)) for h in humans]
    return unanimous, humans


def _compared_prediction(prediction: str, unanimous: bool) -> str:
    return clean_whitespace(prediction) if unanimous else normalize_answer(prediction)


def _leave_one_out(answer: str, humans: list[str]) -> float:
    """Mean over the humans of min(1, matches among the others / 3), added up in the official
    order (Python 2's left-to-right float sum)."""
    total_matches = sum(1 for h in humans if h == answer)
    total = 0.0
    for h in humans:
        total += min(1.0, (total_matches - (h == answer)) / 3)
    return total / len(humans)


def vqa_accuracy(prediction: str, human_answers: Sequence[str]) -> float:
    """Official accuracy (0..1) of one predicted answer given the ten human answers."""
    unanimous, humans = _compared_humans(human_answers)
    return _leave_one_out(_compared_prediction(prediction, unanimous), humans)


def round_half_away_from_zero(value: float, ndigits: int) -> float:
    """Python 2's `round(value, ndigits)`: the float's exact value rounded to `ndigits` decimals,
    halves away from zero (Python 3's `round` sends halves to even: 0.125 -> 0.12, not 0.13)."""
    exact = Decimal(value)
    rounded = exact.quantize(Decimal(1).scaleb(-ndigits), rounding=ROUND_HALF_UP,
                             context=Context(prec=max(28, exact.adjusted() + ndigits + 2)))
    return float(rounded)


def vqa_overall_accuracy(accuracies: Sequence[float], ndigits: int = OFFICIAL_DIGITS) -> float:
    """The official overall accuracy in percent from per-question accuracies (0..1) given in the
    order of the annotations file: round(100 * sum / count, ndigits), Python 2 style."""
    if not accuracies:
        raise ValueError("VQA overall accuracy needs at least one question")
    total = 0.0
    for accuracy in accuracies:  # a plain loop: Python >= 3.12's sum() compensates rounding
        total += accuracy
    return round_half_away_from_zero(100 * total / len(accuracies), ndigits)


def vqa_submission(rows: Sequence[dict], where: str) -> list[dict]:
    """The predictions in the official results format, `[{"question_id": int, "answer": str}]`."""
    submission = []
    for i, row in enumerate(rows):
        question_id, answer = row.get("question_id"), row.get("answer")
        if not isinstance(question_id, int) or isinstance(question_id, bool):
            raise ValueError(f"{where}: prediction #{i} has question_id {question_id!r}; the "
                             "official format needs an integer")
        if not isinstance(answer, str):
            raise ValueError(f"{where}: prediction #{i} (question_id {question_id}) has answer "
                             f"{answer!r}; the official format needs a string")
        submission.append({"question_id": question_id, "answer": answer})
    return submission


@dataclass
class VqaQuestion:
    question_id: int
    image_id: int
    question: str
    image_key: str  # file stem of the image, e.g. COCO_val2014_000000000042
    answers: list[str] | None = None  # the ten raw human answers; None for test splits
    multiple_choice_answer: str | None = None
    question_type: str | None = None
    answer_type: str | None = None
    # position of the question's annotation in the annotations file: the official overall
    # accuracy adds the questions up in that order
    annotation_index: int | None = None


def _read_json(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"VQA file {path} does not exist")
    try:
        with path.open() as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"VQA file {path} is not valid JSON: {exc}") from exc


def image_key(data_subtype: str, image_id: int) -> str:
    """COCO image file stem, e.g. COCO_train2014_000000000009."""
    return f"COCO_{data_subtype}_{int(image_id):012d}"


def _data_subtype(questions: dict, path: str | os.PathLike) -> str:
    subtype = questions.get("data_subtype")
    if not isinstance(subtype, str) or not subtype:
        raise ValueError(f"VQA questions file {path} lacks 'data_subtype' (e.g. 'train2014'), "
                         "which names its images")
    return subtype


def _check_answer_records(records: list, where: str) -> None:
    """Each human answer is a record with a string `answer`, and no two records are equal as the
    official code compares them.

    The official leave-one-out drops every record equal to the one left out (it compares whole
    records, answers cleaned or normalised as for scoring), so two such records would count as
    fewer than two humans. The released files give each record its own `answer_id`; files where
    records coincide are refused rather than scored differently.
    """
    for k, record in enumerate(records):
        if not isinstance(record, dict) or not isinstance(record.get("answer"), str):
            raise ValueError(f"{where}: answer #{k} is {record!r}; expected a record with a "
                             "string 'answer'")
    if not records:
        return
    _, compared = _compared_humans([r["answer"] for r in records])
    seen: dict[str, int] = {}
    for k, (record, answer) in enumerate(zip(records, compared)):
        key = json.dumps({**record, "answer": answer}, sort_keys=True)
        if key in seen:
            raise ValueError(f"{where}: answers #{seen[key]} and #{k} are the same record once "
                             f"compared ({key}); give each human record a distinct answer_id")
        seen[key] = k


def load_vqa(questions_path: str | os.PathLike,
             annotations_path: str | os.PathLike | None = None) -> list[VqaQuestion]:
    """Questions (and, when given, their annotations) in the order of the questions file.

    Every question must have exactly one annotation and every annotation a question, with the
    same image id; fields the pipeline does not use (info, license, answer_confidence, ...) are
    ignored.
    """
    qdata = _read_json(questions_path)
    subtype = _data_subtype(qdata, questions_path)
    if not isinstance(qdata.get("questions"), list):
        raise ValueError(f"VQA questions file {questions_path} has no 'questions' list")
    items: list[VqaQuestion] = []
    seen: set[int] = set()
    for i, q in enumerate(qdata["questions"]):
        try:
            qid, iid, text = int(q["question_id"]), int(q["image_id"]), str(q["question"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"VQA questions file {questions_path} question #{i}: "
                             f"bad or missing field ({exc!r}) in {q!r}") from exc
        if qid in seen:
            raise ValueError(f"VQA questions file {questions_path}: duplicate question_id {qid}")
        seen.add(qid)
        items.append(VqaQuestion(question_id=qid, image_id=iid, question=text,
                                 image_key=image_key(subtype, iid)))
    if annotations_path is None:
        return items

    adata = _read_json(annotations_path)
    if not isinstance(adata.get("annotations"), list):
        raise ValueError(f"VQA annotations file {annotations_path} has no 'annotations' list")
    by_id = {item.question_id: item for item in items}
    annotated: set[int] = set()
    for i, a in enumerate(adata["annotations"]):
        try:
            qid = int(a["question_id"])
            records = list(a["answers"])
            answers = [x["answer"] for x in records]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"VQA annotations file {annotations_path} annotation #{i}: "
                             f"bad or missing field ({exc!r})") from exc
        _check_answer_records(records, f"VQA annotations file {annotations_path} annotation #{i} "
                                       f"(question {qid})")
        item = by_id.get(qid)
        if item is None:
            raise ValueError(f"VQA annotations file {annotations_path} annotation #{i}: "
                             f"question_id {qid} is not in {questions_path}")
        if qid in annotated:
            raise ValueError(f"VQA annotations file {annotations_path}: question_id {qid} "
                             "is annotated twice")
        if int(a.get("image_id", item.image_id)) != item.image_id:
            raise ValueError(f"VQA annotations file {annotations_path} annotation #{i}: image_id "
                             f"{a.get('image_id')} differs from the question's {item.image_id}")
        if not answers:
            raise ValueError(f"VQA annotations file {annotations_path} annotation #{i} "
                             f"(question {qid}) has no answers")
        annotated.add(qid)
        item.answers = answers
        item.multiple_choice_answer = str(a.get("multiple_choice_answer", ""))
        item.question_type = a.get("question_type")
        item.answer_type = a.get("answer_type")
        item.annotation_index = i
    missing = [q.question_id for q in items if q.question_id not in annotated]
    if missing:
        raise ValueError(f"VQA annotations file {annotations_path} lacks {len(missing)} questions "
                         f"of {questions_path}, e.g. question_id {missing[:5]}")
    log.info("loaded %d VQA questions from %s", len(items), questions_path)
    return items


def build_answer_vocab(questions: list[VqaQuestion], num_answers: int) -> list[str]:
    """The `num_answers` most frequent normalised `multiple_choice_answer`s (ties alphabetical).

    Counting the consensus answer per question is how the BUTD vocabulary (3,129 answers on
    real data) was built. An entry is written verbatim as the predicted answer, so it must be
    one the official comparison treats as itself: free of outer whitespace (unanimous questions
    compare it as written) and unchanged by `normalize_answer` (disagreeing questions compare
    its normalised form). A normalised answer that normalisation would change again (e.g. more
    than 32 periods) is left out and counted in the log.
    """
    counts: Counter[str] = Counter()
    unstable = 0
    for q in questions:
        if q.answers is None:
            raise ValueError(f"question {q.question_id} has no annotation; the answer vocabulary "
                             "needs annotated (training) questions")
        mca = q.multiple_choice_answer or Counter(q.answers).most_common(1)[0][0]
        answer = normalize_answer(mca)
        if answer and normalize_answer(answer) != answer:
            unstable += 1
        elif answer:
            counts[answer] += 1
    vocab = [a for a, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:num_answers]]
    if not vocab:
        raise ValueError("no answers to build the VQA answer vocabulary from")
    log.info("VQA answer vocabulary: %d answers (asked for %d; %d distinct in train; %d consensus "
             "answers left out as not stable under normalisation)", len(vocab), num_answers,
             len(counts), unstable)
    return vocab


def soft_targets(question: VqaQuestion, answer_index: dict[str, int]) -> dict[int, float]:
    """{vocabulary index: official accuracy of writing that answer} where it is above 0.

    Only an entry equal to a human answer as the official code compares it (cleaned when the
    humans agree, normalised when they do not) can score, so those are the only ones tried; for
    the vocabulary of `build_answer_vocab` that is exact (tests/tasks/test_metrics.py checks it against
    every entry).
    """
    if question.answers is None:
        raise ValueError(f"question {question.question_id} has no annotation")
    unanimous, humans = _compared_humans(question.answers)
    targets: dict[int, float] = {}
    for answer in set(humans):
        if answer in answer_index:
            score = _leave_one_out(_compared_prediction(answer, unanimous), humans)
            if score > 0:
                targets[answer_index[answer]] = score
    return targets


def vqa_image_paths(questions_json: str | os.PathLike, images_dir: str | os.PathLike) -> dict[str, Path]:
    """{image file stem: image path} of every image the questions file refers to."""
    qdata = _read_json(questions_json)
    subtype = _data_subtype(qdata, questions_json)
    paths: dict[str, Path] = {}
    for i, q in enumerate(qdata.get("questions") or []):
        if "image_id" not in q:
            raise ValueError(f"VQA questions file {questions_json} question #{i} has no image_id")
        key = image_key(subtype, q["image_id"])
        paths[key] = Path(images_dir) / f"{key}.jpg"
    return paths


def question_words(question: str) -> list[str]:
    """A question's words as the official code cleans text: lower case, punctuation processed."""
    return process_punctuation(question.lower()).split()


def held_out_concept_questions(held_out: Sequence[VqaQuestion], train: Sequence[VqaQuestion]) -> list[VqaQuestion]:
    """The held-out questions with a word that no training question has: what fine-tuning never asked about,
    so only what the model brought to it (pre-training) can answer it. In the embedded world these are the
    questions naming `world.vqa_held_out_categories`; in real data, the rare words of the split."""
    seen = {word for q in train for word in question_words(q.question)}
    return [q for q in held_out if not seen.issuperset(question_words(q.question))]


def score_vqa(rows: list[dict], questions: list[VqaQuestion], where: str) -> tuple[float, list[dict]]:
    """Official VQA accuracy (percent, rounded as the official code reports it) of `questions` (loaded with
    their annotations) and the predictions in the official results format, unchanged from the bundle's order,
    each with its question's accuracy (0..1, `accuracy`, a key the official loader ignores) for the paired test."""
    submission = vqa_submission(rows, where)
    check_prediction_ids([r["question_id"] for r in submission], [q.question_id for q in questions],
                         "question_id", where)
    answers = {r["question_id"]: r["answer"] for r in submission}
    in_official_order = sorted(questions, key=lambda q: q.annotation_index)
    accuracies = {q.question_id: vqa_accuracy(answers[q.question_id], q.answers) for q in in_official_order}
    scored = [{**r, "accuracy": accuracies[r["question_id"]]} for r in submission]
    return vqa_overall_accuracy(list(accuracies.values())), scored


# VQA's val split stands in for test-dev: test-dev's answers are held by the evaluation server
VQA_HELD_OUT = "val (held out; stands in for test-dev)"
# the questions of the held-out split with a word no training question has (held_out_concept_questions); not a
# column of the paper's
HELD_OUT_CONCEPTS = "vqa_held_out_concepts"
HELD_OUT_CONCEPTS_SPLIT = f"{VQA_HELD_OUT}, the questions with a word no train question has"
VQA_TABLE = PaperTable(
    "table2_vqa",
    "Table 2: VQA v2 accuracy (%)",
    (
        TableColumn("test_dev", "test-dev", "vqa", "val", split_label=VQA_HELD_OUT),
        TableColumn("test_std", "test-std", None, None, NO_TEST_LABELS),
        TableColumn("held_out_concepts", "held-out concepts", HELD_OUT_CONCEPTS, "val",
                    split_label=HELD_OUT_CONCEPTS_SPLIT),
    ),
    decimals=2,
)


class VqaTask(Task):
    """VQA v2: <Question, [MASK], Image> with detected RoIs -> one of `num_answers` answers.

    Prediction rows are the official submission format `{"question_id", "answer"}`; VQA's val
    stands in for test-dev.
    """

    name = "vqa"
    dataset = "vqa"
    metric = "vqa_accuracy"
    roi_dataset = "vqa"
    required_hparams = ("num_answers",)
    owned_modules = ("tasks/vqa.py", "tasks/modeling/vqa.py")
    paper_table = VQA_TABLE
    eval_tasks = ("vqa", HELD_OUT_CONCEPTS)
    ablation_columns = (TableColumn("vqa_test_dev", "VQA test-dev", "vqa", "val", split_label=VQA_HELD_OUT),
                        TableColumn("vqa_held_out_concepts", "VQA held-out concepts", HELD_OUT_CONCEPTS, "val",
                                    split_label=HELD_OUT_CONCEPTS_SPLIT))
    example_key = ("question_id",)
    outcome_field = "accuracy"  # soft: 0, 1/3, ..., 1 (min(#humans that said it / 3, 1), averaged)
    paired_test = "bootstrap"

    def prepare(self, meta, hparams, sources):
        train_questions = load_vqa(split_path(sources["questions"], self.train_split),
                                   split_path(sources["annotations"], self.train_split))
        meta["answers"] = build_answer_vocab(train_questions, int(hparams["num_answers"]))

    def build_data(self, split, meta, *, sources, tokens, images, max_rois, max_text_len, rois,
                   rois_source, eval_task=None, max_examples=None):
        VqaData = model_side("modeling.vqa", "VqaData")

        questions = self.questions(split, sources, eval_task)
        questions = questions[:max_examples] if max_examples else questions
        images_dir = Path(split_path(sources["images"], split))
        return VqaData([(q, images_dir / f"{q.image_key}.jpg") for q in questions], rois or {},
                       rois_source, tokens, meta.get("answers"), max_rois=max_rois,
                       max_text_len=max_text_len, images=images)

    def questions(self, split, sources, eval_task=None) -> list[VqaQuestion]:
        """The split's questions (with their annotations); of eval task `vqa_held_out_concepts`, those with a word
        no training question has."""
        questions = load_vqa(split_path(sources["questions"], split), split_path(sources["annotations"], split))
        if eval_task != HELD_OUT_CONCEPTS:
            return questions
        train = load_vqa(split_path(sources["questions"], self.train_split))
        subset = held_out_concept_questions(questions, train)
        if not subset:
            raise ValueError(f"{HELD_OUT_CONCEPTS} {split}: no question of {split_path(sources['questions'], split)} "
                             f"has a word that the {self.train_split} questions lack, so the column has no examples")
        return subset

    def roi_image_paths(self, split, sources):
        return vqa_image_paths(split_path(sources["questions"], split), split_path(sources["images"], split))

    def build_heads(self, spec, meta):
        VQAHead = model_side("modeling.vqa", "VQAHead")
        answer_width = model_side("modeling.common", "answer_width")

        return TaskHeads(VQAHead(answer_width(spec), len(meta["answers"]), meta["mask_id"], spec.dropout,
                                 spec.layer_norm_eps, layout=spec.layout, hidden_act=spec.hidden_act,
                                 readout=spec.answer_readout))

    def loss(self, model, out, extras, meta):
        loss = model.head.loss(out["logits"], extras["target"])
        best = out["logits"].argmax(dim=1)
        score = extras["target"].gather(1, best[:, None]).mean()
        return TaskLoss(loss, {"vqa_score": score.item()})

    def prediction_rows(self, model, data, indices, out, extras, meta, eval_task):
        rows = []
        best = out["logits"].argmax(dim=1).tolist()
        for i, answer_index in zip(indices, best):
            question, _ = data.questions[i]
            rows.append({"question_id": question.question_id, "answer": meta["answers"][answer_index]})
        return rows

    def query_data(self, queries, meta, *, tokens, images, max_rois, max_text_len, rois, rois_source, workdir):
        VqaData = model_side("modeling.vqa", "VqaData")

        questions = []
        for i, query in enumerate(queries):
            text = query_text(query, i, "the question")
            check_text_fits(len(tokens.ids(text)), max_text_len - VqaData.SPECIAL_TOKENS, max_text_len,
                            f"query #{i}: the question")
            questions.append((VqaQuestion(question_id=i, image_id=i, question=text, image_key=query["image_key"]),
                              Path(query["image_path"])))
        return VqaData(questions, rois, rois_source, tokens, None, max_rois=max_rois,
                       max_text_len=max_text_len, images=images)

    def query_results(self, model, data, indices, out, extras, meta, top_k):
        import torch

        # ranked by logit as `prediction_rows` chooses; trained with BCE on soft scores, an answer's
        # sigmoid is the model's estimate of its accuracy
        logits = out["logits"]
        best = logits.argsort(dim=1, descending=True, stable=True)[:, : min(int(top_k), logits.shape[1])]
        scores = torch.sigmoid(logits.gather(1, best))
        return [{"answers": [{"answer": meta["answers"][j], "score": round(float(v), 6)}
                             for v, j in zip(row_scores.tolist(), row_best.tolist())]}
                for row_scores, row_best in zip(scores, best)]

    def score(self, eval_task, split, rows, sources, where):
        return score_vqa(rows, self.questions(split, sources, eval_task), where)

    def baseline(self, eval_task, split, sources, *, rois=(), max_rois=None):
        train = load_vqa(split_path(sources["questions"], self.train_split),
                         split_path(sources["annotations"], self.train_split))
        (answer,) = build_answer_vocab(train, 1)
        held_out = sorted(self.questions(split, sources, eval_task), key=lambda q: q.annotation_index)
        value = vqa_overall_accuracy([vqa_accuracy(answer, q.answers) for q in held_out])
        return Baseline(value, f"majority: always {answer!r}, the most frequent {self.train_split} answer")
