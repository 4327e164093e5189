"""Ask a fine-tuned model: images and text in, the task's answers out (docs/predict.md).

`Predictor` loads a fine-tune directory (results/finetune/<task>/<setting>/<schedule>), and for
tasks that read detected RoIs the detector checkpoint with the `rois:` selection rule of the run.
Each query's image (a path or an http(s) URL, fetched with the CC downloader and its size cap)
goes through the same detection and RoI selection as rule extract_task_rois, and the query
through the same samples, model and head as the evaluation: the task builds its samples
(`Task.query_data`, the data class of `build_data`) and formats the answers (`Task.query_results`).
Nothing here names a task.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

from vlbert_core.utils import atomic_path, get_logger

log = get_logger(__name__)


class PredictError(ValueError):
    """A query, image or model directory the predictor cannot use; the message names it."""


def read_model_task(model_dir: str | os.PathLike) -> str:
    """The task name a fine-tune directory's config.json records, or an error naming what is missing."""
    model_dir = Path(model_dir)
    if not model_dir.exists():
        raise PredictError(f"model directory {model_dir} does not exist")
    if not model_dir.is_dir():
        raise PredictError(f"model directory {model_dir} is a file, not a directory: give the fine-tune directory "
                           f"(results/finetune/<task>/<setting>/<schedule>) that holds it")
    from vlbert_core.models.common.pretrained import CONFIG_FILE, MODEL_FILE  # torch-free: the same names

    config_path = model_dir / CONFIG_FILE
    if not config_path.is_file():
        raise PredictError(f"{model_dir} has no {CONFIG_FILE}: a fine-tuned model directory "
                           f"(results/finetune/<task>/<setting>/<schedule>) holds {MODEL_FILE} and {CONFIG_FILE}")
    try:
        payload = json.loads(config_path.read_text())
        return str(payload["task"]["name"])
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise PredictError(f"{config_path} is not a fine-tuned model's config (needs task.name): {err!r}") from None


def image_cap(config: Mapping[str, Any] | None, max_image_pixels: int | None = None) -> int:
    """The pixel cap of query images: `max_image_pixels` when given, else the config's top-level
    `max_image_pixels`, else vlbert_core.images.DEFAULT_MAX_PIXELS."""
    from vlbert_core.images import DEFAULT_MAX_PIXELS, MAX_PIXELS_KEY, checked_max_pixels

    if max_image_pixels is None:
        max_image_pixels = (config or {}).get(MAX_PIXELS_KEY, DEFAULT_MAX_PIXELS)
    return checked_max_pixels(max_image_pixels)


URL_SCHEMES = ("http", "https", "file")   # what an image may be besides a path (fetched with the downloader)
DRAW_FORMATS = {"": "PNG", ".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG"}   # --draw's file name suffix -> format


def url_scheme(source: str) -> str:
    """The URL scheme of an image source ("" for a path); an error for a scheme the predictor cannot fetch."""
    if "://" not in source:
        return ""
    scheme = source.split("://", 1)[0].lower()
    if scheme not in URL_SCHEMES:
        raise PredictError(f"image {source}: unsupported URL scheme {scheme!r}; an image is a path or an "
                           f"{'/'.join(URL_SCHEMES)} URL")
    return scheme


def draw_format(path: str | os.PathLike) -> str:
    """The image format a --draw path's suffix names (PNG without a suffix); an error for another suffix."""
    suffix = Path(path).suffix.lower()
    if suffix not in DRAW_FORMATS:
        raise PredictError(f"drawing {path}: unknown image suffix {suffix!r}; name it .png, .jpg or .jpeg")
    return DRAW_FORMATS[suffix]


def local_image_size(source: str, max_pixels: int) -> tuple[int, int]:
    """(width, height) of a query image file, upright (its EXIF orientation applied), from its header only: an
    error naming it when it is missing, a directory, over the pixel cap (ImageTooLarge) or no image."""
    from vlbert_core.images import ImageTooLarge, open_image, upright_size

    path = Path(source)
    if not path.exists():
        raise PredictError(f"image {source} does not exist")
    if path.is_dir():
        raise PredictError(f"image {source} is a directory, not an image file")
    try:
        with open_image(path, max_pixels=max_pixels, name=source) as image:
            return upright_size(image)
    except ImageTooLarge:
        raise  # the one error of the pixel cap, everywhere; it names the image and the config key
    except (ValueError, OSError) as err:
        raise PredictError(f"image {source} cannot be read as an image: {type(err).__name__}: {err}") from None


