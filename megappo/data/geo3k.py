"""Geometry3K -> train.parquet / test.parquet in verl's multimodal schema (as verl's examples/data_preprocess/geo3k.py).

Inputs, either layout (the validation split is not converted, as in verl):

- Hugging Face dataset `hiyouga/geometry3k`: DIR/data/train-*.parquet and DIR/data/test-*.parquet (or those files
  directly in DIR), with columns `images` (a list of {bytes, path}), `problem` (starting with "<image>") and `answer`
  (the text of the right choice);
- the original release of Inter-GPS (lupantech/InterGPS, data/geometry3k): DIR/train/<id>/ and DIR/test/<id>/ with
  `data.json` ({"annotat_text", "problem_text", "choices", "answer": "A".."D", ...}) and `img_diagram.png`. It is
  read as hiyouga's conversion reads it: problem "<image>" + annotat_text, answer choices[answer letter].

Each row: data_source "hiyouga/geometry3k" (scored by `megappo.rewards.geo3k`), prompt [{role: user, content:
problem + " " + INSTRUCTION}], images [{bytes: the encoded image, path: None}], ability "math", reward_model
{style: rule, ground_truth: answer}, extra_info {split, index, answer, question}.
"""
from __future__ import annotations

import glob
import io
import json
import os
from dataclasses import dataclass

import pyarrow as pa

from megappo.data.schema import DataError, open_parquet, split_targets, write_splits_atomic

DATA_SOURCE = "hiyouga/geometry3k"
IMAGE_TOKEN = "<image>"
INSTRUCTION = (
    "You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
    "The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in \\boxed{}."
)
SPLITS = ("train", "test")
ROW_GROUP_SIZE = 64  # rows hold their images (~20 KB each in Geometry3K): a group stays around a megabyte
_CHOICE_INDEX = {"A": 0, "B": 1, "C": 2, "D": 3}
_HF_HINT = "use the Parquet files of the Hugging Face dataset hiyouga/geometry3k unchanged"

SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()), ("answer", pa.string()),
                              ("question", pa.string())])),
])


@dataclass
class Problem:
    problem: str  # the question with one "<image>" per image
    answer: str
    images: list[bytes]  # encoded images (PNG, JPEG, ...), in placeholder order
    source: str  # for error messages
    row: int | None = None


def _check_image(data: bytes, source: str, row: int | None) -> bytes:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            im.verify()  # reads the header and checksums, not the pixels: cheap for a whole dataset
    except Exception as e:  # PIL raises many types for a damaged file
        raise DataError(source, f"an image cannot be decoded ({type(e).__name__}: {e})", "replace the damaged "
                        "image with the published one", row=row,
                        column=None if row is None else "images") from e
    return data


def _with_placeholders(problem: str, n_images: int, source: str, row: int | None) -> str:
    """The problem with one "<image>" per image: prepended when it has none (as hiyouga's conversion does)."""
    found = problem.count(IMAGE_TOKEN)
    if found == 0:
        return IMAGE_TOKEN * n_images + problem
    if found != n_images:
        raise DataError(source, f"the problem has {found} '{IMAGE_TOKEN}' placeholders for {n_images} images",
                        f"give the problem one '{IMAGE_TOKEN}' per image, in order", row=row, column="problem")
    return problem


def _find_split(input_dir: str, split: str) -> tuple[str, list[str]]:
    """("parquet" | "folders", files or problem folders) of one split; DataError when it is in neither layout."""
    for sub in ("data", ""):
        shards = sorted(glob.glob(os.path.join(input_dir, sub, f"{split}-*.parquet")) +
                        glob.glob(os.path.join(input_dir, sub, f"{split}.parquet")))
        if shards:
            return "parquet", shards
    folder = os.path.join(input_dir, split)
    if os.path.isdir(folder):
        problems = [os.path.join(folder, d) for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d))]
        if not problems:
            raise DataError(folder, "no problem folders", "each problem needs a folder <id>/ with data.json and "
                            "img_diagram.png, as in Inter-GPS's data/geometry3k")
        # numeric ids in order (hiyouga's conversion took os.listdir's order, which no file system promises)
        return "folders", sorted(problems, key=lambda p: (not os.path.basename(p).isdigit(),
                                                          int(os.path.basename(p)) if os.path.basename(p).isdigit()
                                                          else 0, os.path.basename(p)))
    raise DataError(input_dir, f"no {split} split found (looked for data/{split}-*.parquet, {split}-*.parquet and "
                    f"{split}/<id>/data.json)", "point --input at a copy of the Hugging Face dataset "
                    "hiyouga/geometry3k or at Inter-GPS's data/geometry3k folder")


