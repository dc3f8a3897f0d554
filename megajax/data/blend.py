"""Weighted blends of token corpora: `--data "0.3 SPEC_A 0.7 SPEC_B"` (Megatron-LM's weight-then-
source order; the same string as data.source in a config file).

Sample n of the run (row r of step s: n = s * batch + r) comes from a component chosen so that
after any n samples each component has had its weight's share within one sample
(`BlendIndex`). Megatron's BlendedDataset takes the component furthest behind its weight, which
with three or more components can fall further behind than that (1.4 samples in a 4-way blend);
megajax takes Tijdeman's rule for the chairman assignment problem (1980), which keeps every
prefix within 1 - 1/(2k - 2) of the weights for k components. The k-th sample of a component is a
window of seq_len + 1 of its tokens, the windows taken in an order shuffled afresh each epoch
of the component (one epoch: every window of it once); a component that runs out starts its
next epoch, never an error. All of it is a pure function of (weights, sources, seed, step), so
every mesh and every resumed run sees the same batches, bitwise.

Validation sweeps each component's held-out split on its own: a loss per component
(`val/NAME/loss`) and the blend's, their mean under the weights.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np

from megajax.data.prepared import check_ids
from megajax.data.tokens import EvalWindows, TokenData, load_tokens
from megajax.errors import UserError
from megajax.specs import DataSpec, blend_number, is_blend

BLOCK = 1 << 16  # samples of the blend index computed at a time


@dataclasses.dataclass(frozen=True)
class Component:
    name: str
    weight: float  # normalised: the weights sum to 1
    source: str


def parse_blend(source: str) -> list[Component]:
    """The components of a blend, their weights normalised; a mistake in one line."""
    words = source.split()
    if len(words) % 2:
        raise UserError(
            f"data blend '{source}': give a weight before each source ('0.3 A 0.7 B'), got "
            f"{len(words)} words"
        )
    pairs = [(words[i], words[i + 1]) for i in range(0, len(words), 2)]
    for weight, spec in pairs:
        w = blend_number(weight)
        if w is None:
            raise UserError(f"data blend '{source}': '{weight}' before {spec} is not a weight")
        if not w > 0 or w == float("inf"):
            raise UserError(
                f"data blend '{source}': the weight of {spec} is {weight}; weights must be "
                "positive (leave a source out instead of giving it 0)"
            )
        if is_blend(spec) or DataSpec.of(spec).kind == "chat":
            raise UserError(
                f"data blend '{source}': {spec} cannot be blended (blends mix token corpora: "
                "text, builtin, tfds, bin and megatron sources)"
            )
    total = sum(float(w) for w, _ in pairs)
    names = _names([spec for _, spec in pairs])
    return [
        Component(name, float(w) / total, spec)
        for name, (w, spec) in zip(names, pairs, strict=True)
    ]


def _names(specs: list[str]) -> list[str]:
    """A short name per component, from its source (the file's or directory's stem), unique."""
    names = []
    for spec in specs:
        arg = DataSpec.of(spec).arg or DataSpec.of(spec).kind
        stem = re.split(r"[/\\]", arg.rstrip("/\\"))[-1].split(",")[0]
        stem = re.sub(r"\.(txt|bin|idx|json|jsonl)$", "", stem)
        base = re.sub(r"[^A-Za-z0-9_.-]+", "_", stem) or "data"
        name, n = base, 2
        while name in names:
            name, n = f"{base}_{n}", n + 1
        names.append(name)
    return names


class BlendIndex:
    """The blend's index, computed in blocks as far as asked and kept: component[n] is sample
    n's component, sample[n] its index within that component's samples.

    Tijdeman's rule: with d = 1/(2k - 2), sample n (1-based) goes to the component with the
    earliest deadline (c_i + 1 - d) / w_i among those at least d behind their share
    (w_i n - c_i >= d; one always is, since the shares' deficits sum to 1)."""

    def __init__(self, weights):
        self.weights = [float(w) for w in weights]
        self.counts = [0] * len(self.weights)
        self.component = np.zeros(0, np.int32)
        self.sample = np.zeros(0, np.int64)

    def upto(self, n: int):
        """Make the index cover samples 0..n-1."""
        while len(self.component) < n:
            start = len(self.component)
            comp, samp = np.empty(BLOCK, np.int32), np.empty(BLOCK, np.int64)
            w, c = self.weights, self.counts
            d = 1 / (2 * len(w) - 2) if len(w) > 1 else 0.0
            for j in range(BLOCK):
                n = start + j + 1
                behind = [i for i in range(len(w)) if w[i] * n - c[i] >= d - 1e-9]
                best = min(behind, key=lambda i: ((c[i] + 1 - d) / w[i], i))
                comp[j], samp[j] = best, c[best]
                c[best] += 1
            self.component = np.concatenate([self.component, comp])
            self.sample = np.concatenate([self.sample, samp])

    def consumed(self, n: int) -> np.ndarray:
        """Each component's samples among the first n."""
        self.upto(n)
        return np.bincount(self.component[:n], minlength=len(self.weights))


@dataclasses.dataclass
class BlendedTokens:
    """The components' token data (each with its own held-out split) and their blend."""

    components: list[Component]
    data: list[TokenData]

    @property
    def tokenizer(self):
        return self.data[0].tokenizer

    @property
    def vocab_size(self) -> int:
        return max(d.vocab_size for d in self.data)

    def describe(self) -> str:
        parts = ", ".join(
            f"{c.name} {c.weight:.3g} ({len(d.train):,})"
            for c, d in zip(self.components, self.data)
        )
        return f"{sum(len(d.train) for d in self.data):,} train tokens in a blend: {parts}"

    def batches(self, split: str, cfg, sharding):
        if split == "train":
            return BlendBatches(self, cfg, sharding)
        parts = {
            c.name: d.batches("val", cfg, sharding) for c, d in zip(self.components, self.data)
        }
        parts = {k: v for k, v in parts.items() if v is not None}
        if not parts:
            return None
        weights = {c.name: c.weight for c in self.components if c.name in parts}
        return BlendedEval(parts, weights)


def load_blend(source: str, tokenizer_spec, val_fraction, bin_dtype, tokenizer=None):
    """Each component read as `load_tokens` reads a source, all with one tokenizer: the given
    one, or the one the first component's loader makes."""
    components, data = parse_blend(source), []
    for c in components:
        d = load_tokens(c.source, tokenizer_spec, val_fraction, bin_dtype, tokenizer)
        tokenizer = tokenizer or d.tokenizer
        data.append(d)
    return BlendedTokens(components, data)


class BlendBatches:
    """Training batches of a blend: row r of step s is sample s * batch + r of the blend."""

    def __init__(self, blend: BlendedTokens, cfg, sharding):
        self.blend, self.sharding = blend, sharding
        self.seq_len, self.batch_size = cfg.model.seq_len, cfg.train.batch_size
        self.seed = cfg.train.seed
        self.index = BlendIndex([c.weight for c in blend.components])
        self.orders = {}  # (component, epoch) -> its windows' order, the latest few
        self.windows = []
        for c, d in zip(blend.components, blend.data):
            n = (len(d.train) - 1) // self.seq_len
            if n < 1:
                raise UserError(
                    f"blend component {c.name} ({c.source}) has {len(d.train)} train tokens, "
                    f"fewer than one sequence of {self.seq_len + 1}"
                )
            self.windows.append(n)

    def _order(self, component: int, epoch: int) -> np.ndarray:
        key = (component, epoch)
        if key not in self.orders:
            if len(self.orders) >= 2 * len(self.windows):
                self.orders.pop(next(iter(self.orders)))
            rng = np.random.default_rng([self.seed, 2, component, epoch])
            self.orders[key] = rng.permutation(self.windows[component])
        return self.orders[key]

    def start(self, component: int, k: int) -> int:
        """Where the component's k-th sample starts: its epoch's shuffled window order."""
        epoch, j = divmod(int(k), self.windows[component])
        return int(self._order(component, epoch)[j]) * self.seq_len

    def rows(self, step: int, row_slice: slice) -> np.ndarray:
        first = step * self.batch_size
        self.index.upto(first + self.batch_size)
        picked = range(first, first + self.batch_size)[row_slice]
        out = []
        for n in picked:
            i, k = int(self.index.component[n]), int(self.index.sample[n])
            d, s = self.blend.data[i], self.start(i, k)
            row = np.asarray(d.train[s : s + self.seq_len + 1])
            check_ids(row, d.vocab_size, f"{d.source or self.blend.components[i].source}", s)
            out.append(row)
        return np.stack(out).astype(np.int32)

    def __call__(self, step: int) -> jax.Array:
        shape = (self.batch_size, self.seq_len + 1)
        return jax.make_array_from_callback(
            shape, self.sharding, lambda idx: self.rows(step, idx[0])
        )

    def metrics(self, step: int) -> dict:
        """After step `step` (1-based): each component's samples so far and its epoch (0: the
        first pass over it)."""
        used = self.index.consumed(step * self.batch_size)
        out = {}
        for c, n, w in zip(self.blend.components, used, self.windows):
            out[f"samples/{c.name}"] = int(n)
            out[f"epoch/{c.name}"] = int(max(n - 1, 0) // w)
        return out

    def new_epochs(self, step: int) -> list[str]:
        """Components that started another epoch during step `step` (1-based), as lines."""
        before = self.metrics(step - 1) if step > 1 else {}
        now = self.metrics(step)
        return [
            f"step {step}: blend component {c.name} used all its {w:,} windows; epoch "
            f"{now[f'epoch/{c.name}'] + 1} of it starts"
            for c, w in zip(self.blend.components, self.windows)
            if now[f"epoch/{c.name}"] > before.get(f"epoch/{c.name}", 0)
        ]


@dataclasses.dataclass
class BlendedEval:
    """Each component's validation windows, and the weights that make the blend's loss."""

    parts: dict[str, EvalWindows]
    weights: dict[str, float]

    def results(self, run_one) -> dict:
        """{"loss": the blend's, "blend/NAME/loss": each component's} from run_one(batches)."""
        losses = {name: run_one(batches) for name, batches in self.parts.items()}
        total = sum(self.weights.values())
        out = {"loss": sum(self.weights[n] * m["loss"] for n, m in losses.items()) / total}
        for name, m in losses.items():
            out.update({f"blend/{name}/{k}": v for k, v in m.items()})
        return out
