"""The runnable "after" example of docs/migrating/transferqueue.md runs as written."""

from __future__ import annotations

import pathlib
import re

GUIDE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "migrating" / "transferqueue.md"


def test_the_transferqueue_guides_meshfeed_example_runs():
    text = GUIDE.read_text()
    after = text.split("After (meshfeed", 1)[1]
    code = re.search(r"```python\n(.*?)```", after, re.S)
    assert code is not None, "the guide lost its runnable example"
    exec(compile(code.group(1), str(GUIDE), "exec"), {})
