"""notebooks/quickstart.ipynb runs top to bottom on 8 simulated CPU devices, so it cannot rot."""

import os

import nbformat
import pytest
from conftest import ROOT
from nbclient import NotebookClient


@pytest.mark.full
def test_quickstart_notebook_executes():
    path = ROOT / "notebooks" / "quickstart.ipynb"
    nb = nbformat.read(path, as_version=4)
    env_flags = os.environ.pop("XLA_FLAGS", None)  # the notebook sets its own device count
    os.environ["XLA_FLAGS"] = " ".join(
        f
        for f in (env_flags or "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    )
    try:
        NotebookClient(
            nb,
            timeout=300,
            kernel_name="python3",
            resources={"metadata": {"path": str(path.parent)}},
        ).execute()
    finally:
        os.environ.pop("XLA_FLAGS")
        if env_flags is not None:
            os.environ["XLA_FLAGS"] = env_flags
    text = "\n".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert "8 devices: cpu" in text
    assert "share 0.250" in text and "share 1.000" in text  # split weights hold 1/4, LayerNorms all
    assert "forward [2], backward [2]" in text
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, "the loss plot was not drawn"
    assert "ROMEO:" in text
