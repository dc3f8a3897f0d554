"""megajax-prepare --chat: JSONL conversations -> a directory train.py reads with
`--data chat:DIR`, each conversation rendered with the tokenizer's chat template and tokenized
once (megajax/data/chat.py), with its loss mask.

The same machinery as a token corpus (corpus.py): the files cut into units at line starts,
tokenized by a pool of processes into DIR/.partial/, an interrupted preparation resumed with
the units it finished, meta.json written last. The held-out split is the last --val-fraction
of the conversations. Packing into rows happens when a run reads it (it depends on
model.seq_len). Files, all memory-mapped (data/prepared.py reads them):

    DIR/{train,val}.ids.npy      every conversation's token ids, one after another
    DIR/{train,val}.mask.npy     int8: 1 where the loss may predict the token
    DIR/{train,val}.lengths.npy  int32: each conversation's length
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from megajax.data import prepared as P
from megajax.data.chat import encode_conversation, parse_line, template_for
from megajax.data.tokenizer import load_tokenizer
from megajax.errors import UserError
from megajax.files import WorkdirLock, text_lines, write_atomic
from megajax.prepare.corpus import (
    _fixed_tokenizer,
    _npy_bytes,
    _readable,
    _start_or_resume,
    publish,
)
from megajax.prepare.pool import WorkerPool
from megajax.prepare.units import describe_source, expand_inputs, plan_units

FIELDS = ("ids", "mask", "lengths")
_WORKER: dict = {}


def _init_worker(tokenizer_dir: str, loss_on: str, dtype: str):
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = load_tokenizer(Path(tokenizer_dir))
    _WORKER.update(tok=tok, template=template_for(tok), loss_on=loss_on, dtype=dtype)


def _run_unit(job: tuple) -> tuple[int, int]:
    """Unit i's conversations into units/i.npz (atomically); (i, conversations)."""
    i, unit, first_line, units_dir = job
    with open(unit["source"], "rb") as f:
        f.seek(unit["start"])
        data = f.read(unit["stop"] - unit["start"])
    try:
        text = data.decode("utf-8-sig" if unit["start"] == 0 else "utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"{unit['source']} is not UTF-8 text (byte {unit['start'] + e.start})"
        ) from None
    ids, masks = [], []
    for n, line in enumerate(text_lines(text), first_line):
        if line.strip():
            conversation = parse_line(line, f"{unit['source']}:{n}")
            a, m = encode_conversation(
                conversation, _WORKER["template"], _WORKER["tok"], _WORKER["loss_on"]
            )
            ids.append(a)
            masks.append(m)
    arrays = {
        "ids": np.concatenate(ids or [np.zeros(0, np.int32)]).astype(_WORKER["dtype"]),
        "mask": np.concatenate(masks or [np.zeros(0, np.int8)]),
        "lengths": np.asarray([len(a) for a in ids], np.int32),
    }
    write_atomic(Path(units_dir) / f"{i}.npz", _npy_bytes(np.savez, **arrays))
    return i, len(ids)


def _first_lines(units) -> list[int]:
    """The line number each unit starts at (its file's lines counted once)."""
    out, counted = [], {}
    for u in units:
        if u.start == 0:
            counted[u.source] = (0, 1)
        at, line = counted[u.source]
        with open(u.source, "rb") as f:
            f.seek(at)
            line += f.read(u.start - at).count(b"\n")
        counted[u.source] = (u.start, line)
        out.append(line)
    return out


