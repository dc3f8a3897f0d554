"""Every command block of the guides runs (tests/test_docs.py says how; a file of its own so that
the suite's two workers share the pages)."""

import pytest
from test_docs import page_id, run_page, runnable_pages


@pytest.mark.full
@pytest.mark.parametrize("page", [p for p in runnable_pages() if "guides" in p.parts], ids=page_id)
def test_guide_commands_run(page, tmp_path):
    run_page(page, tmp_path)