def check_boxes(query: Mapping[str, Any], index: int, size: tuple[int, int]) -> None:
    """The boxes a query gives (RefCOCO+ `boxes`, VCR `objects`), in the upright image's pixels, must lie in it:
    0 <= X1 < X2 <= width and 0 <= Y1 < Y2 <= height; else an error naming the box, the image and its size."""
    width, height = size
    boxes = [("box", box) for box in query.get("boxes") or ()]
    boxes += [(f"object {obj.get('name')!r} box", obj.get("box")) for obj in query.get("objects") or ()
              if isinstance(obj, Mapping)]
    for what, box in boxes:
        try:
            x1, y1, x2, y2 = (float(v) for v in box)
        except (TypeError, ValueError):
            raise PredictError(f"query #{index}: {what} {box!r}: expected four numbers X1,Y1,X2,Y2") from None
        if not (0 <= x1 < x2 <= width and 0 <= y1 < y2 <= height):
            given = ",".join(f"{v:g}" for v in (x1, y1, x2, y2))
            raise PredictError(f"query #{index}: {what} {given} is not inside image {query.get('image')} "
                               f"({width} x {height} pixels; a box is X1,Y1,X2,Y2 with 0 <= X1 < X2 <= {width} "
                               f"and 0 <= Y1 < Y2 <= {height}, in the pixels of the upright image)")


def check_query_images(queries: Sequence[Mapping[str, Any]], max_pixels: int) -> None:
    """Each query's image, before the model loads (the command line runs it): its URL scheme; a local file's
    existence, kind and header (pixel cap, image format; ImageTooLarge / PredictError naming it), and the boxes
    the query gives against its upright size. URLs are fetched by `Predictor.predict`."""
    sizes: dict[str, tuple[int, int]] = {}
    for index, query in enumerate(queries):
        source = query.get("image") if isinstance(query, Mapping) else None
        if not isinstance(source, str):
            continue   # Predictor.predict names the query
        if url_scheme(source):
            continue
        if source not in sizes:
            sizes[source] = local_image_size(source, max_pixels)
        check_boxes(query, index, sizes[source])


def check_image_sizes(images: Sequence[str], max_pixels: int) -> None:
    """The local images among `images`: existence, kind, the pixel cap and format from their headers
    (`check_query_images` of queries with these images)."""
    check_query_images([{"image": source} for source in images], max_pixels)