def prepare_chat(
    inputs: list[str],
    out,
    tokenizer: str,
    val_fraction: float,
    loss_on: str = "assistant",
    workers: int | None = None,
    say=print,
) -> dict:
    out = Path(out)
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    sources = [describe_source(s, kind) for s, kind in expand_inputs(inputs)]
    if bad := [s["source"] for s in sources if s["kind"] != "jsonl"]:
        raise UserError(f"--chat reads .jsonl files of conversations, got {bad[0]}")
    tok = _fixed_tokenizer(tokenizer)
    settings = {"tokenizer": tokenizer, "val_fraction": val_fraction, "chat_loss": loss_on}
    units = plan_units(sources)
    record = {
        "sources": sources,
        "settings": settings,
        "tokenizer": P.tokenizer_fingerprint(tok),
        "units": [dataclasses.asdict(u) for u in units],
    }
    with WorkdirLock(
        out,
        busy=f"another megajax process holds {out}; wait for it to finish, or choose another --out",
        what="the corpus directory",
    ):
        if P.is_prepared(out):
            meta = P.read_meta(out, P.CHAT_FORMAT)
            if meta.get("plan") == sources and meta.get("settings") == settings:
                say(f"{out} is already prepared from these conversations: nothing to do")
                return meta
            raise UserError(
                f"{out} already holds a prepared corpus of other sources or settings: choose a new "
                "--out"
            )
        partial = _start_or_resume(out, record)
        tok.save(partial)  # with its chat template: the workers render with it
        dtype = P.token_dtype(tok.vocab_size)
        t0 = time.perf_counter()
        try:
            _tokenize(partial, units, loss_on, dtype, workers or os.cpu_count() or 1, say)
            splits = _assemble(partial, len(units), val_fraction)
        except UserError:  # bad input: this plan can never finish
            shutil.rmtree(partial, ignore_errors=True)
            raise
        meta = {
            "format": P.CHAT_FORMAT,
            "version": P.VERSION,
            "dtype": dtype,
            "tokenizer": {
                "kind": tok.kind,
                "spec": tokenizer,
                "fingerprint": P.tokenizer_fingerprint(tok),
            },
            "plan": sources,
            "settings": settings,
            "splits": splits,
            "seconds": round(time.perf_counter() - t0, 3),
        }
        return publish(partial, out, meta)


def _tokenize(partial: Path, units, loss_on: str, dtype: str, workers: int, say):
    units_dir = partial / "units"
    todo = [
        (i, dataclasses.asdict(u), line, str(units_dir))
        for i, (u, line) in enumerate(zip(units, _first_lines(units)))
        if not _readable(units_dir / f"{i}.npz")
    ]
    if len(todo) < len(units):
        say(f"resuming: {len(units) - len(todo)} of {len(units)} units already tokenized")
    init = (str(partial), loss_on, dtype)
    bar = tqdm(total=len(todo), unit=" units", disable=not sys.stderr.isatty())
    if workers <= 1 or len(todo) <= 1:
        _init_worker(*init)
        for job in todo:
            _run_unit(job)
            bar.update()
    else:
        with WorkerPool(min(workers, len(todo)), _init_worker, init) as pool:
            for _ in pool.imap_unordered(_run_unit, todo):
                bar.update()
    bar.close()


def _assemble(partial: Path, n_units: int, val_fraction: float) -> dict:
    """The units' conversations in order, the last val_fraction of them held out."""
    loaded = [np.load(partial / "units" / f"{i}.npz") for i in range(n_units)]
    parts = {k: np.concatenate([u[k] for u in loaded]) for k in FIELDS}
    n = len(parts["lengths"])
    if n == 0:
        raise UserError("the inputs hold no conversation: nothing to prepare")
    n_train = n - int(n * val_fraction)
    cut = int(parts["lengths"][:n_train].sum())
    splits = {}
    for name, (rows, tokens) in {
        "train": (slice(0, n_train), slice(0, cut)),
        "val": (slice(n_train, n), slice(cut, None)),
    }.items():
        for k in FIELDS:
            array = parts[k][rows if k == "lengths" else tokens]
            write_atomic(partial / f"{name}.{k}.npy", _npy_bytes(np.save, array))
        splits[name] = {
            "conversations": len(parts["lengths"][rows]),
            "tokens": int(parts["lengths"][rows].sum()),
        }
    return splits
