"""Where text comes from (DataConfig.source):
  builtin              the Python standard library's own source files: real text, offline
  text:PATH[,PATH...]  text files or globs (UTF-8, refused otherwise)
  tfds:NAME[/CONFIG]   a TFDS dataset through tfds.data_source (ArrayRecord, no TensorFlow)
(`bin:PATH` token files are read in megajax/data/tokens.py.)
"""

from __future__ import annotations

import glob
import sysconfig
from pathlib import Path

from megajax.errors import UserError, first_line
from megajax.specs import DataSpec

BUILTIN_MAX_BYTES = 12_000_000


def builtin_text(max_bytes: int = BUILTIN_MAX_BYTES) -> str:
    """Python source of the standard library, in a fixed order (about 12 MB)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    if not parts:
        raise UserError(f"no Python source files found under {root} for the built-in corpus")
    return "\n".join(parts)


def text_files(spec: str) -> list[Path]:
    """The files a comma-separated list of paths and globs names (`**` spans directories). A
    path that exists is taken as it is: a file named `a,b.txt` or `run[1].txt` is not split at
    its comma or read as a pattern. A file named twice (a glob and a path, or a link to it) is
    read once: a second copy would be trained on twice and could land in the held-out tail."""
    files = []
    for item in [spec] if Path(spec).exists() else filter(None, spec.split(",")):
        pattern = any(c in item for c in "*?[") and not Path(item).exists()
        matches = sorted(glob.glob(item, recursive=True)) if pattern else [item]
        if not matches:
            raise UserError(f"no file matches '{item}'")
        for m in matches:
            p = Path(m)
            if not p.is_file():
                if not p.exists():
                    raise UserError(f"data file not found: {p}")
                raise UserError(
                    f"data file {p} is a directory: give its files (a glob such as {p}/*.txt)"
                    if p.is_dir()
                    else f"data file {p} is not a regular file"
                )
            files.append(p)
    return distinct(files)


def distinct(files: list[Path]) -> list[Path]:
    """`files` in order, each file once however it is spelt (its resolved path decides)."""
    seen, kept = set(), []
    for f in files:
        key = Path(f).resolve()
        if key not in seen:
            seen.add(key)
            kept.append(f)
    return kept


def read_utf8(path: Path) -> str:
    """A text file's content; not UTF-8 is refused with the file and the first bad byte's
    offset (decoding with replacement characters would train on garbage silently). A leading
    byte-order mark (Windows editors write one) marks the encoding and is not text: dropped."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise UserError(
            f"{path} is not UTF-8 text (byte {e.start}: {data[e.start : e.start + 1]!r})"
        ) from None


def read_text(spec: str) -> str:
    text = "\n".join(read_utf8(p) for p in text_files(spec))
    if not text.strip():
        raise UserError(f"data source text:{spec} is empty")
    return text


def _tfds_source(spec: str, split: str):
    try:
        import tensorflow_datasets as tfds
    except ImportError:
        raise UserError(
            "tfds: sources need tensorflow-datasets (pip install tensorflow-datasets array_record)"
        ) from None
    try:
        return tfds.data_source(spec, split=split)
    except Exception as e:
        raise UserError(f"cannot open tfds:{spec} split '{split}': {first_line(e)}") from None


def tfds_size(spec: str, split: str) -> int:
    return len(_tfds_source(spec, split))


def tfds_texts(spec: str, split: str, start: int = 0, stop: int | None = None) -> list[str]:
    """The text of records start..stop (default: all) of a TFDS split, read by index."""
    source = _tfds_source(spec, split)
    texts = []
    for i in range(start, len(source) if stop is None else min(stop, len(source))):
        record = source[i]
        value = (
            next((v for v in record.values() if isinstance(v, (str, bytes))), None)
            if isinstance(record, dict)
            else record
        )
        if value is None:
            raise UserError(f"tfds:{spec} has no text feature")
        texts.append(value.decode("utf-8", "replace") if isinstance(value, bytes) else value)
    return texts


def source_text(source: str | DataSpec) -> str:
    """The whole text of a builtin, text: or tfds: source (tfds records become paragraphs)."""
    spec = DataSpec.of(source)
    if spec.kind == "builtin":
        return builtin_text()
    if spec.kind == "text":
        return read_text(spec.arg)
    if spec.kind == "tfds":
        return "\n\n".join(tfds_texts(spec.arg, "train"))
    hint = (
        "; token files keep no sentence boundaries: BERT reads pairs:DIR, made by megajax-prepare "
        "--pairs"
        if spec.kind == "bin"
        else ""
    )
    raise UserError(
        f"data source '{source}' has no text (use builtin, text:PATH or tfds:NAME{hint})"
    )