class Predictor:
    """A fine-tuned model (and the detector when its task reads detected RoIs), ready for queries.

    model_dir: a fine-tune directory; task: when given, the task (or dataset, e.g. "vcr") the
    model must have been fine-tuned on; detector: the detector checkpoint; config: the run's
    config, which registers its own tasks (`tasks.custom.<name>`) and gives `select` and
    `download` unless they are passed; select: its `rois:` section (score_threshold, min_boxes,
    max_boxes, nms_iou); download: the downloader settings for image URLs (its `cc.download`
    section, or the task's own: `Task.query_download`), named `download_key` in errors;
    max_image_pixels: the cap on a query image's width x height (default: the config's
    `max_image_pixels`, else vlbert_core.images.DEFAULT_MAX_PIXELS): a larger image raises
    `vlbert_core.images.ImageTooLarge` naming it, from its header, before it is decoded.
    """

    def __init__(self, model_dir: str | os.PathLike, *, task: str | None = None,
                 detector: str | os.PathLike | None = None, select: Mapping[str, Any] | None = None,
                 download: Mapping[str, Any] | None = None, download_key: str = "cc.download",
                 config: Mapping[str, Any] | None = None, device: str = "cpu",
                 max_image_pixels: int | None = None):
        from vlbert_core.tasks.registry import get_task, register_config_tasks, task_names

        self.max_image_pixels = image_cap(config, max_image_pixels)

        self.model_dir = Path(model_dir)
        name = read_model_task(self.model_dir)
        if config is not None:
            register_config_tasks(config)
        if name not in task_names():
            raise PredictError(f"{self.model_dir} holds a {name} model, a task that is not registered (known: "
                               f"{task_names()}); a task of your own (custom_<name>) is registered by the config "
                               f"that declares tasks.custom.<name>: pass it (--config)")
        self.task = get_task(name)
        if task is not None and task not in (self.task.name, self.task.dataset):
            raise PredictError(f"{self.model_dir} holds a {self.task.name} model (its config.json), not a "
                               f"{task} model")
        self.detector_path = None if detector is None else Path(detector)
        if config is not None:
            select = config.get("rois") if select is None else select
            if download is None:
                download_key, download = self.task.query_download(config)
        self.select = select
        self.download = download
        self.download_key = download_key
        self.device = device
        self._detector = None
        self._downloader = None

        from vlbert_core.models.common.bert_init import load_tokenizer
        from vlbert_core.models.common.config import visual_pixel_format
        from vlbert_core.tasks.finetune import load_finetuned
        from vlbert_core.tasks.samples import ImageLoader, Tokens

        self.model, self.meta = load_finetuned(self.model_dir)
        self.model.to(device)
        config = self.model.encoder.config
        self.tokens = Tokens(load_tokenizer(config.bert_path))
        self.images = ImageLoader.from_settings(self.meta, visual_pixel_format(config),
                                                max_pixels=self.max_image_pixels)

    # ---- images ----------------------------------------------------------------------------------

    def _fetch(self, url: str, workdir: Path, index: int) -> Path:
        if self.download is None:
            raise PredictError(f"image {url}: a URL needs the downloader settings ({self.download_key} of the config)")
        if self._downloader is None:
            from vlbert_core.data.cc import make_downloader

            self._downloader = make_downloader(self.download, self.download_key)
        result = self._downloader.fetch(url)
        if result.data is None:
            raise PredictError(f"image {url} cannot be fetched: {result.status}: {result.error}")
        path = workdir / f"image{index}"
        path.write_bytes(result.data)
        return path

    def _open_image(self, source: str, workdir: Path, index: int):
        """(local path, decoded [3, H, W] uint8 image) of an image path or URL."""
        from vlbert_core.detector.images import decode_image
        from vlbert_core.images import ImageTooLarge, check_resizable

        if url_scheme(source):
            path = self._fetch(source, workdir, index)
        else:
            path = Path(source)
            if path.is_dir():
                raise PredictError(f"image {source} is a directory, not an image file")
            if not path.is_file():
                raise PredictError(f"image {source} does not exist")
        try:
            image = decode_image(path, max_pixels=self.max_image_pixels, name=source)
        except ImageTooLarge:
            raise  # the one error of the pixel cap, everywhere; it names the image and the config key
        except Exception as err:  # noqa: BLE001 - whatever the decoder says, the file is not an image we can read
            raise PredictError(f"image {source} cannot be read as an image: {type(err).__name__}: {err}") from None
        check_resizable(source, int(image.shape[-1]), int(image.shape[-2]), int(self.meta["image_max_side"]),
                        f"the model ({self.model_dir}, image_max_side)")
        return path, image

    def _detector_model(self):
        if self._detector is None:
            if self.detector_path is None:
                raise PredictError(f"task {self.task.name} reads the detector's RoIs: give the detector "
                                   f"checkpoint (e.g. results/detector/model.pt)")
            if self.select is None:
                raise PredictError("the detector's RoI selection needs the config's rois: section")
            from vlbert_core.detector.train import load_detector

            self._detector, _ = load_detector(self.detector_path, map_location=self.device)
        return self._detector

    def _detect(self, image, source: str) -> Any:
        """The RoIs of one decoded image (`source`: its name), selected as rule extract_task_rois selects them."""
        from vlbert_core.detector.extract import detect_rois, selection_kwargs
        from vlbert_core.detector.images import to_unit_float
        from vlbert_core.rois import STATUS_OK, RoIRecord

        model = self._detector_model()
        from vlbert_core.images import check_resizable

        check_resizable(source, int(image.shape[-1]), int(image.shape[-2]), int(model.transform.max_size),
                        f"the detector ({self.detector_path}, max_size)")
        selected = detect_rois(model, [to_unit_float(image)], selection_kwargs(self.select))[0]
        num_classes = int(model.roi_heads.box_predictor.cls_score.out_features)
        return RoIRecord(key="", status=STATUS_OK, error="", image_w=int(image.shape[-1]),
                         image_h=int(image.shape[-2]), num_boxes=len(selected), num_classes=num_classes,
                         boxes=selected.boxes.numpy().astype("float32"),
                         scores=selected.scores.numpy().astype("float32"),
                         class_ids=selected.class_ids.numpy().astype("int32"),
                         class_scores=selected.class_scores.numpy().astype("float32"))

    # ---- queries ---------------------------------------------------------------------------------

    def queries_from_file(self, path: str | os.PathLike, *, key: str | None = None,
                          images_dir: str | os.PathLike | None = None) -> list[dict]:
        """Queries from a file in the task's dataset format (VCR: a jsonl of questions)."""
        return self.task.queries_from_file(path, key=key, images_dir=images_dir)

    def predict(self, queries: Sequence[Mapping[str, Any]], top_k: int = 5,
                draw: Sequence[str | os.PathLike] | None = None) -> list[dict]:
        """The model's answers, one dict per query: the query's `image` and `text`, and what the
        task answers (VQA: `answers`; RefCOCO+: `box`, `score`, `top`; VCR: `choice`, `ranking`).

        draw: one PNG path per query; each gets the query's image with the chosen `box` drawn
        (tasks whose answer is a box).
        """
        from vlbert_core.tasks.evaluate import predict_batches

        if not queries:
            raise PredictError("no queries to answer")
        if int(top_k) < 1:
            raise PredictError(f"top_k must be at least 1, got {top_k}")
        if draw is not None and len(draw) != len(queries):
            raise PredictError(f"{len(draw)} drawing paths for {len(queries)} queries")
        for out_path in draw or ():
            draw_format(out_path)
        with tempfile.TemporaryDirectory(prefix="vlbert-predict-") as scratch:
            workdir = Path(scratch)
            resolved, rois, opened = [], {}, {}
            for index, query in enumerate(queries):
                if not isinstance(query, Mapping) or not isinstance(query.get("image"), str):
                    raise PredictError(f"query #{index}: needs an image (a path or an http(s) URL), got {query!r}")
                source = query["image"]
                if source not in opened:
                    key = f"image{len(opened)}"
                    opened[source] = (key, *self._open_image(source, workdir, len(opened)))
                key, path, image = opened[source]
                check_boxes(query, index, (int(image.shape[-1]), int(image.shape[-2])))
                if self.task.query_needs_rois(query) and key not in rois:
                    rois[key] = self._detect(image, source)
                resolved.append({**query, "image_path": str(path.resolve()), "image_key": key,
                                 "image_w": int(image.shape[-1]), "image_h": int(image.shape[-2])})
            rois_source = f"detector {self.detector_path}"
            data = self.task.query_data(resolved, self.meta, tokens=self.tokens, images=self.images,
                                        max_rois=int(self.meta["max_rois"]),
                                        max_text_len=int(self.meta["max_text_len"]), rois=rois,
                                        rois_source=rois_source, workdir=workdir)
            answers: list[dict] = []
            for indices, out, extras in predict_batches(self.model, data, int(self.meta["batch_size"]),
                                                        self.device, f"predict {self.task.name}"):
                answers.extend(self.task.query_results(self.model, data, indices, out, extras, self.meta,
                                                       int(top_k)))
            check_finite(answers, f"model {self.model_dir}")
            for query, answer, out_path in zip(resolved, answers, draw or ()):
                if "box" not in answer:
                    raise PredictError(f"task {self.task.name} answers no box to draw")
                draw_box(query["image_path"], answer["box"], out_path, label=f"{answer.get('score', '')}",
                         max_pixels=self.max_image_pixels)
                answer["drawn"] = str(out_path)
        return [{"image": q["image"], "text": q.get("text"), **a} for q, a in zip(queries, answers)]


