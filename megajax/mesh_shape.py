"""The mesh as a value: how many devices each axis has, by name, parsed once from `--mesh`.

Everything that reasons about a mesh without devices (the planner, the closed forms of
`analytic/`, the audit's minima, the dry run, `--mesh auto`) takes a `MeshShape`;
`core/mesh.make_mesh` lays real devices out on one. A new axis is a field here, its partition
specs in `core/sharding.py`, and the code that uses it (docs/architecture.md).

Accepted specs:
  "data=2,model=4"          explicit sizes (either may be omitted; it then takes the devices left)
  "data=2,pipe=2,model=2"   with pipeline stages (megajax/training/pipeline.py)
  "data=2,expert=4"         with a mixture of experts' experts split over 4 devices
                            (core/moe.py), which are one more data axis for everything else
  "2x4"                     shorthand for data x model
  "model=8"                 a model axis of 8, data takes whatever is left
  "auto"                    every device on "data"; the command lines resolve it with the run's
                            config instead (plan/auto.py: the planner's mesh when the run does
                            not fit there)
"""

from __future__ import annotations

import dataclasses
import math

DATA, MODEL, PIPE, EXPERT = "data", "model", "pipe", "expert"
# The device layout, outermost first: pipeline stages across nodes as Megatron-LM puts them,
# the expert axis inside the data axis (its all-to-alls want faster links than the gradients'
# reduction), the model axis innermost, where jax.make_mesh puts the fastest links.
LAYOUT = (PIPE, DATA, EXPERT, MODEL)
# the axes a mesh has only when they have more than one device
OPTIONAL = (PIPE, EXPERT)
AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class MeshShape:
    data: int = 1
    pipe: int = 1
    model: int = 1
    expert: int = 1

    def __post_init__(self):
        for name in LAYOUT:
            size = getattr(self, name)
            if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
                raise ValueError(f"mesh axis '{name}' needs a positive integer size, got {size!r}")

    # -- reading ----------------------------------------------------------------------------
    @classmethod
    def parse(cls, spec: str | None, devices: int) -> MeshShape:
        """The shape `spec` asks for on `devices` devices, or ValueError naming what is wrong
        (the caller adds which devices there are)."""
        s = (spec or AUTO).strip().lower().replace(" ", "")
        if s == AUTO:
            return cls(data=devices)
        sizes = _sizes(spec, s)
        sizes.setdefault(PIPE, 1)
        sizes.setdefault(EXPERT, 1)
        if DATA not in sizes and MODEL not in sizes:
            sizes[MODEL] = 1
        for name, other in ((DATA, MODEL), (MODEL, DATA)):
            if name not in sizes:
                given = sizes[other] * sizes[PIPE] * sizes[EXPERT]
                if devices % given:
                    raise ValueError(
                        f"mesh '{spec}': {_named(sizes)} does not divide the number of devices"
                    )
                sizes[name] = devices // given
        shape = cls(**sizes)
        if shape.devices != devices:
            raise ValueError(f"mesh '{spec}' needs {shape.devices} devices ({_named(sizes)})")
        return shape

    @classmethod
    def of(cls, mesh) -> MeshShape:
        """The shape of a jax Mesh (or anything with a `.shape` mapping of axis sizes)."""
        return cls(**{name: int(mesh.shape.get(name, 1)) for name in LAYOUT})

    @staticmethod
    def devices_asked(spec: str | None) -> int | None:
        """How many devices a well-formed spec asks for (the product of its sizes; auto: 8, to
        suggest); None when the spec itself is wrong (no device count would do)."""
        s = (spec or AUTO).strip().lower().replace(" ", "")
        try:
            sizes = {} if s == AUTO else _sizes(spec, s)
        except ValueError:
            return None
        return math.prod(sizes.values()) if sizes else 8

    # -- writing ----------------------------------------------------------------------------
    def __str__(self) -> str:
        """The spec that parses back to this shape: "data=2,model=4", "data=2,pipe=2,model=2",
        "data=2,expert=4,model=1"."""
        return ",".join(
            f"{name}={getattr(self, name)}"
            for name in (DATA, PIPE, EXPERT, MODEL)
            if name not in OPTIONAL or getattr(self, name) > 1
        )

    def sizes(self) -> dict[str, int]:
        """{axis: size} of the jax Mesh's axes, outermost first (pipe only with stages): what
        logs and results name a mesh by."""
        return {name: getattr(self, name) for name in self.axis_names}

    # -- derived figures --------------------------------------------------------------------
    @property
    def devices(self) -> int:
        return self.data * self.pipe * self.expert * self.model

    @property
    def batch_shards(self) -> int:
        """The shards a batch's rows split over: "data" and "expert" (for everything but the
        experts, one more data axis)."""
        return self.data * self.expert

    @property
    def pipelined(self) -> bool:
        return self.pipe > 1

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The jax Mesh's axes, outermost first: ("data", "model"), "pipe" before them and
        "expert" between them when they have more than one device."""
        return tuple(n for n in LAYOUT if n not in OPTIONAL or getattr(self, n) > 1)

    @property
    def dims(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in self.axis_names)

    def rows_per_microbatch(self, batch_size: int, microbatches: int = 1) -> int:
        """Rows of one microbatch on one data shard (of "data" and "expert")."""
        return batch_size // microbatches // self.batch_shards


def _named(sizes: dict) -> str:
    return " x ".join(
        f"{a}={sizes[a]}" for a in LAYOUT if a in sizes and (a not in OPTIONAL or sizes[a] > 1)
    )


def _sizes(spec: str | None, s: str) -> dict[str, int]:
    """The sizes a non-auto spec names, checked one by one."""
    if "x" in s and "=" not in s:
        parts = s.split("x")
        if len(parts) != 2:
            raise ValueError(f"mesh '{spec}': the shorthand is DATAxMODEL, e.g. 2x4")
        pairs = list(zip((DATA, MODEL), parts))
    else:
        pairs = []
        for item in filter(None, s.split(",")):
            if "=" not in item:
                raise ValueError(f"mesh '{spec}': expected AXIS=SIZE items such as data=2,model=4")
            pairs.append(tuple(item.split("=", 1)))
    sizes: dict[str, int] = {}
    for name, value in pairs:
        if name not in LAYOUT:
            raise ValueError(
                f"mesh '{spec}': unknown axis '{name}' (axes are 'data', 'pipe', 'expert' and "
                "'model')"
            )
        if name in sizes:
            raise ValueError(f"mesh '{spec}': axis '{name}' given twice")
        try:
            size = int(value)
        except ValueError:
            raise ValueError(
                f"mesh '{spec}': size of '{name}' must be an integer, got '{value}'"
            ) from None
        if size <= 0:
            raise ValueError(f"mesh '{spec}': size of '{name}' must be positive, got {size}")
        sizes[name] = size
    if not sizes:
        raise ValueError(f"mesh '{spec}' names no axis")
    return sizes
