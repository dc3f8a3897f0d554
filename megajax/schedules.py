"""Pipeline schedules as tables: which microbatch each stage runs forward or backward at each
tick, where every activation and gradient waits between the stages, and the bubble.

The pipelined train step (megajax/training/pipeline.py) runs one action per stage per tick
and moves the results one stage on after every tick, so a schedule is fully described by
its table; the step reads it, and so do the bubble and the buffer sizes (how many
microbatches' stage inputs a stage keeps: the activation memory of the schedule). No jax.

Schedules (Narayanan et al. 2021, section 2.2), over p stages, m microbatches, v model
chunks per stage (virtual stage c*p + s runs on stage s as its chunk c):
  gpipe        every forward, then every backward (Huang et al. 2019): keeps m inputs
  1f1b         p - s - 1 warm-up forwards, then one forward and one backward in turn
               (PipeDream-Flush): keeps at most p inputs on the first stage
  interleaved  1F1B over v chunks per stage, microbatches in groups of p (needs m % p == 0):
               the bubble shrinks v times for v times the point-to-point sends
Each forward and each backward takes one tick here (the backward recomputes its chunk's
forward first, so the tick of a backward is the longer one; the count of ticks is what the
bubble is measured in, as in the paper).
"""

from __future__ import annotations

import dataclasses

SCHEDULES = ("gpipe", "1f1b", "interleaved")
IDLE, FORWARD, BACKWARD = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Action:
    kind: int  # FORWARD or BACKWARD
    chunk: int  # the stage's model chunk (0 unless interleaved)
    micro: int  # the microbatch


