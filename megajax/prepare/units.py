"""A preparation's plan: the sources, cut into units of work that processes tokenize
independently, and the tokenizing of one unit.

Documents: a text file is one document; a jsonl line (its text field) is one; a TFDS record
is one. A large text or jsonl file is cut into units of about UNIT_BYTES at line starts, so
that its parts tokenize in parallel; the end-of-document token follows each document's last
token. The plan is a pure function of the sources (names, sizes, checksums) and the settings,
so an interrupted preparation can tell whether its finished units still apply.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np

from megajax.data.sources import distinct, text_files, tfds_size, tfds_texts
from megajax.errors import UserError
from megajax.files import text_lines
from megajax.specs import DataSpec

UNIT_BYTES = 4 << 20
TFDS_UNIT_RECORDS = 20_000


@dataclasses.dataclass(frozen=True)
class Unit:
    source: str  # a file path, or tfds:NAME[:SPLIT]
    kind: str  # text | jsonl | tfds
    start: int  # byte offset (files) or record index (tfds)
    stop: int
    ends_document: bool  # text: the unit holds its file's end


def expand_inputs(inputs: list[str]) -> list[tuple[str, str]]:
    """(source, kind) for each file a path or glob names (in sorted order), and tfds: names;
    each once, however often the inputs name it."""
    found = []
    for item in inputs:
        if item.startswith("tfds:"):
            found.append((item, "tfds"))
        else:
            found += [
                (str(f), "jsonl" if f.suffix in (".jsonl", ".json") else "text")
                for f in text_files(item)
            ]
    # each file once, under the first spelling that named it
    files = set(map(str, distinct([Path(s) for s, kind in found if kind != "tfds"])))
    found = [(s, kind) for s, kind in dict.fromkeys(found) if kind == "tfds" or s in files]
    if not found:
        raise UserError("no input given")
    return found


def tfds_split(source: str) -> tuple[str, str]:
    """tfds:NAME[/CONFIG][:SPLIT] -> (NAME[/CONFIG], SPLIT), the split train by default."""
    return DataSpec("tfds", source.removeprefix("tfds:")).tfds_split()


def describe_source(source: str, kind: str) -> dict:
    """What identifies a source's content: size and SHA-256 of a file; name and length of a TFDS
    split."""
    if kind == "tfds":
        return {"source": source, "kind": kind}
    digest, size = hashlib.sha256(), 0
    with open(source, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
            size += len(block)
    return {
        "source": str(Path(source).resolve()),
        "kind": kind,
        "bytes": size,
        "sha256": digest.hexdigest(),
    }


def _line_cuts(path: str, size: int) -> list[int]:
    """Offsets near every UNIT_BYTES where a line starts (0 and size included)."""
    cuts = [0]
    with open(path, "rb") as f:
        while cuts[-1] + UNIT_BYTES < size:
            f.seek(cuts[-1] + UNIT_BYTES)
            f.readline()
            if f.tell() >= size:
                break
            cuts.append(f.tell())
    return cuts + [size]


def plan_units(sources: list[dict]) -> list[Unit]:
    units = []
    for s in sources:
        if s["kind"] == "tfds":
            n = tfds_size(*tfds_split(s["source"]))
            units += [
                Unit(s["source"], "tfds", i, min(n, i + TFDS_UNIT_RECORDS), True)
                for i in range(0, n, TFDS_UNIT_RECORDS)
            ]
            continue
        cuts = _line_cuts(s["source"], s["bytes"])
        units += [
            Unit(s["source"], s["kind"], a, b, b == s["bytes"]) for a, b in zip(cuts, cuts[1:])
        ]
    return units


def _unit_texts(unit: Unit, text_field: str) -> list[str]:
    """The documents (or, for a text file's inner units, the part of one) a unit holds."""
    if unit.kind == "tfds":
        return tfds_texts(*tfds_split(unit.source), unit.start, unit.stop)
    with open(unit.source, "rb") as f:
        f.seek(unit.start)
        data = f.read(unit.stop - unit.start)
    try:  # a file's leading byte-order mark is no text (sources.read_utf8)
        text = data.decode("utf-8-sig" if unit.start == 0 else "utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{unit.source} is not UTF-8 text (byte {unit.start + e.start})") from None
    if unit.kind == "text":
        return [text]
    docs = []
    for n, line in enumerate(text_lines(text)):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            docs.append(record[text_field])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(
                f"{unit.source}: a line near byte {unit.start} (line {n + 1} of its part) is not a "
                f"JSON object with a '{text_field}' field (--text-field)"
            ) from None
        if not isinstance(docs[-1], str):
            raise UserError(f"{unit.source}: field '{text_field}' is not a string")
    return docs


def tokenize_unit(
    unit: Unit, tokenizer, separator: list[int], text_field: str, dtype
) -> tuple[np.ndarray, int]:
    """(token ids, documents ended) of one unit: each document's ids, then the separator. An
    empty document (an empty file, a jsonl record's "") is no document: no lone separator."""
    texts = _unit_texts(unit, text_field)
    ends = unit.kind != "text" or unit.ends_document
    parts, documents = [], 0
    for ids in tokenizer.encode_batch(texts):
        if len(ids) == 0 and (unit.kind != "text" or unit.start == 0):
            continue
        parts.append(np.asarray(ids, dtype))
        if ends:
            parts.append(np.asarray(separator, dtype))
            documents += 1
    return (np.concatenate(parts) if parts else np.zeros(0, dtype)), documents