def check_finite(value: Any, who: str, where: str = "answer") -> None:
    """A non-finite number (NaN, inf) anywhere in an answer is an error naming `who` (the model) and where it is:
    strict JSON has no NaN, and a NaN score is no answer."""
    import math

    if isinstance(value, float) and not math.isfinite(value):
        raise PredictError(f"{who} gave a non-finite number ({value}) as {where}: its weights or inputs hold NaN or "
                           f"infinity; nothing was written")
    if isinstance(value, Mapping):
        for key, item in value.items():
            check_finite(item, who, f"{where} {key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            check_finite(item, who, f"{where}[{index}]" if where != "answer" else f"the answer of query #{index}")


def draw_box(image: str | os.PathLike, box: Sequence[float], out: str | os.PathLike, *,
             label: str | None = None, max_pixels: int | None = None) -> Path:
    """The image with the box (x1, y1, x2, y2 in its upright pixels) drawn on it, written atomically as the format
    `out`'s suffix names (.png or none: PNG; .jpg / .jpeg: JPEG; another suffix is an error); an image over
    `max_pixels` (default DEFAULT_MAX_PIXELS) raises ImageTooLarge before it is decoded."""
    from PIL import ImageDraw

    from vlbert_core.images import DEFAULT_MAX_PIXELS, load_rgb

    image_format = draw_format(out)

    canvas = load_rgb(image, max_pixels=DEFAULT_MAX_PIXELS if max_pixels is None else max_pixels)
    draw = ImageDraw.Draw(canvas)
    width = max(1, round(max(canvas.size) / 150))
    draw.rectangle([float(v) for v in box], outline=(255, 32, 32), width=width)
    if label:
        draw.text((float(box[0]) + width + 1, float(box[1]) + width), label, fill=(255, 32, 32))
    out = Path(out)
    with atomic_path(out) as tmp:
        canvas.save(tmp, format=image_format, **({"quality": 95} if image_format == "JPEG" else {}))
    return out
