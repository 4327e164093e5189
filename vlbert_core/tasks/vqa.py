"""VQA v2: loaders of the official question/annotation JSON, answer normalisation, the answer
vocabulary, soft scores and the official accuracy.

Answer normalisation follows the official evaluation script (GT-Vision-Lab/VQA,
`vqa/vqaEval.py`) to the letter, quirks included:
- punctuation in `PUNCT` is deleted when it touches a space or when the text has a digit,digit
  comma anywhere, and replaced by a space otherwise;
- a period is deleted unless a digit follows it ("2.5" stays; "dog." -> "dog"); the official
  regex `(?!<=\\d)(\\.)(?!\\d)` and its `re.UNICODE` passed as *count* (= at most 32 periods) are
  kept as they are;
- then words are lower-cased, number words zero..ten (and "none") become digits, articles
  a/an/the are dropped and contractions written without apostrophe get it back ("dont" ->
  "don't").
In the official accuracy the prediction always gets both steps, while the ten human answers get
only the punctuation step, and only when they are not all identical (the published annotations
are already normalised). `vqa_accuracy` reproduces exactly that. Training targets and the answer
vocabulary use the full normalisation on the human answers, as the BUTD answer preprocessing
that the released VL-BERT code relies on does.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from vlbert_core.utils import get_logger

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
PERIOD_STRIP = re.compile(r"(?!<=\d)(\.)(?!\d)")
COMMA_STRIP = re.compile(r"(\d)(,)(\d)")
# The official script calls PERIOD_STRIP.sub("", text, re.UNICODE): the flag lands in `count`.
_OFFICIAL_PERIOD_COUNT = int(re.UNICODE)


def process_punctuation(text: str) -> str:
    """The official `processPunctuation`."""
    out = text
    has_digit_comma = COMMA_STRIP.search(text) is not None
    for p in PUNCT:
        if (p + " " in text or " " + p in text) or has_digit_comma:
            out = out.replace(p, "")
        else:
            out = out.replace(p, " ")
    return PERIOD_STRIP.sub("", out, count=_OFFICIAL_PERIOD_COUNT)


def process_digit_article(text: str) -> str:
    """The official `processDigitArticle`."""
    words = [NUMBER_WORDS.get(w, w) for w in text.lower().split()]
    words = [w for w in words if w not in ARTICLES]
    return " ".join(CONTRACTIONS.get(w, w) for w in words)


def _clean_whitespace(text: str) -> str:
    return text.replace("\n", " ").replace("\t", " ").strip()


def normalize_answer(text: str) -> str:
    """Full normalisation the official script applies to a predicted answer."""
    return process_digit_article(process_punctuation(_clean_whitespace(text)))


def _leave_one_out(answer: str, human_answers: list[str]) -> float:
    """Mean over the leave-one-out subsets of min(1, matches / 3)."""
    if not human_answers:
        raise ValueError("VQA accuracy needs at least one human answer")
    total_matches = sum(1 for h in human_answers if h == answer)
    score = 0.0
    for h in human_answers:
        matches_without_h = total_matches - (1 if h == answer else 0)
        score += min(1.0, matches_without_h / 3.0)
    return score / len(human_answers)


def vqa_soft_score(answer: str, human_answers: list[str]) -> float:
    """Soft target of one (normalised) answer given the (normalised) human answers.

    With 10 humans this is 0, 0.3, 0.6, 0.9, 1.0 for 0, 1, 2, 3, >=4 matches.
    """
    return _leave_one_out(answer, human_answers)


def vqa_accuracy(prediction: str, human_answers: list[str]) -> float:
    """Official VQA accuracy (0..1) of one predicted answer string, exactly as `vqaEval.py`."""
    predicted = normalize_answer(prediction)
    humans = [_clean_whitespace(h) for h in human_answers]
    if len(set(humans)) > 1:
        humans = [process_punctuation(h) for h in humans]
    return _leave_one_out(predicted, humans)


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
            answers = [str(x["answer"]) for x in a["answers"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"VQA annotations file {annotations_path} annotation #{i}: "
                             f"bad or missing field ({exc!r})") from exc
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
    missing = [q.question_id for q in items if q.question_id not in annotated]
    if missing:
        raise ValueError(f"VQA annotations file {annotations_path} lacks {len(missing)} questions "
                         f"of {questions_path}, e.g. question_id {missing[:5]}")
    log.info("loaded %d VQA questions from %s", len(items), questions_path)
    return items


def build_answer_vocab(questions: list[VqaQuestion], num_answers: int) -> list[str]:
    """The `num_answers` most frequent normalised `multiple_choice_answer`s (ties alphabetical).

    Counting the consensus answer per question is how the BUTD vocabulary (3,129 answers on
    real data) was built.
    """
    counts: Counter[str] = Counter()
    for q in questions:
        if q.answers is None:
            raise ValueError(f"question {q.question_id} has no annotation; the answer vocabulary "
                             "needs annotated (training) questions")
        mca = q.multiple_choice_answer or Counter(q.answers).most_common(1)[0][0]
        answer = normalize_answer(mca)
        if answer:
            counts[answer] += 1
    vocab = [a for a, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:num_answers]]
    if not vocab:
        raise ValueError("no answers to build the VQA answer vocabulary from")
    log.info("VQA answer vocabulary: %d answers (asked for %d; %d distinct in train)",
             len(vocab), num_answers, len(counts))
    return vocab


def soft_targets(question: VqaQuestion, answer_index: dict[str, int]) -> dict[int, float]:
    """{vocabulary index: soft score} for the answers of one question that are in the vocabulary."""
    if question.answers is None:
        raise ValueError(f"question {question.question_id} has no annotation")
    humans = [normalize_answer(a) for a in question.answers]
    targets: dict[int, float] = {}
    for answer in set(humans):
        if answer in answer_index:
            targets[answer_index[answer]] = vqa_soft_score(answer, humans)
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
