"""megajax-prepare: text files, jsonl or a TFDS dataset -> a tokenized corpus directory that
train.py reads with `--data bin:DIR` (megajax/data/prepared.py describes the directory).

Units of work (megajax/prepare/units.py) are tokenized by a pool of processes, each result
written atomically to DIR/.partial/; an interrupted run started again with the same sources and
settings keeps the finished units and does the rest; a finished one (meta.json present) is
not redone. The splits are assembled from the units in order, and meta.json is written last.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
from tqdm import tqdm

from megajax.data import prepared as P
from megajax.data.sentences import Specials
from megajax.data.tokenizer import Tokenizer, fixed_tokenizer, load_tokenizer
from megajax.errors import UserError
from megajax.files import WorkdirLock, is_temporary, naming, write_atomic
from megajax.prepare import pairs
from megajax.prepare.pool import WorkerPool
from megajax.prepare.units import Unit, describe_source, expand_inputs, plan_units, tokenize_unit

PARTIAL = ".partial"


@dataclasses.dataclass
class Settings:
    tokenizer: str
    val_fraction: float = 0.01
    text_field: str = "text"
    # > 0: BERT sentence pairs for this model.seq_len (megajax/prepare/pairs.py)
    pairs_seq_len: int = 0
    seed: int = 0  # pairs: the train.seed whose draws shape them, as in memory


def _separator(tok: Tokenizer) -> list[int]:
    """The end-of-document token, or (a tokenizer without one: bytes, chars) a blank line."""
    return [tok.eos_id] if tok.eos_id is not None else tok.encode("\n\n")


def _plan_record(
    sources: list[dict], settings: Settings, tok: Tokenizer, units: list[Unit]
) -> dict:
    return {
        "sources": sources,
        "settings": dataclasses.asdict(settings),
        "tokenizer": P.tokenizer_fingerprint(tok),
        "units": [dataclasses.asdict(u) for u in units],
    }


def _start_or_resume(out: Path, record: dict) -> Path:
    """DIR/.partial for this plan: new, or the same plan's interrupted one. Anything else in
    DIR is refused, never overwritten."""
    partial = out / PARTIAL
    plan_file = partial / "plan.json"
    if plan_file.is_file():
        try:
            same = json.loads(plan_file.read_text()) == record
        except (OSError, ValueError):  # unreadable, not UTF-8, not JSON: not this plan
            same = False
        if not same:
            raise UserError(
                f"{out} holds an unfinished preparation of other sources or settings (or a damaged "
                f"{plan_file.name}): finish it with its own command, or remove {partial}"
            )
        return partial
    if out.exists() and any(p.name != PARTIAL for p in out.iterdir()):
        raise UserError(
            f"{out} already exists and is not empty: choose a new --out (megajax does not "
            "overwrite it)"
        )
    (partial / "units").mkdir(parents=True, exist_ok=True)
    write_atomic(plan_file, json.dumps(record) + "\n")
    return partial


# --- the workers --------------------------------------------------------------------------------
_WORKER: dict = {}


def _init_worker(tokenizer_dir: str, separator: list[int], text_field: str, dtype: str):
    # one thread per process: the pool is the parallelism
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.update(
        tok=load_tokenizer(Path(tokenizer_dir)),
        separator=separator,
        text_field=text_field,
        dtype=dtype,
    )


def _run_unit(job: tuple[int, dict, str]) -> tuple[int, int, int]:
    """Tokenize unit i into units/i.npy (atomically); (i, tokens, documents)."""
    i, unit, units_dir = job
    ids, docs = tokenize_unit(
        Unit(**unit),
        _WORKER["tok"],
        _WORKER["separator"],
        _WORKER["text_field"],
        np.dtype(_WORKER["dtype"]),
    )
    write_atomic(Path(units_dir) / f"{i}.docs", str(docs))
    # the unit counts as done once this exists
    write_atomic(Path(units_dir) / f"{i}.npy", _npy_bytes(np.save, ids))
    return i, len(ids), docs


def _readable(unit: Path, docs: Path | None = None) -> bool:
    """Whether a finished unit reads back: its files are written atomically, so one that does
    not was damaged since, and is simply tokenized again."""
    try:
        loaded = np.load(unit, mmap_mode="r")  # .npy: mapped; .npz: its zip directory read
        if isinstance(loaded, np.lib.npyio.NpzFile):
            loaded.close()
        elif loaded.ndim != 1:
            return False
        return docs is None or docs.read_text().strip().isdigit()
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):
        return False


def _npy_bytes(save, *args, **arrays) -> bytes:
    """What np.save / np.savez would write, for write_atomic: numpy writing to a file itself
    reports a full disk as an OSError without its errno ("N requested and M written"), and
    leaves the partial file behind. Bytes, not a view of the buffer: a failed write's traceback
    keeps its payload until the interpreter collects it at exit, and a view still exported
    from a BytesIO collected first is an error Python prints then ("BufferError: Existing
    exports of data")."""
    buffer = io.BytesIO()
    save(buffer, *args, **arrays)
    return buffer.getvalue()


def _run_pairs_unit(job: tuple[int, list, str]) -> int:
    k, docs, units_dir = job
    arrays = pairs.tokenize_documents(docs, _WORKER["tok"], np.dtype(_WORKER["dtype"]))
    write_atomic(Path(units_dir) / f"{k}.npz", _npy_bytes(np.savez, **arrays))
    return int(arrays["lengths"].size)


def _tokenize_pairs_units(
    partial: Path, sources: list[dict], settings: Settings, dtype: str, workers: int, say
) -> list[Path]:
    """Tokenize the sentence units, a few per worker at a time (the corpus is never held whole)."""
    units_dir = partial / "units"
    done = {int(f.stem) for f in units_dir.glob("*.npz") if f.stem.isdigit() and _readable(f)}
    if done:
        say(f"resuming: {len(done)} units already tokenized")
    init = (str(partial), [], settings.text_field, dtype)
    bar = tqdm(unit=" sentences", unit_scale=True, disable=not sys.stderr.isatty())
    pool = WorkerPool(workers, _init_worker, init) if workers > 1 else None
    if pool is None:
        _init_worker(*init)
    batch, total = [], 0
    try:
        for k, docs in pairs.units(sources, settings.text_field):
            total = k + 1
            if k not in done:
                batch.append((k, docs, str(units_dir)))
            if len(batch) >= 2 * workers:
                bar.update(
                    sum(pool.map(_run_pairs_unit, batch) if pool else map(_run_pairs_unit, batch))
                )
                batch = []
        if batch:
            bar.update(
                sum(pool.map(_run_pairs_unit, batch) if pool else map(_run_pairs_unit, batch))
            )
    finally:
        if pool is not None:
            pool.close()
        bar.close()
    return [units_dir / f"{k}.npz" for k in range(total)]


def _tokenize_all(
    partial: Path, units: list[Unit], separator, settings: Settings, dtype: str, workers: int, say
) -> None:
    units_dir = partial / "units"
    todo = [
        (i, dataclasses.asdict(u), str(units_dir))
        for i, u in enumerate(units)
        if not _readable(units_dir / f"{i}.npy", units_dir / f"{i}.docs")
    ]
    if len(todo) < len(units):
        say(f"resuming: {len(units) - len(todo)} of {len(units)} units already tokenized")
    sizes = {i: u.stop - u.start for i, u in enumerate(units)}
    bar = tqdm(
        total=sum(sizes[i] for i, *_ in todo),
        unit="B",
        unit_scale=True,
        disable=not sys.stderr.isatty(),
    )
    # the tokenizer was saved in partial
    init = (str(partial), separator, settings.text_field, dtype)
    if workers <= 1 or len(todo) <= 1:
        _init_worker(*init)
        for job in todo:
            _run_unit(job)
            bar.update(sizes[job[0]])
    else:
        with WorkerPool(min(workers, len(todo)), _init_worker, init) as pool:
            for i, _, _ in pool.imap_unordered(_run_unit, todo):
                bar.update(sizes[i])
    bar.close()


def _assemble(partial: Path, n_units: int, val_fraction: float) -> dict:
    """train.bin and val.bin from the units in order. The held-out part is the tail, about
    val_fraction of the tokens: cut at the unit boundary ending a document nearest to
    (1 - val_fraction) of them, or inside the tokens when none is near (a few large documents)."""
    units_dir = partial / "units"
    load = lambda i: np.load(units_dir / f"{i}.npy", mmap_mode="r")  # noqa: E731
    lengths = [int(load(i).shape[0]) for i in range(n_units)]
    docs = [int((units_dir / f"{i}.docs").read_text()) for i in range(n_units)]
    total = sum(lengths)
    if total == 0:
        raise UserError("the inputs hold no text (every document is empty): nothing to prepare")
    ends = np.cumsum(lengths)
    train_tokens = P.held_out_cut(
        [ends[i] for i in range(n_units - 1) if docs[i]], total, val_fraction
    )
    counts = {"train": [0, 0], "val": [0, 0]}
    paths = {name: partial / P.SPLIT_FILES[name] for name in counts}
    with open(paths["train"], "wb") as train, open(paths["val"], "wb") as val:
        written = 0
        for i in range(n_units):
            ids = load(i)
            k = min(len(ids), max(0, train_tokens - written))
            _append(train, paths["train"], ids[:k])
            _append(val, paths["val"], ids[k:])
            counts["train"][0] += k
            counts["val"][0] += len(ids) - k
            counts["val" if k < len(ids) else "train"][1] += docs[i]
            written += len(ids)
        for f, path in ((train, paths["train"]), (val, paths["val"])):
            with naming(path):
                os.fsync(f.fileno())
    splits = {
        name: {"file": P.SPLIT_FILES[name], "tokens": c[0], "documents": c[1]}
        for name, c in counts.items()
    }
    # No document ends near the goal (a corpus of one or a few long documents): the cut is inside
    # one.
    splits["val"]["starts_inside_a_document"] = bool(
        0 < train_tokens < total and train_tokens not in set(ends.tolist())
    )
    return splits


def _append(f, path: Path, ids: np.ndarray):
    """Write and flush at once, so that a failure (a full disk, `ulimit -f`) names its file."""
    with naming(path):
        f.write(np.ascontiguousarray(ids).tobytes())
        f.flush()


def _fixed_tokenizer(spec: str) -> Tokenizer:
    """--tokenizer: a spec, or a workdir (its tokenizer). One made from the corpus (chars,
    wordpiece[:SIZE]) is refused: the corpus is read in parts, by several processes."""
    if Path(spec).is_dir():
        return load_tokenizer(Path(spec))
    return fixed_tokenizer(
        None,
        spec,
        f"--tokenizer {spec} is made from the corpus, which megajax-prepare reads in parts: give a "
        "fixed one (bytes, hf:PATH, tiktoken:NAME, wordpiece:PATH/vocab.txt) or a workdir whose "
        "tokenizer to use",
    )


def prepare(
    inputs: list[str], out, settings: Settings, workers: int | None = None, say=print
) -> dict:
    """Prepare (or finish preparing) `inputs` into the directory `out`; returns its meta.json."""
    out = Path(out)
    if not 0.0 <= settings.val_fraction < 1.0:
        raise UserError(f"--val-fraction must be in [0, 1), got {settings.val_fraction}")
    sources = [describe_source(s, kind) for s, kind in expand_inputs(inputs)]
    tok = _fixed_tokenizer(settings.tokenizer)
    if settings.pairs_seq_len:
        if settings.pairs_seq_len < 8:
            raise UserError(
                f"--seq-len must be at least 8 for sentence pairs, got {settings.pairs_seq_len}"
            )
        # [CLS], [SEP], [MASK], [PAD]: refused now, not after tokenizing
        Specials.of(tok)
    with WorkdirLock(
        out,
        busy=f"another megajax process holds {out} (a megajax-prepare writing it, or a run "
        "training there); wait for it to finish, or choose another --out",
        what="the corpus directory",
    ):
        return _prepare_locked(out, sources, tok, settings, workers, say)


def _prepare_locked(
    out: Path, sources: list[dict], tok: Tokenizer, settings: Settings, workers, say
) -> dict:
    fmt = P.PAIRS_FORMAT if settings.pairs_seq_len else P.FORMAT
    units = [] if settings.pairs_seq_len else plan_units(sources)
    record = _plan_record(sources, settings, tok, units)
    if P.is_prepared(out):
        meta = P.read_meta(out, fmt)
        if (
            meta.get("plan") == record["sources"]
            and meta["tokenizer"]["fingerprint"] == record["tokenizer"]
            and meta.get("settings") == record["settings"]
        ):
            say(f"{out} is already prepared from these sources: nothing to do")
            return meta
        raise UserError(
            f"{out} already holds a prepared corpus of other sources or settings: choose a new "
            "--out"
        )
    partial = _start_or_resume(out, record)
    # the workers load it from here, and it ships with DIR
    tok.save(partial)
    dtype = P.token_dtype(tok.vocab_size)
    t0, workers = time.perf_counter(), workers or os.cpu_count() or 1
    meta = {
        "format": fmt,
        "version": P.VERSION,
        "dtype": dtype,
        "tokenizer": {
            "kind": tok.kind,
            "spec": settings.tokenizer,
            "fingerprint": P.tokenizer_fingerprint(tok),
        },
        "plan": sources,
        "settings": dataclasses.asdict(settings),
    }
    try:
        if settings.pairs_seq_len:
            files = _tokenize_pairs_units(partial, sources, settings, dtype, workers, say)
            counts = pairs.write_pairs(files, partial, settings.pairs_seq_len, settings.seed, dtype)
            meta.update(
                counts,
                seq_len=settings.pairs_seq_len,
                val_pairs=int(counts["pairs"] * settings.val_fraction),
            )
        else:
            _tokenize_all(partial, units, _separator(tok), settings, dtype, workers, say)
            meta.update(
                separator=_separator(tok),
                splits=_assemble(partial, len(units), settings.val_fraction),
            )
    # bad input (not UTF-8, a broken jsonl line): this plan can never finish
    except UserError:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    meta["seconds"] = round(time.perf_counter() - t0, 3)
    return publish(partial, out, meta)


def publish(partial: Path, out: Path, meta: dict) -> dict:
    """The finished files (the splits, the tokenizer) moved up from DIR/.partial, then
    meta.json, which makes DIR a prepared corpus. (Not a temporary file a killed run was
    writing: removed with the rest.)"""
    for f in partial.iterdir():
        if f.is_file() and f.name != "plan.json" and not is_temporary(f):
            os.replace(f, out / f.name)
    write_atomic(out / P.META, json.dumps(meta, indent=1) + "\n")
    shutil.rmtree(partial, ignore_errors=True)
    return meta