def _image_bytes(item, path: str, row: int) -> bytes:
    """One `images` entry ({bytes, path}) as bytes; a relative path is read from the Parquet file's folder."""
    if isinstance(item, dict) and item.get("bytes"):
        return _check_image(item["bytes"], path, row)
    file = item.get("path") if isinstance(item, dict) else None
    if file:
        full = file if os.path.isabs(file) else os.path.join(os.path.dirname(path), file)
        if os.path.isfile(full):
            with open(full, "rb") as f:
                return _check_image(f.read(), path, row)
        raise DataError(path, f"the image {file!r} has no bytes and the file does not exist", "download the "
                        "dataset with its images (the Parquet files of hiyouga/geometry3k embed them)", row=row,
                        column="images")
    raise DataError(path, "an image entry without bytes or path", _HF_HINT, row=row, column="images")


def _read_hf_parquet(paths: list[str]) -> list[Problem]:
    out = []
    for path in paths:
        pf = open_parquet(path)
        names = pf.schema_arrow.names
        for key in ("images", "problem", "answer"):
            if key not in names:
                raise DataError(path, f"missing column (columns: {', '.join(names)})", _HF_HINT, column=key)
        images_t = pf.schema_arrow.field("images").type
        if not (pa.types.is_list(images_t) or pa.types.is_large_list(images_t)):
            raise DataError(path, f"type {images_t}, expected a list of {{bytes, path}} images", _HF_HINT,
                            column="images")
        row = 0
        for batch in pf.iter_batches(columns=["images", "problem", "answer"], batch_size=ROW_GROUP_SIZE):
            for item in batch.to_pylist():
                if not isinstance(item["problem"], str) or item["answer"] is None:
                    raise DataError(path, "null problem or answer", "drop the row", row=row,
                                    column="problem" if not isinstance(item["problem"], str) else "answer")
                if not item["images"]:
                    raise DataError(path, "the problem has no image", "drop the row or give it its diagram",
                                    row=row, column="images")
                images = [_image_bytes(im, path, row) for im in item["images"]]
                problem = _with_placeholders(item["problem"], len(images), path, row)
                out.append(Problem(problem, str(item["answer"]).strip(), images, path, row))
                row += 1
    if not out:
        raise DataError(", ".join(paths), "no problems", _HF_HINT)
    return out


def _read_folder(folder: str) -> Problem:
    data_path, image_path = os.path.join(folder, "data.json"), os.path.join(folder, "img_diagram.png")
    fix = "use Inter-GPS's data/geometry3k unchanged: data.json with annotat_text, choices and answer 'A'..'D'"
    if not os.path.isfile(data_path) or not os.path.isfile(image_path):
        raise DataError(folder, "the problem folder lacks data.json or img_diagram.png", fix)
    try:
        with open(data_path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(data_path, f"not JSON ({e})", fix) from e
    text = (data.get("annotat_text") or data.get("problem_text")) if isinstance(data, dict) else None
    choices, letter = (data.get("choices"), data.get("answer")) if isinstance(data, dict) else (None, None)
    if not isinstance(text, str) or not isinstance(choices, list) or letter not in _CHOICE_INDEX or \
            _CHOICE_INDEX[letter] >= len(choices):
        raise DataError(data_path, "no problem text, choices list or answer letter within the choices", fix)
    with open(image_path, "rb") as f:
        image = _check_image(f.read(), image_path, None)
    return Problem(IMAGE_TOKEN + text, str(choices[_CHOICE_INDEX[letter]]).strip(), [image], data_path)


def to_rows(problems: list[Problem], split: str) -> list[dict]:
    """Problems -> rows of SCHEMA; `extra_info.index` is the problem's position in its split."""
    rows = []
    for index, p in enumerate(problems):
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": p.problem + " " + INSTRUCTION}],
            "images": [{"bytes": b, "path": None} for b in p.images],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": p.answer},
            "extra_info": {"split": split, "index": index, "answer": p.answer, "question": p.problem},
        })
    return rows


def convert(input_dir: str, out_dir: str, force: bool = False) -> dict[str, int]:
    """Write out_dir/train.parquet and out_dir/test.parquet; returns the row count of each split.

    Everything is read and checked first, then written whole (`schema.write_splits_atomic`), so a failure leaves
    no partial output. Existing outputs are replaced only with `force`.
    """
    input_dir, out_dir = os.path.expanduser(input_dir), os.path.abspath(os.path.expanduser(out_dir))
    if not os.path.isdir(input_dir):
        raise DataError(input_dir, "input directory not found", "pass --input DIR holding hiyouga/geometry3k's "
                        "data/*.parquet or Inter-GPS's train/ and test/ problem folders")
    split_targets(out_dir, SPLITS, force)
    tables = {}
    for split in SPLITS:
        kind, found = _find_split(input_dir, split)
        problems = _read_hf_parquet(found) if kind == "parquet" else [_read_folder(d) for d in found]
        tables[split] = pa.Table.from_pylist(to_rows(problems, split), schema=SCHEMA)
    write_splits_atomic(tables, out_dir, ROW_GROUP_SIZE)
    return {split: t.num_rows for split, t in tables.items()}
