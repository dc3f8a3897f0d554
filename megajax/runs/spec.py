"""A run resolved once: the config, the mesh and the workdir that train.py and eval.py hand on.

The command lines build a RunSpec from what they have checked (the config validated as it
loads, a pretrained workdir's shape read once, `--mesh` resolved to one shape); training and
evaluation take it as it is and check none of it again. A Python caller with a config of its
own gets the same checks from `RunSpec.resolve` (which `train(cfg, mesh, workdir)` calls).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jax.sharding import Mesh

from megajax.config import Config
from megajax.core.mesh import as_mesh
from megajax.mesh_shape import MeshShape
from megajax.runs.workdir import with_pretrained_shape


@dataclasses.dataclass(frozen=True)
class RunSpec:
    # validated; with train.init_from, the model's shape and tokenizer are the pretrained one's
    cfg: Config
    mesh: Mesh  # a megajax mesh (megajax/core/mesh.py)
    workdir: Path
    pretrained: Path | None = None  # train.init_from's workdir

    @property
    def shape(self) -> MeshShape:
        return MeshShape.of(self.mesh)

    @classmethod
    def resolve(cls, cfg: Config, mesh, workdir) -> RunSpec:
        """`cfg` validated (a caller may have changed it since loading), with the pretrained
        workdir's shape; `mesh` (a jax Mesh or a spec such as "2x4") as a megajax mesh."""
        workdir = Path(workdir)
        cfg, pretrained = with_pretrained_shape(cfg.validate(), workdir)
        return cls(cfg, as_mesh(mesh), workdir, pretrained)