def check(schedule: str, stages: int, micro: int, chunks: int = 1) -> None:
    """ValueError for a schedule these sizes cannot run."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if chunks < 1 or (chunks > 1) != (schedule == "interleaved"):
        raise ValueError(
            f"the {schedule} schedule runs "
            f"{'2 or more chunks' if schedule == 'interleaved' else '1 chunk'} per stage, not "
            f"{chunks}"
        )
    if schedule == "interleaved" and micro % stages:
        raise ValueError(
            f"the interleaved schedule needs the microbatches ({micro}) to be a multiple of the "
            f"pipeline stages ({stages})"
        )


def stage_order(schedule: str, stages: int, micro: int, chunks: int, stage: int) -> list[Action]:
    """The actions of one stage, in the order it runs them (Megatron-LM's order)."""
    if schedule == "gpipe":
        return [Action(FORWARD, 0, i) for i in range(micro)] + [
            Action(BACKWARD, 0, i) for i in range(micro)
        ]
    total = micro * chunks

    def nth(k: int, kind: int) -> Action:
        group, within = divmod(k, stages * chunks)
        chunk = within // stages
        if kind == BACKWARD:
            chunk = chunks - 1 - chunk
        return Action(kind, chunk, group * stages + within % stages)

    if schedule == "1f1b":
        warmup = min(stages - stage - 1, micro)
    else:
        warmup = min((stages - stage - 1) * 2 + (chunks - 1) * stages, total)
    order = [nth(k, FORWARD) for k in range(warmup)]
    for k in range(total - warmup):
        order += [nth(warmup + k, FORWARD), nth(k, BACKWARD)]
    return order + [nth(k, BACKWARD) for k in range(total - warmup, total)]


@dataclasses.dataclass(frozen=True)
class Table:
    """A schedule run tick by tick. Per tick and stage: the action (kind, chunk, micro, the
    buffer slot of its input activation, of its incoming gradient) and the slots the
    activation and gradient arriving at the end of the tick go to (-1: none)."""

    schedule: str
    stages: int
    micro: int
    chunks: int
    ticks: list  # ticks x stages of (kind, chunk, micro, act slot, grad slot)
    arrive_act: list  # ticks x stages: slot of the activation received after the tick
    arrive_grad: list  # ticks x stages: slot of the gradient received after the tick
    act_slots: int  # stage-input buffers a stage needs (the schedule's activation memory)
    grad_slots: int

    @property
    def num_ticks(self) -> int:
        return len(self.ticks)

    @property
    def busy_ticks(self) -> int:
        """Ticks each stage runs an action: a forward and a backward per chunk and microbatch."""
        return 2 * self.chunks * self.micro

    @property
    def bubble(self) -> float:
        """Idle time over useful time on each stage, the paper's bubble fraction."""
        return (self.num_ticks - self.busy_ticks) / self.busy_ticks

    def sends(self, kind: int) -> tuple[list[int], list[tuple]]:
        """Who passes a result on after each tick: for `kind` FORWARD (activations one stage on)
        or BACKWARD (gradients one stage back), (each tick's pattern, an index into the list;
        the list of patterns, each the (source, target) stage pairs of one tick). Pattern 0 is
        none. Interleaved, the last stage's chunk feeds the first's next one: a ring."""
        p, last = self.stages, self.stages * self.chunks - 1
        step, skip = (1, last) if kind == FORWARD else (-1, 0)
        patterns, index = [()], []
        for row in self.ticks:
            pairs = tuple(
                (s, (s + step) % p)
                for s, (k, chunk, *_) in enumerate(row)
                if k == kind and chunk * p + s != skip
            )
            if pairs not in patterns:
                patterns.append(pairs)
            index.append(patterns.index(pairs))
        return index, patterns

    def first_stage_inputs(self) -> int:
        """The most microbatches whose forward stage 0 has run and whose backward it has not
        (what it must keep to run those backwards)."""
        most = held = 0
        for row in self.ticks:
            kind = row[0][0]
            held += (kind == FORWARD) - (kind == BACKWARD)
            most = max(most, held)
        return most


def bubble_formula(schedule: str, stages: int, micro: int, chunks: int = 1) -> float:
    """The paper's closed form: (p - 1) / m, interleaved (p - 1) / (v m)."""
    return (stages - 1) / (micro * (chunks if schedule == "interleaved" else 1))


def build(schedule: str, stages: int, micro: int, chunks: int = 1) -> Table:
    """Run every stage's order tick by tick: an action runs once its inputs have arrived (a
    forward, its previous virtual stage's forward in an earlier tick; a backward, its own
    forward and its next virtual stage's backward), otherwise the stage waits."""
    check(schedule, stages, micro, chunks)
    p, last = stages, stages * chunks - 1
    orders = [stage_order(schedule, p, micro, chunks, s) for s in range(p)]
    done: dict = {}  # (kind, virtual stage, micro) -> tick it ran
    acts, grads = [_Slots() for _ in range(p)], [_Slots() for _ in range(p)]
    nxt, ticks, arrive_act, arrive_grad = [0] * p, [], [], []
    while any(nxt[s] < len(orders[s]) for s in range(p)):
        t, row = len(ticks), []
        for s in range(p):
            a = orders[s][nxt[s]] if nxt[s] < len(orders[s]) else None
            vs = None if a is None else a.chunk * p + s
            if a is None or not _ready(a, vs, last, done, t):
                row.append((IDLE, 0, 0, -1, -1))
                continue
            nxt[s] += 1
            done[(a.kind, vs, a.micro)] = t
            act = acts[s].get((vs, a.micro)) if vs > 0 else -1
            grad = grads[s].get((vs, a.micro)) if a.kind == BACKWARD and vs < last else -1
            if a.kind == BACKWARD:
                acts[s].free((vs, a.micro))
                grads[s].free((vs, a.micro))
            row.append((a.kind, a.chunk, a.micro, act, grad))
        if len(ticks) > 4 * (micro * chunks + p) * 2:
            raise AssertionError(f"{schedule} schedule deadlocked")  # a bug, never a user's
        ticks.append(row)
        arrive_act.append(_arrivals(row, p, last, acts, FORWARD, +1))
        arrive_grad.append(_arrivals(row, p, last, grads, BACKWARD, -1))
    return Table(
        schedule,
        p,
        micro,
        chunks,
        ticks,
        arrive_act,
        arrive_grad,
        max(max(a.most for a in acts), 1),
        max(max(g.most for g in grads), 1),
    )


def _ready(a: Action, vs: int, last: int, done: dict, t: int) -> bool:
    def before(key):
        return done.get(key, t) < t

    if a.kind == FORWARD:
        return vs == 0 or before((FORWARD, vs - 1, a.micro))
    return before((FORWARD, vs, a.micro)) and (vs == last or before((BACKWARD, vs + 1, a.micro)))


def _arrivals(row, p: int, last: int, slots: list, kind: int, step: int) -> list:
    """The slot each stage puts what arrives after this tick in (sent by its neighbour's
    forward for step +1, backward for step -1)."""
    out = [-1] * p
    for s, (k, chunk, micro, _, _) in enumerate(row):
        vs = chunk * p + s
        if k != kind or not 0 <= vs + step <= last:
            continue
        out[(s + step) % p] = slots[(s + step) % p].take((vs + step, micro))
    return out


class _Slots:
    """Buffer slots handed out as values arrive and taken back when their backward has run."""

    def __init__(self):
        self.held, self.most = {}, 0

    def take(self, key) -> int:
        used = set(self.held.values())
        slot = next(n for n in range(len(used) + 1) if n not in used)
        self.held[key] = slot
        self.most = max(self.most, len(self.held))
        return slot

    def get(self, key) -> int:
        return self.held[key]

    def free(self, key) -> None:
        self.held.pop(key, None)
